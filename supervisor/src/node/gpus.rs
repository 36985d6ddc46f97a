//! The GPU processes of each watched cgroup: NVML's process lists (through
//! agent-core's [`GpuReader`], absent without a GPU or driver) split by the
//! memory cgroup of each pid. The split is pure; reading a pid's cgroup is
//! the thin shell around it.

use std::collections::HashMap;

use oomscope_agent_core::pb;
use oomscope_agent_core::readers::cgroup::{parse_proc_cgroup, Version};

/// Each cgroup's share of `devices`: per cgroup, the devices where it has
/// processes, with only its processes listed (the device's figures are the
/// whole device's). `cgroup_of` names a pid's memory cgroup; a pid it
/// cannot place (gone, or in another pid namespace) is left out.
pub fn by_cgroup(
    devices: &[pb::GpuDevice],
    cgroup_of: impl Fn(u32) -> Option<String>,
) -> HashMap<String, Vec<pb::GpuDevice>> {
    let mut out: HashMap<String, Vec<pb::GpuDevice>> = HashMap::new();
    let mut placed: HashMap<u32, Option<String>> = HashMap::new();
    for d in devices {
        let mut mine: HashMap<String, Vec<pb::GpuProcessUsage>> = HashMap::new();
        for p in &d.processes {
            let cg = placed.entry(p.pid).or_insert_with(|| cgroup_of(p.pid));
            if let Some(cg) = cg {
                let mut p = *p;
                p.view = pb::PidView::Visible as i32;
                mine.entry(cg.clone()).or_default().push(p);
            }
        }
        for (cg, processes) in mine {
            out.entry(cg).or_default().push(pb::GpuDevice {
                processes,
                ..d.clone()
            });
        }
    }
    out
}

/// The memory cgroup of `pid` as the kernel names it, from /proc.
pub fn memory_cgroup_of(pid: u32, version: Version) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let lines = parse_proc_cgroup(&text);
    let line = match version {
        Version::V1 => lines
            .into_iter()
            .find(|l| l.controllers.iter().any(|c| c == "memory")),
        Version::V2 => lines
            .into_iter()
            .find(|l| l.hierarchy == "0" && l.controllers.is_empty()),
    }?;
    Some(line.path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: u32, used: u64) -> pb::GpuProcessUsage {
        pb::GpuProcessUsage {
            pid,
            used_bytes: Some(used),
            ..Default::default()
        }
    }

    #[test]
    fn each_cgroup_gets_its_own_processes_of_each_device() {
        let devices = vec![
            pb::GpuDevice {
                index: 0,
                uuid: "GPU-a".into(),
                processes: vec![process(10, 1 << 30), process(20, 2 << 30), process(99, 1)],
                ..Default::default()
            },
            pb::GpuDevice {
                index: 1,
                uuid: "GPU-b".into(),
                processes: vec![process(11, 3 << 30)],
                ..Default::default()
            },
        ];
        let asked = std::cell::Cell::new(0);
        let split = by_cgroup(&devices, |pid| {
            asked.set(asked.get() + 1);
            match pid {
                10 | 11 => Some("/kubepods/podx/a".to_string()),
                20 => Some("/system.slice/b.service".to_string()),
                _ => None,
            }
        });
        assert_eq!(asked.get(), 4, "each pid placed once");
        let a = &split["/kubepods/podx/a"];
        assert_eq!(
            a.iter()
                .map(|d| (d.uuid.as_str(), d.processes[0].pid))
                .collect::<Vec<_>>(),
            [("GPU-a", 10), ("GPU-b", 11)]
        );
        assert_eq!(a[0].processes.len(), 1);
        assert_eq!(a[0].processes[0].view, pb::PidView::Visible as i32);
        let b = &split["/system.slice/b.service"];
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].processes[0].used_bytes, Some(2 << 30));
        assert_eq!(split.len(), 2, "the unplaced pid 99 is nobody's");
        // No GPU: nothing to split.
        assert!(by_cgroup(&[], |_| None).is_empty());
    }

    #[test]
    fn this_process_is_placed_in_its_own_memory_cgroup() {
        let text = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let lines = parse_proc_cgroup(&text);
        let v1 = lines
            .iter()
            .find(|l| l.controllers.iter().any(|c| c == "memory"));
        let (version, want) = match v1 {
            Some(l) => (Version::V1, l.path.clone()),
            None => (
                Version::V2,
                lines
                    .iter()
                    .find(|l| l.hierarchy == "0")
                    .unwrap()
                    .path
                    .clone(),
            ),
        };
        assert_eq!(memory_cgroup_of(std::process::id(), version), Some(want));
        assert_eq!(memory_cgroup_of(u32::MAX, version), None);
    }
}
