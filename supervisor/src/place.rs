//! Where `oomscope run` itself lives against the memory cgroup it watches.
//!
//! Sharing the child's cgroup, one OOM there can take the supervisor with the
//! child (a second kill when the first freed too little, or v2's
//! `memory.oom.group`), and the evidence with both. So the supervisor moves
//! itself to a new cgroup beside the level that owns the limit, with no limit
//! of its own, and every child joins the original cgroup between fork and
//! exec: no instruction of the command ever runs outside its cgroup. On v2
//! the new cgroup is a leaf (no process may sit in a level that hands the
//! controller down). The cgroup it made is removed when it exits.
//!
//! Where it cannot move (no permission, a read-only cgroupfs, a limit on the
//! top of the tree a container sees), it says so once and goes on; the
//! collector then reads a lost supervisor's last readings instead.

use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use oomscope_agent_core::readers::cgroup::{self, MemoryCgroup};
use oomscope_agent_core::readers::HostPaths;
use oomscope_analysis::units::bytes;

/// Test only: keeps the supervisor in the cgroup it watches, at
/// oom_score_adj 1000, so that the kernel kills it first (tests of the
/// collector's reading of a lost supervisor). Never set it in production.
pub const STAY_IN_CGROUP_ENV: &str = "OOMSCOPE_TEST_STAY_IN_CGROUP";

/// The prefix of the cgroups the supervisor makes for itself; its pid follows.
const SUPERVISOR_CGROUP_PREFIX: &str = "oomscope-supervisor-";

/// Where the supervisor placed itself, and what the child must join.
pub struct Placement {
    /// The child's cgroup.procs, where the supervisor left that cgroup.
    home_procs: Option<CString>,
    /// The cgroup the supervisor made for itself (removed on drop).
    made: Option<PathBuf>,
    /// For the Hello label: "moved out of ..." or "stayed in ...".
    pub description: String,
    /// The test switch was set: stay, and be the OOM killer's first choice.
    pub test_stay: bool,
}

impl Placement {
    /// Moves the supervisor out of its memory cgroup where a limit could
    /// take it, and says on stderr (once) when it cannot.
    pub fn engage(paths: &HostPaths) -> Placement {
        let stay = |description: String| Placement {
            home_procs: None,
            made: None,
            description,
            test_stay: false,
        };
        let pid = std::process::id();
        let Some(cg) = cgroup::locate(paths, pid) else {
            return stay("has no memory cgroup to leave".into());
        };
        if std::env::var(STAY_IN_CGROUP_ENV).is_ok_and(|v| v == "1") {
            let mut p = stay(format!(
                "stayed in {}, the cgroup it watches, at oom_score_adj 1000 ({STAY_IN_CGROUP_ENV}=1, test only)",
                cg.path
            ));
            p.test_stay = true;
            return p;
        }
        let levels = cgroup::read_levels(paths, &cg);
        let info = cgroup::info(&levels, &cg);
        if info.limit_bytes == 0 {
            return stay(format!(
                "stayed in {}: no memory limit on it or above",
                cg.path
            ));
        }
        let Some(depth) = levels.iter().position(|l| l.path == info.limit_owner) else {
            return stay(format!(
                "stayed in {}: its limit's level was not found",
                cg.path
            ));
        };
        match move_beside(&cg, depth, &info.limit_owner, pid) {
            Ok((made, path)) => Placement {
                home_procs: CString::new(cg.dir.join("cgroup.procs").as_os_str().as_bytes()).ok(),
                made: Some(made),
                description: format!(
                    "moved out of {} (limit {} on {}) to {path}, which has no limit of its own; the child runs in {}",
                    cg.path,
                    bytes(info.limit_bytes),
                    info.limit_owner,
                    cg.path
                ),
                test_stay: false,
            },
            Err(why) => {
                eprintln!(
                    "oomscope: the supervisor stays in the memory cgroup it watches ({}): {why}; \
                     an OOM there may kill it with the child, and the collector then judges \
                     from its last readings",
                    cg.path
                );
                stay(format!("stayed in {}, the cgroup it watches: {why}", cg.path))
            }
        }
    }

    /// The cgroup.procs the child writes itself into before exec, where the
    /// supervisor left the child's cgroup.
    pub fn child_cgroup_procs(&self) -> Option<&CString> {
        self.home_procs.as_ref()
    }
}

impl Drop for Placement {
    /// Back into the child's cgroup (a cgroup with a process cannot be
    /// removed), then the cgroup it made is removed.
    fn drop(&mut self) {
        let Some(made) = &self.made else { return };
        if let Some(home) = &self.home_procs {
            let home = Path::new(std::ffi::OsStr::from_bytes(home.as_bytes()));
            let moved = write_pid(home, std::process::id()).is_ok()
                || made.parent().and_then(Path::parent).is_some_and(|up| {
                    write_pid(&up.join("cgroup.procs"), std::process::id()).is_ok()
                });
            if !moved {
                return;
            }
        }
        remove_when_empty(made);
    }
}

/// How long the supervisor waits for the kernel to let go of the cgroup it
/// made (a helper process it ran, exiting, still counts for a moment).
pub const CLEANUP_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Removes `dir`, retrying while the kernel still counts a task in it.
fn remove_when_empty(dir: &Path) {
    let until = std::time::Instant::now() + CLEANUP_WAIT;
    while let Err(e) = std::fs::remove_dir(dir) {
        if e.kind() == std::io::ErrorKind::NotFound || std::time::Instant::now() >= until {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Makes `<parent of the limit's level>/oomscope-supervisor-<pid>` and moves
/// this process into it: (its directory, its cgroup path), or why not.
fn move_beside(
    cg: &MemoryCgroup,
    depth: usize,
    owner_path: &str,
    pid: u32,
) -> Result<(PathBuf, String), String> {
    let mut owner_dir = cg.dir.clone();
    for _ in 0..depth {
        owner_dir.pop();
    }
    if owner_dir == cg.mount || !owner_dir.starts_with(&cg.mount) {
        return Err(format!(
            "its limit is on {owner_path}, the top of the cgroup tree it can see, which has no sibling here"
        ));
    }
    let parent = owner_dir
        .parent()
        .ok_or_else(|| format!("{} has no parent", owner_dir.display()))?;
    remove_stale(parent);
    let name = format!("{SUPERVISOR_CGROUP_PREFIX}{pid}");
    let dir = parent.join(&name);
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    if let Err(e) = write_pid(&dir.join("cgroup.procs"), pid) {
        let _ = std::fs::remove_dir(&dir);
        return Err(format!("cannot move into {}: {e}", dir.display()));
    }
    let parent_path = match owner_path.trim_end_matches('/').rfind('/') {
        Some(0) | None => String::new(),
        Some(i) => owner_path[..i].to_string(),
    };
    Ok((dir, format!("{parent_path}/{name}")))
}

/// Removes the empty cgroups of supervisors that are gone (killed before
/// they could clean up). A cgroup with a process in it cannot be removed,
/// so a live supervisor's is never touched.
fn remove_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SUPERVISOR_CGROUP_PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

fn write_pid(procs: &Path, pid: u32) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(procs)?
        .write_all(pid.to_string().as_bytes())
}

/// Between fork and exec: the child writes itself ("0" is the writer) into
/// `procs`. Only raw system calls (async-signal-safe); a failure stops the
/// exec, so that the command never runs outside its cgroup.
pub fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: a NUL-terminated path we own and a static buffer.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = libc::write(fd, b"0".as_ptr().cast(), 1);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if n != 1 {
            return Err(err);
        }
    }
    Ok(())
}
