//! How the pids NVML reports relate to the process reading them: NVML
//! reports the host's pids, which mean the same as ours only where we are
//! in the host's PID namespace and the pid is in our /proc.

use std::collections::HashMap;
use std::sync::Mutex;

use super::tree::descends_from;
use super::HostPaths;
use crate::pb;
use crate::sync::lock;

/// `readlink /proc/self/ns/pid` in the host's (the initial) PID namespace:
/// the kernel gives it the fixed inode PROC_PID_INIT_INO.
pub const HOST_PID_NAMESPACE: &str = "pid:[4026531836]";

/// Each NVML pid's [`pb::PidView`] for one reader.
#[derive(Debug)]
pub struct PidViews {
    paths: HostPaths,
    /// Pids whose trees are ours: the process read and the reader itself.
    own_roots: Vec<u32>,
    /// Read once: a process never changes its own PID namespace.
    host_namespace: bool,
    /// The latest reading's views: a pid's view is worked out (an ancestry
    /// walk) once while NVML keeps listing it, not on every sample.
    known: Mutex<HashMap<u32, pb::PidView>>,
}

impl PidViews {
    /// Views for a reader whose own processes are `own_roots` and their
    /// descendants; the namespace is read from `<proc_root>/self/ns/pid`.
    pub fn new(paths: &HostPaths, own_roots: &[u32]) -> PidViews {
        let host_namespace = std::fs::read_link(paths.proc_root.join("self/ns/pid"))
            .is_ok_and(|link| link.as_os_str() == HOST_PID_NAMESPACE);
        let mut own_roots = own_roots.to_vec();
        own_roots.dedup();
        PidViews {
            paths: paths.clone(),
            own_roots,
            host_namespace,
            known: Mutex::default(),
        }
    }

    /// Whether we are in the host's PID namespace (an unreadable link counts
    /// as not: a pid is then never resolved by number).
    pub fn in_host_namespace(&self) -> bool {
        self.host_namespace
    }

    /// `pid` (as NVML reports it) seen from here, read now.
    pub fn view(&self, pid: u32) -> pb::PidView {
        if !self.host_namespace || !self.paths.proc_root.join(pid.to_string()).exists() {
            return pb::PidView::Unresolved;
        }
        if self
            .own_roots
            .iter()
            .any(|&root| descends_from(&self.paths, pid, root))
        {
            pb::PidView::Own
        } else {
            pb::PidView::Visible
        }
    }

    /// `pid`'s view as the latest `fill` found it, else read now (not
    /// remembered: `fill` keeps the list NVML shows).
    pub fn known_view(&self, pid: u32) -> pb::PidView {
        let known = lock(&self.known).get(&pid).copied();
        known.unwrap_or_else(|| self.view(pid))
    }

    /// Sets every process's view in `gpus`, reusing the previous reading's.
    pub fn fill(&self, gpus: &mut [pb::GpuDevice]) {
        let mut known = lock(&self.known);
        let mut now = HashMap::new();
        for p in gpus.iter_mut().flat_map(|d| d.processes.iter_mut()) {
            let view = *now.entry(p.pid).or_insert_with(|| {
                known
                    .get(&p.pid)
                    .copied()
                    .unwrap_or_else(|| self.view(p.pid))
            });
            p.set_view(view);
        }
        *known = now;
    }
}
