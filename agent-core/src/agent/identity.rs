//! The Hello every agent opens its stream with: who it is, where it runs,
//! and the host domains' limits as they were at its start. Each agent adds
//! what only it knows (its allocator settings, models, command line, GPUs).

use std::collections::HashMap;

use crate::pb;
use crate::readers::HostReader;

/// What an agent says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The service's name, shared by its processes and its restarts.
    pub name: String,
    /// "supervisor", "server", "worker", ...
    pub role: String,
    /// The process's rank among its siblings (forked children count up).
    pub rank: i32,
    /// What reads the memory: "supervisor", "pytorch", "cudarc".
    pub runtime: String,
}

/// The variable through which `oomscope run` tells the processes it starts
/// (and theirs) which instance they belong to: its own agent id.
pub const INSTANCE_ENV: &str = "OOMSCOPE_INSTANCE";

/// The variables that map a process's CUDA ordinals to devices: which
/// devices it sees (by index, GPU or MIG uuid) and in which order.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
pub const CUDA_DEVICE_ORDER: &str = "CUDA_DEVICE_ORDER";

/// The one agent-id scheme: unique per process start, and readable, since
/// spools and logs are named by it: `<runtime>-<name>-<host>-<pid>-<start>`.
pub fn agent_id(runtime: &str, name: &str, host: &str, pid: u32, start_ns: i64) -> String {
    format!("{runtime}-{name}-{host}-{pid}-{start_ns:x}")
}

impl Identity {
    /// The Hello of this process, started now, with `reader`'s readings of
    /// its cgroup and rlimits, its parent and title, its CUDA device
    /// variables (absent when unset; set but empty stays empty: it hides
    /// every device), and the instance that `OOMSCOPE_INSTANCE` names
    /// (empty: the collector decides). `versions`
    /// gets "oomscope"; `gpus` stays for the agent to fill (NVML's
    /// placements, or the pool's own device).
    pub fn hello(&self, reader: &HostReader) -> pb::Hello {
        let pid = std::process::id();
        let start = crate::now_ns();
        let host = crate::hostname().unwrap_or_else(|| "localhost".into());
        let versions: HashMap<String, String> = [(
            "oomscope".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        )]
        .into_iter()
        .collect();
        pb::Hello {
            agent_id: agent_id(&self.runtime, &self.name, &host, pid, start),
            name: self.name.clone(),
            host,
            pid,
            start_time_ns: start,
            role: self.role.clone(),
            rank: self.rank,
            runtime: self.runtime.clone(),
            versions,
            cgroup: Some(reader.cgroup_info()),
            rlimits: Some(reader.rlimits()),
            instance: std::env::var(INSTANCE_ENV).unwrap_or_default(),
            parent_pid: std::os::unix::process::parent_id(),
            title: std::fs::read_to_string(reader.paths().pid_file(pid, "comm"))
                .map(|t| t.trim_end().to_string())
                .unwrap_or_default(),
            cuda_visible_devices: env_value(CUDA_VISIBLE_DEVICES),
            cuda_device_order: env_value(CUDA_DEVICE_ORDER),
            ..Default::default()
        }
    }
}

/// A variable of this process's environment as text; None when unset.
fn env_value(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readers::HostPaths;

    #[test]
    fn the_hello_names_this_process_and_its_id_follows_the_scheme() {
        let reader = HostReader::new(HostPaths::system(), std::process::id());
        let id = Identity {
            name: "svc".into(),
            role: "server".into(),
            rank: 2,
            runtime: "cudarc".into(),
        };
        let h = id.hello(&reader);
        assert_eq!(h.pid, std::process::id());
        assert_eq!(
            (h.name.as_str(), h.role.as_str(), h.rank),
            ("svc", "server", 2)
        );
        assert_eq!(
            h.agent_id,
            agent_id("cudarc", "svc", &h.host, h.pid, h.start_time_ns)
        );
        assert!(h.agent_id.starts_with("cudarc-svc-"));
        assert!(h.versions.contains_key("oomscope"));
        assert_eq!(h.parent_pid, std::os::unix::process::parent_id());
        let comm = std::fs::read_to_string("/proc/self/comm").unwrap();
        assert_eq!(h.title, comm.trim_end());
        assert!(h.start_time_ns > 0);
    }
}
