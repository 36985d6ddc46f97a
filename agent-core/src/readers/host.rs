//! One reader for one process over every host domain, cheap enough to sample
//! every second: the cgroup location, NVML's static facts and our PID
//! namespace are resolved once.

use super::cgroup::{self, MemoryCgroup};
use super::gpu::GpuReader;
use super::pid_views::PidViews;
use super::{numa, process, processes, system, HostPaths};
use crate::pb;

#[derive(Debug)]
pub struct HostReader {
    paths: HostPaths,
    pid: u32,
    cgroup: Option<MemoryCgroup>,
    gpu: GpuReader,
    pids: PidViews,
}

impl HostReader {
    /// Locates the pid's memory cgroup and opens NVML (absent without a GPU).
    pub fn new(paths: HostPaths, pid: u32) -> Self {
        Self::with_gpu(paths, pid, GpuReader::open())
    }

    /// As `new`, with a GPU reader of the caller's choosing (one NVML handle
    /// shared by several readers, or `GpuReader::absent()`). The GPU
    /// processes that are ours are the pid's tree and the reader's (a
    /// supervisor's, whose tree keeps orphans of the pid's as its subreaper).
    pub fn with_gpu(paths: HostPaths, pid: u32, gpu: GpuReader) -> Self {
        let cgroup = cgroup::locate(&paths, pid);
        let pids = PidViews::new(&paths, &[pid, std::process::id()]);
        HostReader {
            paths,
            pid,
            cgroup,
            gpu,
            pids,
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn paths(&self) -> &HostPaths {
        &self.paths
    }

    pub fn gpu(&self) -> &GpuReader {
        &self.gpu
    }

    /// Every GPU device now, each process's pid view set.
    pub fn gpus(&self) -> Vec<pb::GpuDevice> {
        let mut gpus = self.gpu.read();
        self.pids.fill(&mut gpus);
        gpus
    }

    /// This process's own entries in NVML's compute process lists now, on
    /// the devices where `last` (the latest periodic reading, views set)
    /// listed one of ours: one NVML call per such device, none where the
    /// process holds no device memory. For request boundaries, read on the
    /// agent's thread: NVML calls can take milliseconds.
    pub fn own_gpu_processes(&self, last: &[pb::GpuDevice]) -> Vec<pb::GpuProcess> {
        let on: Vec<&str> = last
            .iter()
            .filter(|g| !g.uuid.is_empty())
            .filter(|g| g.processes.iter().any(|p| p.view() == pb::PidView::Own))
            .map(|g| g.uuid.as_str())
            .collect();
        if on.is_empty() {
            return Vec::new();
        }
        let mut own = self.gpu.processes_on(&on);
        own.retain_mut(|p| {
            let view = self.pids.known_view(p.pid);
            p.set_view(view);
            view == pb::PidView::Own
        });
        own
    }

    /// Where the memory controller is, if there is one.
    pub fn memory_cgroup(&self) -> Option<&MemoryCgroup> {
        self.cgroup.as_ref()
    }

    /// Every host domain now. `process` is None once the pid is gone.
    pub fn sample(&self) -> pb::Sample {
        pb::Sample {
            time_ns: crate::now_ns(),
            process: process::read(&self.paths, self.pid).ok(),
            cgroup: self.cgroup_levels(),
            system: Some(system::read(&self.paths)),
            gpus: self.gpus(),
            numa_nodes: numa::read_nodes(&numa::node_root(&self.paths)),
            ..Default::default()
        }
    }

    /// A reading for a request boundary, taken up to 50 times a second: the
    /// process and each cgroup level's usage fresh, the levels' other fields
    /// as `last_levels` (the newest `sample`'s) had them, and neither a
    /// system nor an NVML reading (the periodic `sample` has them; no `gpus`
    /// here means "not read", not "no GPU"). About a third of `sample`'s
    /// file reads; the whole levels when `last_levels` is not this cgroup's.
    pub fn boundary_sample(&self, last_levels: &[pb::CgroupLevel]) -> pb::Sample {
        let cgroup = match &self.cgroup {
            Some(cg) => cgroup::refresh_usage(cg, last_levels)
                .unwrap_or_else(|| cgroup::read_levels(&self.paths, cg)),
            None => Vec::new(),
        };
        pb::Sample {
            time_ns: crate::now_ns(),
            process: process::read(&self.paths, self.pid).ok(),
            cgroup,
            system: None,
            gpus: Vec::new(),
            ..Default::default()
        }
    }

    /// The counters to compare before and after an exit: cgroup levels and system.
    pub fn counters(&self) -> pb::HostCounters {
        pb::HostCounters {
            time_ns: crate::now_ns(),
            cgroup: self.cgroup_levels(),
            system: Some(system::read(&self.paths)),
        }
    }

    /// The cgroup and its tightest limit; version "" when no memory controller was found.
    pub fn cgroup_info(&self) -> pb::CgroupInfo {
        match &self.cgroup {
            Some(cg) => cgroup::info(&cgroup::read_levels(&self.paths, cg), cg),
            None => pb::CgroupInfo::default(),
        }
    }

    pub fn rlimits(&self) -> pb::Rlimits {
        process::rlimits(&self.paths, self.pid)
    }

    /// The top `n` host processes by RSS and every GPU process: evidence for an
    /// event, too slow (a full /proc scan) for every sample.
    pub fn process_list(&self, n: usize) -> pb::ProcessList {
        processes::list(&self.paths, &self.gpus(), n)
    }

    fn cgroup_levels(&self) -> Vec<pb::CgroupLevel> {
        self.cgroup
            .as_ref()
            .map(|cg| cgroup::read_levels(&self.paths, cg))
            .unwrap_or_default()
    }
}
