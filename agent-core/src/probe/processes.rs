//! The other processes on the host: who holds RAM and who holds GPU memory.
//! Read-only evidence for "another process is using it"; nothing here ever
//! signals a process.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use super::cgroup::parse_proc_cgroup;
use super::text::{kb_line_bytes, read_opt};
use super::tree::descends_from;
use super::HostPaths;
use crate::pb;
use crate::sync::lock;

/// User names come from here, best effort (a container's own passwd may not
/// know the host's users; then the numeric uid is shown).
pub const PASSWD_PATH: &str = "/etc/passwd";

/// The `n` processes with the largest VmRSS, largest first. Kernel threads
/// (no VmRSS line) and processes that vanish mid-scan are skipped.
pub fn top_by_rss(paths: &HostPaths, n: usize) -> Vec<pb::ProcessInfo> {
    if n == 0 {
        return Vec::new();
    }
    let users = read_users();
    let mut all: Vec<pb::ProcessInfo> = pids(&paths.proc_root)
        .into_iter()
        .filter_map(|pid| describe(paths, pid, &users))
        .filter(|p| p.rss_bytes > 0)
        .collect();
    all.sort_by(|a, b| b.rss_bytes.cmp(&a.rss_bytes).then(a.pid.cmp(&b.pid)));
    all.truncate(n);
    all
}

/// The top `n` by RSS plus every GPU compute process of `gpus` (an NVML
/// reading, its pids' views filled by [`PidViews::fill`]).
pub fn list(paths: &HostPaths, gpus: &[pb::GpuDevice], n: usize) -> pb::ProcessList {
    let users = read_users();
    let gpu_processes = gpus
        .iter()
        .flat_map(|d| d.processes.iter().map(move |p| (d, p)))
        .map(|(d, p)| {
            // Only a pid that means the same to NVML and to our /proc is
            // described: an unresolved one would describe a stranger.
            let resolved = matches!(
                p.view(),
                pb::PidView::Own | pb::PidView::Visible | pb::PidView::Unspecified
            );
            let info = resolved
                .then(|| describe(paths, p.pid, &users))
                .flatten()
                .unwrap_or_default();
            pb::GpuProcess {
                device: d.index,
                pid: p.pid,
                user: info.user,
                command: info.command,
                cgroup: info.cgroup,
                used_bytes: p.used_bytes,
                view: p.view,
                device_uuid: d.uuid.clone(),
            }
        })
        .collect();
    pb::ProcessList {
        host_top_rss: top_by_rss(paths, n),
        gpu: gpu_processes,
    }
}

/// `readlink /proc/self/ns/pid` in the host's (the initial) PID namespace:
/// the kernel gives it the fixed inode PROC_PID_INIT_INO.
pub const HOST_PID_NAMESPACE: &str = "pid:[4026531836]";

/// How the pids NVML reports relate to the process reading them. NVML
/// reports the host's pids; they mean the same as ours only where we are in
/// the host's PID namespace and the pid is in our /proc.
#[derive(Debug)]
pub struct PidViews {
    paths: HostPaths,
    /// Pids whose trees are ours: the probed process and the reader.
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

/// Numeric entries of the proc root.
fn pids(proc_root: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// One process from its status, cmdline and cgroup; None when its status is gone.
fn describe(paths: &HostPaths, pid: u32, users: &HashMap<u32, String>) -> Option<pb::ProcessInfo> {
    let status = read_opt(&paths.pid_file(pid, "status"))?;
    let fields = parse_status_fields(&status);
    let command = read_opt(&paths.pid_file(pid, "cmdline"))
        .map(|c| command_line(&c))
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| format!("[{}]", fields.name));
    let cgroup = read_opt(&paths.pid_file(pid, "cgroup"))
        .map(|t| memory_cgroup_path(&t))
        .unwrap_or_default();
    let user = fields
        .uid
        .map(|uid| users.get(&uid).cloned().unwrap_or_else(|| uid.to_string()))
        .unwrap_or_default();
    Some(pb::ProcessInfo {
        pid,
        user,
        command,
        cgroup,
        rss_bytes: fields.rss_bytes,
        ..Default::default()
    })
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct StatusFields {
    pub name: String,
    /// The real uid (first column of `Uid:`).
    pub uid: Option<u32>,
    pub rss_bytes: u64,
}

/// Name, uid and VmRSS of a `/proc/<pid>/status` text.
pub fn parse_status_fields(text: &str) -> StatusFields {
    let mut out = StatusFields::default();
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        match key {
            "Name" => out.name = rest.trim().to_string(),
            "Uid" => out.uid = rest.split_whitespace().next().and_then(|u| u.parse().ok()),
            "VmRSS" => out.rss_bytes = kb_line_bytes(rest).unwrap_or(0),
            _ => {}
        }
    }
    out
}

/// `/proc/<pid>/cmdline` is NUL-separated; show it space-separated.
pub fn command_line(raw: &str) -> String {
    raw.split('\0')
        .filter(|a| !a.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The memory controller's path from `/proc/<pid>/cgroup`: the v1 line naming
/// `memory`, else the v2 `0::` line.
pub fn memory_cgroup_path(text: &str) -> String {
    let lines = parse_proc_cgroup(text);
    lines
        .iter()
        .find(|l| l.controllers.iter().any(|c| c == "memory"))
        .or_else(|| lines.iter().find(|l| l.hierarchy == "0"))
        .map(|l| l.path.clone())
        .unwrap_or_default()
}

/// uid -> name from a passwd text (`name:x:uid:gid:...`).
pub fn parse_passwd(text: &str) -> HashMap<u32, String> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split(':');
            let name = f.next()?;
            let uid = f.nth(1)?.parse().ok()?;
            (!name.is_empty()).then(|| (uid, name.to_string()))
        })
        .collect()
}

fn read_users() -> HashMap<u32, String> {
    read_opt(Path::new(PASSWD_PATH))
        .map(|t| parse_passwd(&t))
        .unwrap_or_default()
}
