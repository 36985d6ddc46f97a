//! A throwaway PostgreSQL cluster for a test: initdb in a temporary
//! directory, started on a Unix socket in that directory (no port to
//! collide on), as an unprivileged user when the tests run as root
//! (PostgreSQL refuses to run as root), stopped and removed on drop.
//!
//! `start` fails with the reason when the binaries are missing or the
//! server does not start: a test that needs PostgreSQL fails, never skips
//! (scripts/test installs Debian's `postgresql`).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The user the cluster runs as when the tests run as root.
pub const PG_USER: &str = "oomscope-pg";

/// How long `useradd` may stay busy with another test's (it locks /etc/passwd).
const USERADD_PATIENCE: Duration = Duration::from_secs(20);

/// A running cluster; [`PgCluster::url`] reaches its `postgres` database.
pub struct PgCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    url: String,
}

impl PgCluster {
    /// initdb and start a cluster of the test's own.
    pub fn start() -> Result<PgCluster, String> {
        let bin = bin_dir()?;
        let as_root = is_root();
        if as_root {
            ensure_user()?;
        }
        let dir = tempfile::Builder::new()
            .prefix("oomscope-pg")
            .tempdir()
            .map_err(|e| format!("a temporary directory: {e}"))?;
        if as_root {
            let uid = id_of(PG_USER)?;
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(uid))
                .map_err(|e| format!("chown {}: {e}", dir.path().display()))?;
        }
        let data = dir.path().join("data");
        let cluster = PgCluster {
            url: format!(
                "postgresql://postgres@{}:5432/postgres",
                dir.path().display().to_string().replace('/', "%2F")
            ),
            dir,
            bin,
        };
        cluster.pg(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-A".as_ref(),
                "trust".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
                "--no-sync".as_ref(),
                "--no-instructions".as_ref(),
            ],
        )?;
        let options = format!(
            "-k {} -p 5432 -c listen_addresses='' -c max_connections=60",
            cluster.dir.path().display()
        );
        cluster.pg(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-l".as_ref(),
                cluster.log_path().as_os_str(),
                "-o".as_ref(),
                options.as_ref(),
                "-w".as_ref(),
                "-t".as_ref(),
                "60".as_ref(),
                "start".as_ref(),
            ],
        )?;
        Ok(cluster)
    }

    /// `postgresql://postgres@<socket dir>:5432/postgres`, for `--db`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("log")
    }

    /// Runs `tool` of the PostgreSQL binaries (as [`PG_USER`] under root).
    fn pg(&self, tool: &str, args: &[&std::ffi::OsStr]) -> Result<Output, String> {
        let path = self.bin.join(tool);
        let mut c = match is_root() {
            true => {
                let mut c = Command::new("runuser");
                c.args(["-u", PG_USER, "--"]).arg(&path);
                c
            }
            false => Command::new(&path),
        };
        c.args(args).current_dir(self.dir.path());
        let out = c
            .output()
            .map_err(|e| format!("running {}: {e}", path.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{tool} failed ({}): {}{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.log()
            ));
        }
        Ok(out)
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = self.pg(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                // pg_ctl's shutdown mode (no checkpoint: a throwaway cluster).
                "--mode=immediate".as_ref(),
                "-w".as_ref(),
                "stop".as_ref(),
            ],
        );
    }
}

/// Where initdb and pg_ctl are: on PATH, or Debian's versioned directory.
fn bin_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .find(|p| p.join("initdb").is_file() && p.join("pg_ctl").is_file())
    }) {
        return Ok(dir);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    found.retain(|p| p.join("initdb").is_file());
    found.sort();
    found.pop().ok_or_else(|| {
        "PostgreSQL's initdb is neither on PATH nor in /usr/lib/postgresql/*/bin: install \
         Debian's postgresql package (scripts/test does)"
            .to_string()
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn id_of(user: &str) -> Result<u32, String> {
    let out = Command::new("id")
        .args(["-u", user])
        .output()
        .map_err(|e| format!("id -u {user}: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| format!("no user {user}"))
}

/// Adds [`PG_USER`] once; tests running beside each other may race to.
fn ensure_user() -> Result<(), String> {
    let deadline = Instant::now() + USERADD_PATIENCE;
    loop {
        if id_of(PG_USER).is_ok() {
            return Ok(());
        }
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                PG_USER,
            ])
            .output()
            .map_err(|e| format!("useradd: {e}"))?;
        // 9: added meanwhile by another test; 10: /etc/passwd busy, retry.
        match out.status.code() {
            Some(0) | Some(9) => return Ok(()),
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            _ => {
                return Err(format!(
                    "useradd {PG_USER}: {}",
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        }
    }
}
