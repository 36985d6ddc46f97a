//! Fixes: what to change, least risky first, each with how to retest it on
//! the same failing workload. One variable at a time; never "kill unknown
//! processes"; never an unbounded restart.

use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::pb;
use crate::units::bytes_short;

fn fix(
    action: impl Into<String>,
    risk: &str,
    retest: impl Into<String>,
    caveat: Option<&str>,
) -> pb::Fix {
    pb::Fix {
        action: action.into(),
        risk: risk.to_string(),
        retest: retest.into(),
        caveat: caveat.map(str::to_string),
    }
}

fn risk_rank(risk: &str) -> u8 {
    match risk {
        "low" => 0,
        "medium" => 1,
        _ => 2,
    }
}

fn metric(c: &pb::Cause, name: &str) -> u64 {
    c.metrics.get(name).copied().unwrap_or(0.0).max(0.0) as u64
}

const SAME_WORKLOAD: &str =
    "rerun the same failing workload (same requests, same concurrency) and compare";

/// Fixes for the causes found (most likely cause first), then for the domain
/// where no cause gave any; ranked least risky first, duplicates dropped.
pub fn rank(f: &Findings, v: &DomainVerdict, causes: &[pb::Cause]) -> Vec<pb::Fix> {
    let mut fixes: Vec<pb::Fix> = causes.iter().flat_map(|c| for_cause(c, f)).collect();
    if fixes.is_empty() && v.failed {
        fixes = for_domain(v.domain);
    }
    if f.exit.is_some_and(|(_, x)| x.crash_loop || x.attempt > 0) {
        fixes.push(fix(
            "Keep restarts bounded with backoff (`oomscope run --restart N`) and fix the cause before raising N",
            "low",
            "the same failure recurs on each restart until the cause is fixed; count restarts per hour",
            Some("restarting in a loop hides the cause and can take neighbours down with it"),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    fixes.retain(|x| seen.insert(x.action.clone()));
    fixes.sort_by_key(|x| risk_rank(&x.risk));
    fixes
}

fn for_cause(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    match c.kind.as_str() {
        "cgroup_limit" => {
            let owner = f.memcg.as_ref().map_or("the owning cgroup".to_string(), |m| m.owner_path.clone());
            let limit = metric(c, "limit_bytes");
            let ancestor = f.memcg.as_ref().is_some_and(|m| m.owner_depth > 0);
            vec![
                fix(
                    format!("Find what grew inside {owner}: compare memory.stat anon, file and shmem over the run"),
                    "low",
                    format!("{SAME_WORKLOAD} memory.peak of {owner}"),
                    Some("page cache and shmem are charged to the cgroup too"),
                ),
                fix(
                    "Cap concurrency (max concurrent requests, batch size, max context) so the peak stays under the limit",
                    "low",
                    format!("{SAME_WORKLOAD} memory.peak against the limit"),
                    None,
                ),
                fix(
                    format!(
                        "Right-size the memory limit on {owner} (now {}) to the measured peak plus headroom",
                        bytes_short(limit)
                    ),
                    "medium",
                    format!("{SAME_WORKLOAD} memory.peak: it must plateau below the new limit"),
                    Some(if ancestor {
                        "the limit is on an ancestor shared with siblings: raising the child's own limit does not help"
                    } else {
                        "a larger limit only delays the failure when usage grows without bound"
                    }),
                ),
            ]
        }
        "host_ram_exhausted" => vec![
            fix(
                "Find what held host RAM at the failure (the top-RSS process list, this process's RSS over time)",
                "low",
                format!("{SAME_WORKLOAD} MemAvailable and the process's RSS"),
                None,
            ),
            fix(
                "Cap concurrency and batch size so the server's host memory peak fits",
                "low",
                format!("{SAME_WORKLOAD} MemAvailable at the peak"),
                None,
            ),
            fix(
                "Put the server in a cgroup with a memory limit sized from its measured peak, so an overrun fails it alone",
                "medium",
                "rerun the same workload and confirm memory.peak stays under the limit",
                Some("this contains the failure; it does not add memory"),
            ),
            fix(
                "Move the server (or other workloads) to a host with more RAM",
                "high",
                "rerun the same failing workload on the new host",
                None,
            ),
        ],
        "address_space_limit" => {
            let limit = metric(c, "limit_bytes");
            let peak = metric(c, "vm_peak_bytes");
            vec![
                fix(
                    format!(
                        "Check where RLIMIT_AS ({}) comes from (ulimit -v, systemd LimitAS=, the launcher) and whether it is intended",
                        bytes_short(limit)
                    ),
                    "low",
                    "print `cat /proc/<pid>/limits` in the server's environment",
                    None,
                ),
                fix(
                    format!(
                        "Raise or remove RLIMIT_AS (VmPeak reached {}); bound resident memory with a cgroup limit instead",
                        bytes_short(peak)
                    ),
                    "medium",
                    "rerun the same failing request; it must pass with VmPeak below the new limit",
                    Some("GPU runtimes and allocator pools reserve far more virtual address space than they touch"),
                ),
            ]
        }
        "overcommit_limit" => vec![fix(
            "Add swap or raise vm.overcommit_ratio so CommitLimit covers the reservations, or lower them",
            "medium",
            "rerun the same failing request and compare Committed_AS with CommitLimit",
            Some("strict overcommit refuses by reservation, not by use; it is a host-wide setting"),
        )],
        "shm_full" => vec![
            fix(
                "Find what fills /dev/shm (stale segments of crashed workers, DataLoader/IPC buffers)",
                "low",
                "watch `df /dev/shm` during the same workload",
                None,
            ),
            fix(
                "Enlarge /dev/shm (docker --shm-size, a tmpfs size= option) to the measured need plus headroom",
                "medium",
                "rerun the same failing workload and watch /dev/shm use",
                Some("/dev/shm pages are RAM and count against the cgroup limit"),
            ),
        ],
        "swap_thrash" => vec![
            fix(
                "Cap concurrency and batch size to shrink the working set",
                "low",
                format!("{SAME_WORKLOAD} refaults/s and PSI full avg10"),
                None,
            ),
            fix(
                "Give the working set enough RAM (a larger memory limit or host) so refaults stop",
                "medium",
                format!("{SAME_WORKLOAD} refaults/s and latency"),
                Some("more swap does not fix thrash: it makes the slowdown last longer"),
            ),
        ],
        "external_kill" => vec![fix(
            "Find who sent SIGKILL: orchestrator events (liveness probes, evictions), systemd stop timeouts, systemd-oomd/earlyoom logs",
            "low",
            "rerun the same workload and watch those logs at the kill",
            Some("a slow server can fail a liveness probe; lengthen the probe only after finding why it is slow"),
        )],
        "other_process" => {
            let pids: Vec<String> = c.processes.iter().map(|p| p.pid.to_string()).collect();
            vec![
                fix(
                    format!(
                        "Ask the owners of pid {} about their use, or schedule the server where that memory is free",
                        pids.join(", ")
                    ),
                    "low",
                    "rerun the same failing workload when that memory is free",
                    Some("never kill processes you do not own on a shared machine"),
                ),
                fix(
                    "Size the server for the memory actually left (lower concurrency, a smaller per-process cap)",
                    "low",
                    SAME_WORKLOAD,
                    None,
                ),
            ]
        }
        _ => Vec::new(),
    }
}

/// Where no cause says more.
fn for_domain(d: Domain) -> Vec<pb::Fix> {
    match d {
        Domain::GpuVram => vec![
            fix(
                "Lower concurrency, batch size or max context on this GPU, one at a time",
                "low",
                "rerun the same failing request at the new setting, then at the expected peak load",
                Some("one passing request does not prove capacity"),
            ),
            fix(
                "Capture the allocator state at the next failure (oomscope agent with snapshots) to separate leak, fragmentation and growth",
                "low",
                "reproduce with the same request",
                Some("empty_cache is not a capacity plan"),
            ),
        ],
        _ => vec![fix(
            "Rerun under `oomscope run` (or with the agent) so before/after counters and samples are recorded",
            "low",
            "reproduce with the same workload and diagnose again",
            None,
        )],
    }
}
