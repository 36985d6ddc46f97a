//! Other processes holding the memory that ran out. Named, never to be
//! killed: on a shared machine they belong to someone else.

use super::cause;
use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::pb;
use crate::units::{bytes, bytes_short};

/// A process holding at least this share of the domain's total is worth naming.
const MIN_SHARE: f64 = 0.10;
/// Where the total is unknown, name processes from this size up.
const MIN_BYTES_UNKNOWN_TOTAL: u64 = 1 << 30;
/// Evidence names at most this many.
const MAX_NAMED: usize = 5;

struct Holder {
    pid: u32,
    bytes: u64,
    user: String,
    command: String,
}

pub fn other_process(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let (place, total, holders) = match v.domain {
        Domain::GpuVram => gpu_holders(f)?,
        Domain::HostRam | Domain::SwapThrash | Domain::Unknown if v.failed => host_holders(f)?,
        _ => return None,
    };
    let own = f.evidence.own_pids();
    let threshold = if total > 0 {
        (total as f64 * MIN_SHARE) as u64
    } else {
        MIN_BYTES_UNKNOWN_TOTAL
    };
    let mut big: Vec<Holder> = holders
        .into_iter()
        .filter(|h| !own.contains(&h.pid) && h.pid != 0 && h.bytes >= threshold)
        .collect();
    if big.is_empty() {
        return None;
    }
    big.sort_by_key(|h| std::cmp::Reverse(h.bytes));
    big.truncate(MAX_NAMED);
    let held: u64 = big.iter().map(|h| h.bytes).sum();
    let share = if total > 0 {
        held as f64 / total as f64
    } else {
        0.0
    };

    let mut evidence: Vec<String> = big
        .iter()
        .map(|h| {
            let who = match (h.user.is_empty(), h.command.is_empty()) {
                (false, false) => format!(" ({}, {})", h.user, h.command),
                (false, true) => format!(" ({})", h.user),
                (true, false) => format!(" ({})", h.command),
                (true, true) => String::new(),
            };
            let of_total = if total > 0 {
                format!(
                    ": {:.1}% of {}",
                    100.0 * h.bytes as f64 / total as f64,
                    bytes_short(total)
                )
            } else {
                String::new()
            };
            format!(
                "pid {}{who} holds {} {place}{of_total}",
                h.pid,
                bytes(h.bytes)
            )
        })
        .collect();
    evidence.push(
        "not this agent's processes: coordinate with their owners; never kill unknown processes"
            .to_string(),
    );
    // Unknown total: the processes are big in absolute terms but their weight is unclear.
    let confidence = if total > 0 {
        (0.2 + share).min(0.85)
    } else {
        0.3
    };
    let mut c = cause(
        "other_process",
        confidence,
        evidence,
        &[
            ("other_bytes", held as f64),
            ("total_bytes", total as f64),
            ("other_share", share),
        ],
    );
    c.processes = big
        .into_iter()
        .map(|h| pb::CauseProcess {
            pid: h.pid,
            bytes: h.bytes,
            user: Some(h.user).filter(|u| !u.is_empty()),
            command: Some(h.command).filter(|c| !c.is_empty()),
        })
        .collect();
    Some(c)
}

fn host_holders(f: &Findings) -> Option<(String, u64, Vec<Holder>)> {
    let list = f.evidence.process_list()?;
    let total = f.evidence.last_system().map_or(0, |s| s.mem_total_bytes);
    let holders = list
        .host_top_rss
        .iter()
        .map(|p| Holder {
            pid: p.pid,
            bytes: p.rss_bytes,
            user: p.user.clone(),
            command: p.command.clone(),
        })
        .collect();
    Some(("of host RAM (RSS)".to_string(), total, holders))
}

/// GPU holders on the failing device: from a process list, else from NVML samples.
fn gpu_holders(f: &Findings) -> Option<(String, u64, Vec<Holder>)> {
    let device = f.oom.map(|(_, o)| o.device);
    let on_device = |d: i32| device.is_none_or(|want| want == d);
    let nvml = f
        .evidence
        .samples
        .iter()
        .rev()
        .find_map(|s| s.gpus.iter().find(|g| on_device(g.index)));
    let total = nvml.map(|g| g.total_bytes).filter(|&t| t > 0).or_else(|| {
        let h = f.evidence.hello.as_ref()?;
        h.gpus
            .iter()
            .find(|g| on_device(g.index))
            .map(|g| g.total_bytes)
    });
    let listed: Vec<Holder> = f
        .evidence
        .process_list()
        .map(|l| {
            l.gpu
                .iter()
                .filter(|p| on_device(p.device))
                .map(|p| Holder {
                    pid: p.pid,
                    bytes: p.used_bytes.unwrap_or(0),
                    user: p.user.clone(),
                    command: p.command.clone(),
                })
                .collect()
        })
        .unwrap_or_default();
    // PyTorch's message names them too: "Process 444 has 134.79 GiB memory in use".
    let from_text: Vec<Holder> = f
        .failure
        .iter()
        .flat_map(|x| x.text.others.iter())
        .map(|&(pid, bytes)| Holder {
            pid,
            bytes,
            user: String::new(),
            command: String::new(),
        })
        .collect();
    let holders = if !listed.is_empty() {
        listed
    } else if let Some(g) = nvml.filter(|g| !g.processes.is_empty()) {
        g.processes
            .iter()
            .map(|p| Holder {
                pid: p.pid,
                bytes: p.used_bytes.unwrap_or(0),
                user: String::new(),
                command: String::new(),
            })
            .collect()
    } else if !from_text.is_empty() {
        from_text
    } else {
        return None;
    };
    let total = total.or_else(|| f.failure.as_ref().and_then(|x| x.text.total_bytes));
    let place = match device.or(nvml.map(|g| g.index)) {
        Some(d) => format!("on GPU {d}"),
        None => "on the GPU".to_string(),
    };
    Some((place, total.unwrap_or(0), holders))
}
