//! Which memory domain ran out: the first question of every diagnosis.

use crate::evidence::Evidence;
use crate::findings::{Findings, SIGBUS, SIGKILL};
use crate::pb;
use crate::units::{bytes, bytes_short, seconds, time};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Domain {
    GpuVram,
    HostRam,
    Cgroup,
    AddressSpace,
    SwapThrash,
    Shm,
    ExternalKill,
    Unknown,
}

impl Domain {
    pub fn as_str(self) -> &'static str {
        match self {
            Domain::GpuVram => "gpu_vram",
            Domain::HostRam => "host_ram",
            Domain::Cgroup => "cgroup",
            Domain::AddressSpace => "address_space",
            Domain::SwapThrash => "swap_thrash",
            Domain::Shm => "shm",
            Domain::ExternalKill => "external_kill",
            Domain::Unknown => "unknown",
        }
    }

    /// The domain a diagnosis names on the wire (`Diagnosis.domain`). A name
    /// this build does not know (a newer collector's) reads as `Unknown`.
    pub fn from_wire(s: &str) -> Domain {
        Domain::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .unwrap_or(Domain::Unknown)
    }

    /// What ran out, for people: the headline of a report.
    pub fn title(self) -> &'static str {
        match self {
            Domain::GpuVram => "GPU memory (VRAM)",
            Domain::HostRam => "system RAM (a global out-of-memory kill)",
            Domain::Cgroup => "a container/cgroup memory limit",
            Domain::AddressSpace => "the process address space (RLIMIT_AS / overcommit)",
            Domain::SwapThrash => "swap/page-cache thrash (slow, not dead)",
            Domain::Shm => "/dev/shm (shared memory) full",
            Domain::ExternalKill => "none: killed from outside (SIGKILL, no memory counter moved)",
            Domain::Unknown => "unknown: the evidence does not decide",
        }
    }

    pub const ALL: [Domain; 8] = [
        Domain::GpuVram,
        Domain::HostRam,
        Domain::Cgroup,
        Domain::AddressSpace,
        Domain::SwapThrash,
        Domain::Shm,
        Domain::ExternalKill,
        Domain::Unknown,
    ];
}

/// The domain and the evidence lines (with their numbers) that decided it.
#[derive(Clone, Debug, PartialEq)]
pub struct DomainVerdict {
    pub domain: Domain,
    /// False when nothing failed or slowed (a clean exit, a quiet window):
    /// then `domain` is `Unknown` and a diagnosis leaves its domain unset.
    pub failed: bool,
    pub evidence: Vec<String>,
    /// Set when the domain is `Cgroup`.
    pub cgroup: Option<pb::CgroupVerdict>,
}

pub fn attribute_domain(e: &Evidence) -> DomainVerdict {
    decide(&Findings::gather(e))
}

/// The rules, most specific first. Each arm says why it wins over the later ones.
pub(crate) fn decide(f: &Findings) -> DomainVerdict {
    let mut lines: Vec<String> = f.exit_line().into_iter().collect();
    let lost = lost_line(f);
    let verdict = |domain, mut ev: Vec<String>, lines: &mut Vec<String>| {
        lines.append(&mut ev);
        lines.extend(lost.clone());
        DomainVerdict {
            domain,
            failed: true,
            evidence: std::mem::take(lines),
            cgroup: None,
        }
    };

    if !f.failed {
        // No death: only a slowdown can be an incident.
        if f.thrashing() {
            let ev = f.thrash.as_ref().map(|t| t.evidence()).unwrap_or_default();
            return verdict(Domain::SwapThrash, ev, &mut lines);
        }
        lines.push(match f.exit {
            Some(_) => "a clean exit is not an incident".to_string(),
            None => "no failure in the evidence".to_string(),
        });
        if let Some(t) = &f.thrash {
            lines.extend(t.evidence());
        }
        return DomainVerdict {
            domain: Domain::Unknown,
            failed: false,
            evidence: lines,
            cgroup: None,
        };
    }

    // SIGBUS is how a full /dev/shm (tmpfs) answers a page fault; no OOM counter moves.
    if f.is_signal(SIGBUS) {
        let mut ev = vec![format!(
            "{}: a page fault on shared memory that could not be backed",
            f.signal_text()
        )];
        ev.push(shm_line(f));
        ev.push(f.counters_line());
        return verdict(Domain::Shm, ev, &mut lines);
    }

    // A cgroup limit: decided by the counters of the level that owns it.
    if let Some(m) = &f.memcg {
        let mut ev = m.evidence.clone();
        if let Some((b, a)) = f.global_oom {
            ev.push(format!(
                "/proc/vmstat oom_kill {b} -> {a} (it counts cgroup kills too)"
            ));
        }
        ev.extend(code_signal_line(f));
        let mut v = verdict(Domain::Cgroup, ev, &mut lines);
        v.cgroup = Some(pb::CgroupVerdict {
            path: m.own_path.clone(),
            limit_bytes: m.limit_bytes,
            owner_level: m.owner_path.clone(),
        });
        return v;
    }

    // A process that was not killed failed by itself: its own record (a
    // device OOM, a refusal under its own limits) beats the machine-wide
    // counter, which another process's OOM kill moves as well.
    if f.signal.is_none() {
        if let Some((domain, ev)) = own_failure(f) {
            return verdict(domain, ev, &mut lines);
        }
    }

    // The global OOM killer ran and no cgroup level was at its limit.
    if let Some((b, a)) = f.global_oom {
        let mut ev = vec![format!(
            "/proc/vmstat oom_kill {b} -> {a}: the global OOM killer ran"
        )];
        ev.push(no_level_at_limit_line(f));
        ev.extend(ram_line(f));
        ev.extend(code_signal_line(f));
        return verdict(Domain::HostRam, ev, &mut lines);
    }

    if let Some((domain, ev)) = own_failure(f) {
        return verdict(domain, ev, &mut lines);
    }

    // Thrash first: a userspace OOM daemon (systemd-oomd, earlyoom) kills on
    // memory pressure with SIGKILL and moves no kernel counter.
    if f.thrashing() {
        let mut ev = f.thrash.as_ref().map(|t| t.evidence()).unwrap_or_default();
        if f.signal.is_some() {
            ev.push(format!(
                "{} under memory pressure: userspace OOM daemons (systemd-oomd, earlyoom) kill on PSI",
                f.signal_text()
            ));
        }
        return verdict(Domain::SwapThrash, ev, &mut lines);
    }

    // SIGKILL with every OOM counter still: someone outside the kernel's OOM paths.
    if f.is_signal(SIGKILL) {
        if let Some(c) = &f.counters {
            if !c.any_oom_counter_moved() {
                let ev = vec![
                    format!("{} with no kernel OOM counter moving", f.signal_text()),
                    f.counters_line(),
                ];
                return verdict(Domain::ExternalKill, ev, &mut lines);
            }
        }
    }

    // Nothing decides it: say what is known and what is missing.
    let mut ev = Vec::new();
    if let Some(text) = &f.oom_line {
        ev.push(format!(
            "stderr: {text}; an allocation failed, but no RLIMIT_AS, no strict overcommit and no OOM counter explains it"
        ));
    }
    if f.signal.is_some() {
        ev.push(f.signal_text());
    }
    ev.push(f.counters_line());
    verdict(Domain::Unknown, ev, &mut lines)
}

/// A signal read from a shell's 128+N exit code, which the exit line does not spell out.
fn code_signal_line(f: &Findings) -> Option<String> {
    f.signal
        .filter(|(_, via_code)| *via_code)
        .map(|_| f.signal_text())
}

/// The process's own record of its failure: a device allocation that failed
/// (the allocator said so, or the error text), or an allocation its own
/// limits refused (RLIMIT_AS, strict overcommit; the kernel counts nothing).
fn own_failure(f: &Findings) -> Option<(Domain, Vec<String>)> {
    if f.oom.is_some() || f.cuda_line.is_some() {
        return Some((Domain::GpuVram, gpu_lines(f)));
    }
    let text = f.oom_line.as_ref()?;
    if f.as_limit.is_none() && f.strict_commit.is_none() {
        return None;
    }
    let mut ev = vec![format!("stderr: {text}")];
    ev.extend(address_space_lines(f));
    ev.push(f.counters_line());
    Some((Domain::AddressSpace, ev))
}

/// For a lost agent: when it was last heard from.
fn lost_line(f: &Findings) -> Option<String> {
    let inc = f
        .evidence
        .incident
        .as_ref()
        .filter(|i| i.kind == "agent_lost")?;
    Some(match f.evidence.samples.last() {
        Some(s) => format!(
            "last sample at {} ({} before the stream broke at {})",
            time(s.time_ns),
            seconds(inc.time_ns - s.time_ns),
            time(inc.time_ns)
        ),
        None => format!(
            "no sample received before the stream broke at {}",
            time(inc.time_ns)
        ),
    })
}

fn shm_line(f: &Findings) -> String {
    match f.evidence.last_system() {
        Some(s) if s.shm_total_bytes > 0 => format!(
            "/dev/shm used {} of {} ({:.1}%)",
            bytes(s.shm_used_bytes),
            bytes(s.shm_total_bytes),
            100.0 * s.shm_used_bytes as f64 / s.shm_total_bytes as f64
        ),
        _ => "/dev/shm usage was not read".to_string(),
    }
}

fn no_level_at_limit_line(f: &Findings) -> String {
    let Some(c) = &f.counters else {
        return "no cgroup readings".to_string();
    };
    let limited: Vec<String> = c
        .levels()
        .filter(|l| l.limit().is_some())
        .map(|l| format!("{} {}", l.after.path, l.limit_and_peak()))
        .collect();
    if limited.is_empty() {
        "no cgroup level has a memory limit".to_string()
    } else {
        format!("no cgroup level reached its limit: {}", limited.join(", "))
    }
}

fn ram_line(f: &Findings) -> Option<String> {
    let s = f.evidence.last_system()?;
    (s.mem_total_bytes > 0).then(|| {
        format!(
            "MemAvailable {} of MemTotal {}; swap free {} of {}",
            bytes(s.mem_available_bytes),
            bytes(s.mem_total_bytes),
            bytes_short(s.swap_free_bytes),
            bytes_short(s.swap_total_bytes)
        )
    })
}

fn address_space_lines(f: &Findings) -> Vec<String> {
    let mut ev = Vec::new();
    if let Some(limit) = f.as_limit {
        let vm = f
            .vm_line()
            .unwrap_or_else(|| "VmPeak/VmSize not read".to_string());
        ev.push(format!("RLIMIT_AS {}; {vm}", bytes(limit)));
    }
    if let Some((committed, limit)) = f.strict_commit {
        ev.push(format!(
            "strict overcommit (vm.overcommit_memory = 2): Committed_AS {} of CommitLimit {} ({:.1}%)",
            bytes(committed),
            bytes(limit),
            100.0 * committed as f64 / limit as f64
        ));
    }
    ev
}

fn gpu_lines(f: &Findings) -> Vec<String> {
    let mut ev = Vec::new();
    let mut device = None;
    if let Some((_, o)) = f.oom {
        device = Some(o.device);
        ev.push(format!(
            "device OOM on GPU {}: requested {}",
            o.device,
            bytes(o.requested_bytes)
        ));
        if !o.error_text.is_empty() {
            let first = o.error_text.lines().next().unwrap_or_default();
            ev.push(format!(
                "{}: {}",
                o.error_type,
                first.chars().take(300).collect::<String>()
            ));
        }
        if let Some(obs) = &o.observer {
            // The observer's third argument is the device total or the cap, not allocated bytes.
            ev.push(format!(
                "OOM observer: device total or cap {}, device free {}",
                bytes(obs.device_allocated.max(0) as u64),
                bytes(obs.device_free.max(0) as u64)
            ));
        }
        if let Some(s) = &o.stats {
            ev.push(format!(
                "allocator at the failure: allocated {}, reserved {}",
                bytes(s.allocated_bytes),
                bytes(s.reserved_bytes)
            ));
        }
        if o.driver_error != 0 {
            ev.push(format!("driver error {}", o.driver_error));
        }
    } else if let Some(line) = &f.cuda_line {
        ev.push(format!("stderr: {line}"));
    }
    if let Some(line) = nvml_line(f, device) {
        ev.push(line);
    }
    if let Some(limit) = f.as_limit {
        ev.push(format!(
            "note: RLIMIT_AS is finite ({}); CUDA error 2 can be a host address-space failure, since GPU runtimes reserve virtual address space",
            bytes(limit)
        ));
    }
    ev
}

/// The newest NVML reading of the failing device (or the first device).
fn nvml_line(f: &Findings, device: Option<i32>) -> Option<String> {
    let gpu = f
        .evidence
        .samples
        .iter()
        .rev()
        .find_map(|s| s.gpus.iter().find(|g| device.is_none_or(|d| g.index == d)))?;
    let mut line = format!(
        "NVML GPU {} ({}): used {} of {}, free {}",
        gpu.index,
        gpu.name,
        bytes_short(gpu.used_bytes),
        bytes_short(gpu.total_bytes),
        bytes(gpu.free_bytes)
    );
    if !gpu.processes.is_empty() {
        let procs: Vec<String> = gpu
            .processes
            .iter()
            .map(|p| format!("pid {} {}", p.pid, bytes_short(p.used_bytes)))
            .collect();
        line.push_str(&format!("; processes: {}", procs.join(", ")));
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::Domain;

    #[test]
    fn the_wire_name_reads_back_as_its_domain() {
        for d in Domain::ALL {
            assert_eq!(Domain::from_wire(d.as_str()), d);
        }
        assert_eq!(Domain::from_wire("tape"), Domain::Unknown);
        assert_eq!(Domain::from_wire("gpu_vram").title(), "GPU memory (VRAM)");
    }
}
