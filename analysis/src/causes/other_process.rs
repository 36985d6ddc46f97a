//! Other processes holding the memory that ran out. Named, never to be
//! killed: on a shared machine they belong to someone else.

use super::cause;
use crate::devices::{Holder as DeviceHolder, Whose};
use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::pb;
use crate::units::{bytes, bytes_short};
use oomscope_proto::CauseKind;

/// A process holding at least this share of the domain's total is worth naming.
const MIN_SHARE: f64 = 0.10;
/// Where the total is unknown, name processes from this size up.
const MIN_BYTES_UNKNOWN_TOTAL: u64 = 1 << 30;
/// Evidence names at most this many.
const MAX_NAMED: usize = 5;
/// The most a naming gets when the pid is another PID namespace's or the
/// failing device was tied to its ordinal by assumption.
const UNSURE_CONFIDENCE: f64 = 0.5;
/// The most a naming gets when its bytes are the device's used bytes less
/// this process's figures (they include this process's non-PyTorch memory).
const DERIVED_CONFIDENCE: f64 = 0.6;

struct Holder {
    pid: u32,
    bytes: u64,
    user: String,
    command: String,
    /// A pid of another PID namespace (not resolvable here), taken for
    /// another process because its usage is not this process's.
    foreign: bool,
    /// The bytes are the device's used bytes less what is known of the rest:
    /// NVML gave no per-process usage.
    derived: bool,
}

/// How the holders were judged, for the confidence and the closing lines.
#[derive(Default)]
struct Judged {
    /// The failing device's tie to its ordinal is an assumption.
    uncertain_device: bool,
    /// Lines that say how figures were obtained.
    notes: Vec<String>,
}

pub fn other_process(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let (place, total, holders, judged) = match v.domain {
        Domain::GpuVram => gpu_holders(f)?,
        Domain::HostRam if v.failed => host_holders(f)?,
        // Other processes' memory is a cause only where memory ran short
        // around the death or the process's own pressure moved: a busy host
        // is no explanation of a failure that memory did not cause.
        Domain::SwapThrash | Domain::Unknown if v.failed && short_or_own(f) => host_holders(f)?,
        _ => return None,
    };
    let threshold = if total > 0 {
        (total as f64 * MIN_SHARE) as u64
    } else {
        MIN_BYTES_UNKNOWN_TOTAL
    };
    let mut big: Vec<Holder> = holders
        .into_iter()
        .filter(|h| h.pid != 0 && h.bytes >= threshold)
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
            let pid = match h.foreign {
                true => format!(
                    "pid {} (in another PID namespace, not resolvable here)",
                    h.pid
                ),
                false => format!("pid {}", h.pid),
            };
            let about = if h.derived { "about " } else { "" };
            format!(
                "{pid}{who} holds {about}{} {place}{of_total}",
                bytes(h.bytes)
            )
        })
        .collect();
    evidence.extend(judged.notes);
    let foreign = big.iter().any(|h| h.foreign);
    evidence.push(if foreign {
        "not this agent's processes: NVML's pids here are the host's, so find them there (nvidia-smi on the host) and coordinate with their owners; never kill or stop them".to_string()
    } else {
        "not this agent's processes: coordinate with their owners; never kill unknown processes"
            .to_string()
    });
    // Unknown total: the processes are big in absolute terms but their weight is unclear.
    let mut confidence = if total > 0 {
        (0.2 + share).min(0.85)
    } else {
        0.3
    };
    // A pid seen from another namespace, bytes inferred from the device's
    // total, or a device tied by assumption: each weakens the naming.
    if foreign || judged.uncertain_device {
        confidence = confidence.min(UNSURE_CONFIDENCE);
    }
    if big.iter().any(|h| h.derived) {
        confidence = confidence.min(DERIVED_CONFIDENCE);
    }
    let mut c = cause(
        CauseKind::OtherProcess,
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

/// Memory ran short around the death, or the process's own pressure (its
/// major faults, its cgroup's refaults or stall) moved.
fn short_or_own(f: &Findings) -> bool {
    f.memory_short().is_some() || f.thrash.as_ref().is_some_and(|t| t.own_pressure)
}

fn host_holders(f: &Findings) -> Option<(String, u64, Vec<Holder>, Judged)> {
    let list = f.evidence.process_list()?;
    let total = f.evidence.last_system().map_or(0, |s| s.mem_total_bytes);
    let own = f.evidence.own_pids();
    let holders = list
        .host_top_rss
        .iter()
        .filter(|p| !own.contains(&p.pid))
        .map(|p| Holder {
            pid: p.pid,
            bytes: p.rss_bytes,
            user: p.user.clone(),
            command: p.command.clone(),
            foreign: false,
            derived: false,
        })
        .collect();
    Some((
        "of host RAM (RSS)".to_string(),
        total,
        holders,
        Judged::default(),
    ))
}

/// Other processes on the failing device, never on another: a resolvable
/// neighbour with its NVML figure; one of another PID namespace whose usage
/// is not this process's; a neighbour whose usage NVML does not give, with
/// the device's used bytes less this process's figures, said as such.
fn gpu_holders(f: &Findings) -> Option<(String, u64, Vec<Holder>, Judged)> {
    let dev = f.devices.failing()?;
    let all = f.gpu_holders();
    let total = dev
        .total_bytes
        .or_else(|| f.failure.as_ref().and_then(|x| x.text.total_bytes))
        .unwrap_or(0);
    let mut judged = Judged {
        uncertain_device: dev.mapped.as_ref().is_some_and(|m| !m.certain),
        notes: Vec::new(),
    };
    if judged.uncertain_device {
        judged.notes.push(format!(
            "which device failed rests on an assumption: {}",
            f.devices.failing_how().unwrap_or_default()
        ));
    }
    let mut holders: Vec<Holder> = all
        .iter()
        .filter(|h| h.is_other())
        .filter_map(|h| {
            Some(Holder {
                pid: h.pid,
                bytes: h.used_bytes?,
                user: h.user.clone(),
                command: h.command.clone(),
                foreign: h.whose == Whose::OtherUnresolved,
                derived: false,
            })
        })
        .collect();
    let unknown: Vec<&DeviceHolder> = all
        .iter()
        .filter(|h| h.whose == Whose::Other && h.used_bytes.is_none())
        .collect();
    if let ([h], Some(used), Some((own, what))) =
        (&unknown[..], device_used(f, dev), f.own_gpu_bytes())
    {
        let known: u64 = holders.iter().map(|x| x.bytes).sum();
        let rest = used.saturating_sub(own).saturating_sub(known);
        judged.notes.push(format!(
            "NVML gives no per-process usage for pid {}: the device's used {} less this process's {} ({what}){} leaves {}, held by it and by any memory of this process outside PyTorch's allocator",
            h.pid,
            bytes_short(used),
            bytes_short(own),
            match known {
                0 => String::new(),
                k => format!(" and the other processes' {}", bytes_short(k)),
            },
            bytes_short(rest)
        ));
        holders.push(Holder {
            pid: h.pid,
            bytes: rest,
            user: h.user.clone(),
            command: h.command.clone(),
            foreign: false,
            derived: true,
        });
    }
    if holders.is_empty() {
        return None;
    }
    Some((dev.place(), total, holders, judged))
}

/// The failing device's used bytes: NVML's, else the driver's total less
/// free at the failure, else PyTorch's text.
fn device_used(f: &Findings, dev: &crate::devices::Device) -> Option<u64> {
    let driver = f
        .oom
        .and_then(|(_, o)| o.stats.as_ref())
        .filter(|s| s.driver_total_bytes > 0)
        .map(|s| s.driver_total_bytes.saturating_sub(s.driver_free_bytes));
    let text = f
        .failure
        .as_ref()
        .and_then(|x| Some(x.text.total_bytes?.saturating_sub(x.text.free_bytes?)));
    dev.used_bytes().or(driver).or(text)
}
