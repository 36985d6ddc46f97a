//! The store's files on disk, apart from what is in them: created private,
//! checked before serving, and watched while serving.
//!
//! - **Private**: the database is created 0600. SQLite gives its `-wal` and
//!   `-shm` files the database file's mode, so they are 0600 too. The store
//!   holds command lines and environment variables of the processes it saw.
//! - **Checked**: `PRAGMA quick_check` at open. A valid header over corrupt
//!   pages otherwise opens fine, says "serving", and fails every write. The
//!   check reads every page once, at start only: 1.5 s for 560 MB from a
//!   cold cache, the file read ahead sequentially (BENCHMARKS.md).
//! - **Watched**: [`FileWatch`] compares the device and inode of the paths
//!   with those seen at open. A database deleted or replaced under a running
//!   collector would otherwise take acked writes into an unlinked file, lost
//!   at the next start; the collector stops acking and exits instead.
//! - **One writer**: [`WriterLock`] holds an advisory lock beside the file
//!   while a collector serves it. Two collectors writing one file would each
//!   keep their own chains, rollups and lost-agent timers, so a second one
//!   refuses to start and names the first.

use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rusqlite::Connection;

/// The mode of the database file, and so of its `-wal` and `-shm` files.
pub const DB_FILE_MODE: u32 = 0o600;

/// The files of the database at `path`: itself, its WAL and its shared memory.
fn files(path: &Path) -> [PathBuf; 3] {
    let with = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    };
    [path.to_path_buf(), with("-wal"), with("-shm")]
}

/// Creates an empty database file at `path`, mode [`DB_FILE_MODE`], unless
/// one exists (SQLite takes an empty file as an empty database). An existing
/// file keeps the mode its owner gave it.
pub fn create_private(path: &Path) -> Result<()> {
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(DB_FILE_MODE)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating the store {}", path.display())),
    }
}

/// An exclusive `flock` on `<db>.lock`, held while a collector writes the
/// store; the file says who holds it. The kernel drops the lock when the
/// holder exits, however it exits, so a crash never leaves the store locked.
#[derive(Debug)]
pub struct WriterLock {
    _file: std::fs::File,
}

impl WriterLock {
    /// Takes the lock for the store at `db`, recording `holder` (who this is,
    /// e.g. the listen address); fails, naming the holder, when another
    /// process (or another collector in this one) has it.
    pub fn acquire(db: &Path, holder: &str) -> Result<WriterLock> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        let path = lock_path(db);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(DB_FILE_MODE)
            .open(&path)
            .with_context(|| format!("opening the store's lock file {}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(err).with_context(|| format!("locking {}", path.display()));
            }
            let mut who = String::new();
            let _ = file.read_to_string(&mut who);
            bail!(
                "the store {} is already being written by another collector ({}); one collector \
                 writes a SQLite store: stop that one, or give this one another --db",
                db.display(),
                match who.trim() {
                    "" => "its lock file is empty",
                    w => w,
                }
            );
        }
        let who = format!("pid {}, {holder}", std::process::id());
        file.set_len(0)?;
        file.rewind()?;
        file.write_all(who.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(WriterLock { _file: file })
    }
}

/// `<db>.lock`: beside the database, not on it, since SQLite's own locks
/// are on the database file (fcntl locks, which flock does not see, but a
/// close of any descriptor of the file would drop them).
fn lock_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Refuses a database whose pages are damaged, with SQLite's own findings.
pub fn quick_check(conn: &Connection, path: &Path) -> Result<()> {
    read_ahead(path);
    let found: Vec<String> = conn
        .prepare("PRAGMA quick_check(10)")
        .and_then(|mut stmt| {
            stmt.query_map([], |r| r.get::<_, String>(0))?
                .collect::<rusqlite::Result<_>>()
        })
        .with_context(|| {
            format!(
                "{} failed SQLite's integrity check (quick_check) at open",
                path.display()
            )
        })?;
    if found != ["ok"] {
        bail!(
            "{} failed SQLite's integrity check (quick_check): {}; the collector will not write \
             into a damaged store: restore it from a backup, or move it aside to start a new one",
            path.display(),
            found.join("; ")
        );
    }
    Ok(())
}

/// Reads the file once, front to back, into the page cache, so that
/// quick_check, which visits the pages in b-tree order, finds them in
/// memory: from a cold cache a 560 MB store took 14.6 s to open by random
/// reads, 1.5 s read ahead (BENCHMARKS.md). A read error is left to SQLite.
fn read_ahead(path: &Path) {
    use std::io::Read;
    let Ok(mut file) = std::fs::File::open(path) else {
        return;
    };
    let mut buf = vec![0u8; 1 << 20];
    while matches!(file.read(&mut buf), Ok(n) if n > 0) {}
}

/// Which file a path named when the store was opened: (device, inode), or
/// None where there was no file.
type Identity = Option<(u64, u64)>;

fn identity(path: &Path) -> Identity {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The database, `-wal` and `-shm` files as they were once the store was
/// open; [`FileWatch::check`] says when any was deleted or replaced since.
#[derive(Debug, Clone)]
pub struct FileWatch {
    files: Vec<(PathBuf, Identity)>,
}

impl FileWatch {
    /// Records the files of the open store at `path`. A `-wal` or `-shm`
    /// that does not exist yet is watched for the first one that does.
    pub fn new(path: &Path) -> Result<FileWatch> {
        let files: Vec<(PathBuf, Identity)> = files(path)
            .into_iter()
            .map(|p| {
                let id = identity(&p);
                (p, id)
            })
            .collect();
        if files[0].1.is_none() {
            bail!("the store {} is not there to watch", path.display());
        }
        Ok(FileWatch { files })
    }

    /// Fails when a file of the store was deleted or replaced since it was
    /// opened: writes would go to a file that the next start no longer sees.
    /// Three `stat` calls, a few microseconds beside a commit's fsync.
    pub fn check(&mut self) -> Result<()> {
        for (path, seen) in &mut self.files {
            let now = identity(path);
            match (*seen, now) {
                (Some(a), Some(b)) if a == b => {}
                // Created since the open (the first WAL): watch it from now.
                (None, Some(_)) => *seen = now,
                (None, None) => {}
                (Some(_), None) => bail!(
                    "the store file {} was deleted while the collector was writing to it",
                    path.display()
                ),
                (Some(_), Some(_)) => bail!(
                    "the store file {} was replaced by another file while the collector was \
                     writing to it",
                    path.display()
                ),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watch_tells_deleted_from_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        create_private(&db).unwrap();
        let mut watch = FileWatch::new(&db).unwrap();
        watch.check().unwrap();
        // A WAL that appears later is adopted, then watched.
        let wal = dir.path().join("s.db-wal");
        std::fs::write(&wal, b"").unwrap();
        watch.check().unwrap();
        std::fs::remove_file(&wal).unwrap();
        let err = watch.check().unwrap_err().to_string();
        assert!(err.contains("s.db-wal") && err.contains("deleted"), "{err}");

        let mut watch = FileWatch::new(&db).unwrap();
        let other = dir.path().join("other");
        std::fs::write(&other, b"").unwrap();
        std::fs::rename(&other, &db).unwrap();
        let err = watch.check().unwrap_err().to_string();
        assert!(err.contains("s.db") && err.contains("replaced"), "{err}");
    }

    #[test]
    fn a_second_writer_is_refused_and_told_who_holds_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let first = WriterLock::acquire(&db, "listening on 127.0.0.1:7000").unwrap();
        let err = WriterLock::acquire(&db, "listening on 127.0.0.1:7001")
            .unwrap_err()
            .to_string();
        let holder = format!("pid {}, listening on 127.0.0.1:7000", std::process::id());
        assert!(err.contains(&holder) && err.contains("s.db"), "{err}");
        drop(first);
        // Released with its holder: the next one takes it.
        WriterLock::acquire(&db, "listening on 127.0.0.1:7001").unwrap();
    }

    #[test]
    fn a_new_file_is_private_and_an_old_one_keeps_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        create_private(&db).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&db), DB_FILE_MODE);
        let shared = dir.path().join("shared.db");
        std::fs::write(&shared, b"").unwrap();
        std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o640))
            .unwrap();
        create_private(&shared).unwrap();
        assert_eq!(mode(&shared), 0o640);
    }
}
