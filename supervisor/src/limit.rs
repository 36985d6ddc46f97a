//! `oomscope run --memory-limit`: a memory cgroup made for the run, so that a
//! failure seen under a container's limit reproduces under the same limit
//! without the user making the cgroup by hand.
//!
//! The cgroup is made below the supervisor's own memory cgroup on v1 (v1
//! nests under a level with processes) and beside it on v2 (a v2 level with
//! processes cannot hand the controller down), so a limit above still
//! counts. The supervisor moves into it only to read the Hello's cgroup
//! there; `place` then moves it out beside the limit as for any capped
//! cgroup, and the child joins it before exec. On drop the supervisor goes
//! back where it came from and the cgroup is removed.

use std::path::{Path, PathBuf};

use oomscope_agent_core::readers::cgroup::{self, Version};
use oomscope_agent_core::readers::HostPaths;

/// The prefix of the cgroups `--memory-limit` makes; the supervisor's pid follows.
const RUN_CGROUP_PREFIX: &str = "oomscope-run-";

/// How long the cgroup's removal waits for the kernel to let go of its
/// last task (a killed child is counted for a moment after it is reaped).
const REMOVE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The memory cgroup made for one run; removed on drop.
pub struct LimitCgroup {
    dir: PathBuf,
    /// The supervisor's cgroup.procs before it moved in.
    home_procs: PathBuf,
}

impl LimitCgroup {
    /// Makes `oomscope-run-<pid>` with `limit_bytes` (swap included, so
    /// the limit bites) and moves this process into it.
    pub fn create(paths: &HostPaths, limit_bytes: u64) -> anyhow::Result<LimitCgroup> {
        let pid = std::process::id();
        let own = cgroup::locate(paths, pid).ok_or_else(|| {
            anyhow::anyhow!("--memory-limit: this host has no memory cgroup controller")
        })?;
        let parent = match own.version {
            Version::V1 => own.dir.clone(),
            Version::V2 if hands_down_memory(&own.dir) => own.dir.clone(),
            Version::V2 => own
                .dir
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or(own.dir.clone()),
        };
        let dir = parent.join(format!("{RUN_CGROUP_PREFIX}{pid}"));
        std::fs::create_dir(&dir)
            .map_err(|e| anyhow::anyhow!("--memory-limit: cannot create {}: {e}", dir.display()))?;
        let made = LimitCgroup {
            dir,
            home_procs: own.dir.join("cgroup.procs"),
        };
        let (limit_file, swap_file, swap_value) = match own.version {
            Version::V1 => (
                "memory.limit_in_bytes",
                "memory.memsw.limit_in_bytes",
                limit_bytes.to_string(),
            ),
            Version::V2 => ("memory.max", "memory.swap.max", "0".to_string()),
        };
        std::fs::write(made.dir.join(limit_file), limit_bytes.to_string()).map_err(|e| {
            anyhow::anyhow!(
                "--memory-limit: cannot set {limit_file} of {}: {e}",
                made.dir.display()
            )
        })?;
        // Absent where swap accounting is off: then there is no swap to escape to.
        let _ = std::fs::write(made.dir.join(swap_file), swap_value);
        std::fs::write(made.dir.join("cgroup.procs"), pid.to_string()).map_err(|e| {
            anyhow::anyhow!(
                "--memory-limit: cannot move into {}: {e}",
                made.dir.display()
            )
        })?;
        Ok(made)
    }
}

/// A v2 level whose subtree_control already hands the memory controller down.
fn hands_down_memory(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.subtree_control"))
        .is_ok_and(|t| t.split_whitespace().any(|c| c == "memory"))
}

impl Drop for LimitCgroup {
    /// Back home, then the cgroup is removed once the kernel lets go of it.
    fn drop(&mut self) {
        let _ = std::fs::write(&self.home_procs, std::process::id().to_string());
        let until = std::time::Instant::now() + REMOVE_WAIT;
        while let Err(e) = std::fs::remove_dir(&self.dir) {
            if e.kind() == std::io::ErrorKind::NotFound || std::time::Instant::now() >= until {
                if e.kind() != std::io::ErrorKind::NotFound {
                    eprintln!(
                        "oomscope: could not remove the run's cgroup {}: {e}",
                        self.dir.display()
                    );
                }
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// The v2 writes on a directory shaped like the GPU machine's cgroup v2
/// (tests/fixtures/host-v2): this CI machine's memory controller is v1, so
/// the test plays the kernel's part (the process's /proc cgroup line after
/// a move, the interface files that vanish with a cgroup) and checks what
/// `--memory-limit` and the placement write, and where.
#[cfg(test)]
mod v2_tests {
    use std::fs;
    use std::path::Path;

    use oomscope_testkit::host_v2::{write, HostV2};

    use super::*;
    use crate::place::Placement;

    const MIB: u64 = 1 << 20;

    fn read(path: &Path) -> String {
        fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn v2_tree(own: &str) -> (tempfile::TempDir, HostPaths) {
        let tree = HostV2::materialise(std::process::id());
        let paths = HostPaths {
            proc_root: tree.proc_root,
            cgroup_root: tree.cgroup_root,
        };
        set_cgroup(&paths, own);
        (tree.dir, paths)
    }

    /// What the kernel shows once this process moved to `path`.
    fn set_cgroup(paths: &HostPaths, path: &str) {
        write(
            &paths.pid_file(std::process::id(), "cgroup"),
            &format!("0::{path}\n"),
        );
    }

    /// What the kernel removes with a cgroup: its interface files.
    fn clear_interface(dir: &Path) {
        for e in fs::read_dir(dir).unwrap().flatten() {
            if e.file_type().unwrap().is_file() {
                fs::remove_file(e.path()).unwrap();
            }
        }
    }

    #[test]
    fn a_limit_on_cgroup_v2_is_memory_max_beside_the_own_level_with_no_swap() {
        let (_tmp, paths) = v2_tree("/app.slice/inference-server");
        let pid = std::process::id();
        let root = paths.cgroup_root.clone();
        let limit = LimitCgroup::create(&paths, 512 * MIB).unwrap();
        // The own level hands nothing down (its subtree_control is empty and
        // it holds processes): the limit's cgroup is its sibling.
        let made = root.join(format!("app.slice/{RUN_CGROUP_PREFIX}{pid}"));
        assert_eq!(limit.dir, made);
        assert_eq!(read(&made.join("memory.max")), (512 * MIB).to_string());
        assert_eq!(read(&made.join("memory.swap.max")), "0");
        assert_eq!(read(&made.join("cgroup.procs")), pid.to_string());
        // v1's files are never written on v2.
        assert!(!made.join("memory.limit_in_bytes").exists());

        // The kernel's view after the move: the new cgroup has the controller
        // and the limit on it.
        set_cgroup(&paths, &format!("/app.slice/{RUN_CGROUP_PREFIX}{pid}"));
        write(&made.join("cgroup.controllers"), "memory\n");
        let placement = Placement::engage(&paths);
        // The supervisor then leaves the limit for a leaf beside it. Here the
        // kernel's part is missing (a new cgroup's cgroup.procs, which the
        // move opens without creating), so it stays and says where it went
        // for: beside the limit's cgroup, never inside it (v2 has no
        // processes in a level that hands the controller down).
        let own = root.join(format!("app.slice/oomscope-supervisor-{pid}"));
        assert!(
            placement.description.contains(&format!(
                "stayed in /app.slice/{RUN_CGROUP_PREFIX}{pid}, the cgroup it watches: cannot move into {}",
                own.display()
            )),
            "{}",
            placement.description
        );
        assert!(!own.exists(), "the failed move's cgroup was removed");
        drop(placement);

        // The end: home, and the limit's cgroup removed.
        clear_interface(&made);
        drop(limit);
        assert!(!made.exists());
        assert_eq!(
            read(&root.join("app.slice/inference-server/cgroup.procs")),
            pid.to_string()
        );
    }

    #[test]
    fn a_v2_level_that_hands_memory_down_holds_the_limit_inside() {
        // A container's namespaced root: it hands the controller down.
        let (_tmp, paths) = v2_tree("/");
        let limit = LimitCgroup::create(&paths, 64 * MIB).unwrap();
        let made = paths
            .cgroup_root
            .join(format!("{RUN_CGROUP_PREFIX}{}", std::process::id()));
        assert_eq!(limit.dir, made);
        assert_eq!(read(&made.join("memory.max")), (64 * MIB).to_string());
        clear_interface(&made);
    }
}
