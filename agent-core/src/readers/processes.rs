//! The other processes on the host: who holds RAM and who holds GPU memory.
//! Read-only evidence for "another process is using it"; nothing here ever
//! signals a process.

use std::collections::HashMap;
use std::path::Path;

use super::cgroup::parse_proc_cgroup;
use super::text::{kb_line_bytes, read_opt};
use super::HostPaths;
use crate::pb;

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
/// reading, its pids' views filled by [`super::pid_views::PidViews::fill`]).
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
