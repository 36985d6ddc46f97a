//! Host-domain readers: process, cgroup (v1 and v2), system, GPU (NVML), the
//! other processes on the host (and how NVML's pids relate to ours), a
//! supervised process tree, and the kernel's record of OOM kills (`/dev/kmsg`). Read-only: nothing here signals anyone.
//!
//! Each domain has pure parsers (`parse_*`, text in, proto message out) and a
//! thin reader over a [`HostPaths`], so tests can point every reader at a fake
//! `/proc` and `/sys/fs/cgroup` tree. A missing or garbled file never panics
//! and never errors out of a whole reading: the field stays 0 and, for cgroup
//! levels, `partial` says so.

pub mod cgroup;
pub mod exits;
pub mod gpu;
mod host;
pub mod kmsg;
pub mod numa;
pub mod pid_views;
pub mod process;
pub mod processes;
pub mod system;
mod text;
pub mod tree;

pub use host::HostReader;

use std::path::PathBuf;

/// Where the readers look for the kernel's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPaths {
    /// Normally "/proc".
    pub proc_root: PathBuf,
    /// Normally "/sys/fs/cgroup". Mount points found in mountinfo under
    /// "/sys/fs/cgroup" are re-rooted here, so a fake tree works end to end.
    pub cgroup_root: PathBuf,
}

impl HostPaths {
    /// The real paths of this machine.
    pub fn system() -> Self {
        HostPaths {
            proc_root: PathBuf::from("/proc"),
            cgroup_root: PathBuf::from(cgroup::SYSTEM_CGROUP_ROOT),
        }
    }

    /// `<proc_root>/<pid>/<name>`.
    pub fn pid_file(&self, pid: u32, name: &str) -> PathBuf {
        self.proc_root.join(pid.to_string()).join(name)
    }
}

impl Default for HostPaths {
    fn default() -> Self {
        Self::system()
    }
}
