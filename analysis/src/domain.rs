//! Which memory domain ran out: the first question of every diagnosis.

use crate::devices::{Holder, Whose};
use crate::evidence::Evidence;
use crate::findings::{Findings, SIGBUS, SIGKILL};
use crate::kernel_constraints::{high_order, numa_binding};
use crate::memory_high::{high_throttle, oom_group_line, swap_bound_line};
use crate::pb;
use crate::units::{bytes, bytes_short, seconds, signal_name, time};
use oomscope_proto::IncidentKind;

pub use crate::memory_domain::Domain;

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
    /// The device that ran out, when the domain is `GpuVram` and the
    /// evidence says which.
    pub device: Option<pb::FailedDevice>,
}

pub fn attribute_domain(e: &Evidence) -> DomainVerdict {
    decide(&Findings::gather(e))
}

/// The rules, most specific first. Each arm says why it wins over the later ones.
pub(crate) fn decide(f: &Findings) -> DomainVerdict {
    let mut lines: Vec<String> = f.exit_line().into_iter().collect();
    let lost = lost_line(f);
    // Without the kernel's log, a verdict must say what it could not check.
    let kernel_log = f.kernel.is_none().then(|| f.kernel_log_line()).flatten();
    // Other jobs' pressure on the host: context, never the domain.
    let neighbour = f.thrash.as_ref().and_then(|t| t.neighbour_line());
    let verdict = |domain, mut ev: Vec<String>, lines: &mut Vec<String>| {
        lines.append(&mut ev);
        lines.extend(lost.clone());
        lines.extend(kernel_log.clone());
        lines.extend(neighbour.clone());
        DomainVerdict {
            domain,
            failed: true,
            evidence: std::mem::take(lines),
            cgroup: None,
            device: (domain == Domain::GpuVram)
                .then(|| f.devices.failed_device())
                .flatten(),
        }
    };

    if !f.failed {
        if let Some(sig) = f.stop {
            lines.push(format!(
                "{} was a stop that oomscope run passed on, and the kernel recorded no OOM kill of the instance: a stop, not a failure",
                signal_name(sig)
            ));
            if let Some((b, a)) = f.global_oom {
                lines.push(format!(
                    "/proc/vmstat oom_kill {b} -> {a} meanwhile: another process's kill on this host"
                ));
            }
            lines.extend(kernel_log);
            return DomainVerdict {
                domain: Domain::Unknown,
                failed: false,
                evidence: lines,
                cgroup: None,
                device: None,
            };
        }
        // No death: only a slowdown can be an incident.
        if f.thrashing() {
            let ev = f.thrash.as_ref().map(|t| t.evidence()).unwrap_or_default();
            return verdict(Domain::SwapThrash, ev, &mut lines);
        }
        // memory.high throttled the group until it stalled: a slowdown of
        // the cgroup domain, before any OOM.
        if let Some(t) = high_throttle(f).filter(|t| t.slowed) {
            let mut v = verdict(Domain::Cgroup, t.evidence(), &mut lines);
            v.cgroup = Some(pb::CgroupVerdict {
                path: f
                    .counters
                    .as_ref()
                    .and_then(|c| c.after.cgroup.first())
                    .map_or_else(|| t.path.clone(), |l| l.path.clone()),
                limit_bytes: t.max_bytes,
                owner_level: t.path,
            });
            return v;
        }
        lines.push(match f.exit {
            Some(_) => "a clean exit is not an incident".to_string(),
            None => "no failure in the evidence".to_string(),
        });
        if let Some(t) = &f.thrash {
            lines.extend(t.evidence());
        }
        lines.extend(neighbour);
        return DomainVerdict {
            domain: Domain::Unknown,
            failed: false,
            evidence: lines,
            cgroup: None,
            device: None,
        };
    }

    // The kernel's own record of the kill: it names the constraint, the
    // level whose limit was hit and the victim, so no counter can say more.
    if let Some((_, k)) = f.kernel {
        let (domain, mut ev) = kernel_lines(f, k);
        if domain == Domain::Cgroup {
            if let Some(m) = &f.memcg {
                ev.extend(m.evidence.iter().cloned());
            }
            ev.extend(cgroup_v2_lines(f));
        } else {
            // Bound to some nodes, or a block size the memory could not
            // give: the record says which host RAM ran out, and how.
            ev.extend(numa_binding(f).map(|b| b.evidence()).unwrap_or_default());
            ev.extend(high_order(f).map(|h| h.evidence()).unwrap_or_default());
        }
        let mut v = verdict(domain, ev, &mut lines);
        if domain == Domain::Cgroup {
            v.cgroup = Some(kernel_cgroup(f, k));
        }
        return v;
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

    // The process's own words for a full /dev/shm (ENOSPC, PyTorch's shm
    // texts): they name the domain on their own; the fill level, read
    // around the death, only supports them.
    if f.text_domain == Some(Domain::Shm) {
        let mut ev = text_lines(f);
        ev.extend(shm_writer_line(f));
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
        ev.extend(cgroup_v2_lines(f));
        let mut v = verdict(Domain::Cgroup, ev, &mut lines);
        v.cgroup = Some(pb::CgroupVerdict {
            path: m.own_path.clone(),
            limit_bytes: m.limit_bytes,
            owner_level: m.owner_path.clone(),
        });
        return v;
    }

    // The kernel refused a high-order allocation of a process of the
    // instance ("page allocation failure", no kill) and the process failed.
    if let Some(h) = high_order(f).filter(|h| h.warning) {
        let mut ev = h.evidence();
        ev.extend(ram_line(f));
        return verdict(Domain::HostRam, ev, &mut lines);
    }

    // A process that was not killed failed by itself: its own record (a
    // device OOM, a refusal under its own limits, a runtime's memory text)
    // beats the machine-wide counter, which another process's OOM kill
    // moves as well.
    if f.signal.is_none() {
        if let Some((domain, ev)) = own_failure(f) {
            return verdict(domain, ev, &mut lines);
        }
    }

    // The global OOM killer ran, no cgroup level was at its limit, and this
    // process's death agrees: SIGKILL, with memory short around it.
    if let Some(((b, a), why)) = f.global_oom_agrees() {
        let mut ev = vec![format!(
            "/proc/vmstat oom_kill {b} -> {a}: the global OOM killer ran"
        )];
        ev.push(no_level_at_limit_line(f));
        ev.push(why);
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
            // On a busy host another process's OOM kill moves the host-wide
            // counter: with none of its cgroups' counters moving and the
            // kernel's log, read throughout, holding no kill of this
            // instance, the kill still came from outside.
            if let Some((b, a)) = f
                .global_oom
                .filter(|_| f.evidence.kernel_log_readable() && !c.levels().any(|l| l.any_moved()))
            {
                let ev = vec![
                    format!(
                        "{} with no OOM counter of its cgroups moving and no kernel OOM record of it",
                        f.signal_text()
                    ),
                    format!(
                        "/proc/vmstat oom_kill {b} -> {a}, but the kernel's log, read throughout, records no OOM kill of this instance: another process's kill on this host"
                    ),
                ];
                return verdict(Domain::ExternalKill, ev, &mut lines);
            }
        }
    }

    // Nothing decides it: say what is known and what is missing.
    let mut ev = Vec::new();
    if let Some(text) = &f.oom_line {
        ev.push(format!(
            "stderr: {text}; an allocation failed, but no RLIMIT_AS, no strict overcommit and no OOM counter explains it (and RLIMIT_DATA is unlimited)"
        ));
    }
    if f.signal.is_some() {
        ev.push(f.signal_text());
    }
    ev.push(f.counters_line());
    if let Some((b, a)) = f.global_oom {
        ev.push(format!(
            "/proc/vmstat oom_kill {b} -> {a}, but it counts every kill on the host: without a SIGKILL of this process and memory short around it, it names no domain here"
        ));
    }
    verdict(Domain::Unknown, ev, &mut lines)
}

/// The kernel's record as evidence: the domain its constraint names, the
/// "Killed process" line, the levels, and the victim's memory at the kill.
fn kernel_lines(f: &Findings, k: &pb::KernelOomKill) -> (Domain, Vec<String>) {
    let memcg = k.constraint == "CONSTRAINT_MEMCG";
    if k.counted_only {
        // `oomscope node` without the kernel's log: the cgroup's counter
        // says a kill happened there; nothing says who or how large.
        let mut ev = k.lines.clone();
        ev.push(format!(
            "no kernel record of the kill was read: the victim and its memory at the kill \
             are unknown; the limit of {} is the cgroup's",
            k.oom_memcg
        ));
        return (Domain::Cgroup, ev);
    }
    let killed = k
        .lines
        .iter()
        .find(|l| l.contains("Killed process"))
        .cloned()
        .unwrap_or_else(|| {
            format!(
                "Killed process {} ({}) total-vm:{}kB, anon-rss:{}kB, file-rss:{}kB, shmem-rss:{}kB",
                k.pid,
                k.task,
                k.total_vm_bytes / 1024,
                k.anon_rss_bytes / 1024,
                k.file_rss_bytes / 1024,
                k.shmem_rss_bytes / 1024
            )
        });
    let mut ev = vec![format!("kernel: {killed}")];
    let constraint = if k.constraint.is_empty() {
        "no constraint logged"
    } else {
        k.constraint.as_str()
    };
    let mut how = format!("the kernel's OOM record: {constraint}");
    if memcg && !k.oom_memcg.is_empty() {
        how.push_str(&format!(
            ", the limit of {} was hit (oom_memcg)",
            k.oom_memcg
        ));
    } else if !memcg {
        how.push_str(": the machine's memory (the allowed nodes') ran out, not a cgroup limit");
    }
    if !k.task_memcg.is_empty() {
        how.push_str(&format!("; the victim lived in {}", k.task_memcg));
    }
    if !k.invoked_by.is_empty() {
        how.push_str(&format!("; invoked by {}", k.invoked_by));
    }
    ev.push(how);
    if memcg && k.memcg_limit_bytes > 0 {
        ev.push(format!(
            "memcg usage {} of limit {} at the kill (the kernel's record)",
            bytes(k.memcg_usage_bytes),
            bytes(k.memcg_limit_bytes)
        ));
    }
    ev.push(format!(
        "victim pid {} ({}) at the kill: anon-rss {}, file-rss {}, shmem-rss {}, total-vm {} (the kernel's record)",
        k.pid,
        k.task,
        bytes_short(k.anon_rss_bytes),
        bytes_short(k.file_rss_bytes),
        bytes_short(k.shmem_rss_bytes),
        bytes_short(k.total_vm_bytes)
    ));
    if memcg {
        (Domain::Cgroup, ev)
    } else {
        ev.extend(ram_line(f));
        (Domain::HostRam, ev)
    }
}

/// The cgroup verdict of a memcg kill: the kernel names both levels; the
/// limit is the record's, else the counters' reading of that level.
fn kernel_cgroup(f: &Findings, k: &pb::KernelOomKill) -> pb::CgroupVerdict {
    let from_counters = f.counters.as_ref().and_then(|c| {
        c.levels()
            .find(|l| !k.oom_memcg.is_empty() && k.oom_memcg.ends_with(&l.after.path))
            .and_then(|l| l.limit())
    });
    pb::CgroupVerdict {
        path: if k.task_memcg.is_empty() {
            f.memcg
                .as_ref()
                .map(|m| m.own_path.clone())
                .unwrap_or_default()
        } else {
            k.task_memcg.clone()
        },
        limit_bytes: Some(k.memcg_limit_bytes)
            .filter(|&l| l > 0)
            .or(from_counters)
            .or(f.memcg.as_ref().map(|m| m.limit_bytes))
            .unwrap_or(0),
        owner_level: if k.oom_memcg.is_empty() {
            f.memcg
                .as_ref()
                .map(|m| m.owner_path.clone())
                .unwrap_or_default()
        } else {
            k.oom_memcg.clone()
        },
    }
}

/// cgroup v2's details of a cgroup verdict: memory.oom.group (did the kill
/// take the whole group), memory.swap.max (what the group may swap), and
/// memory.high throttling before the kill.
fn cgroup_v2_lines(f: &Findings) -> Vec<String> {
    let mut ev: Vec<String> = oom_group_line(f).into_iter().collect();
    ev.extend(swap_bound_line(f));
    if let Some(t) = high_throttle(f) {
        ev.push(t.evidence().remove(0));
    }
    ev
}

/// A signal read from a shell's 128+N exit code, which the exit line does not spell out.
fn code_signal_line(f: &Findings) -> Option<String> {
    f.signal
        .filter(|(_, via_code)| *via_code)
        .map(|_| f.signal_text())
}

/// The process's own record of its failure: a device allocation that failed
/// (the allocator said so, or the error text), an allocation its own limits
/// refused (RLIMIT_AS, strict overcommit; the kernel counts nothing), or a
/// runtime's memory text that names its memory (the table in `oom_texts`).
fn own_failure(f: &Findings) -> Option<(Domain, Vec<String>)> {
    if f.oom.is_some() || f.text_domain == Some(Domain::GpuVram) {
        return Some((Domain::GpuVram, gpu_lines(f)));
    }
    let text = f.oom_line.as_ref()?;
    if f.as_limit.is_some() || f.data_limit.is_some() || f.strict_commit.is_some() {
        let mut ev = vec![format!("stderr: {text}")];
        ev.extend(address_space_lines(f));
        ev.push(f.counters_line());
        return Some((Domain::AddressSpace, ev));
    }
    if f.text_domain == Some(Domain::HostRam) {
        let mut ev = text_lines(f);
        ev.extend(ram_line(f));
        ev.push(f.counters_line());
        return Some((Domain::HostRam, ev));
    }
    None
}

/// "stderr: <line>" and, for a runtime's own text, what it means.
fn text_lines(f: &Findings) -> Vec<String> {
    let Some(t) = &f.text else {
        return Vec::new();
    };
    let mut ev = vec![format!("stderr: {}", t.line)];
    if t.text.cause.is_some() {
        ev.push(format!("{}: {}", t.text.runtime, t.text.meaning));
    }
    ev
}

/// For a lost agent: when it was last heard from.
fn lost_line(f: &Findings) -> Option<String> {
    let inc = f
        .evidence
        .incident
        .as_ref()
        .filter(|i| i.kind == IncidentKind::AgentLost)?;
    let mut line = match f.evidence.samples.last() {
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
    };
    // Whether the supervisor shared its child's cgroup says whether one OOM could take both.
    if let Some(place) = f.evidence.supervisor_cgroup() {
        line.push_str(&format!("; the supervisor {place}"));
    }
    Some(line)
}

fn shm_line(f: &Findings) -> String {
    match &f.shm {
        Some(s) => {
            let mut line = format!(
                "/dev/shm used {} of {} ({:.1}%), {}",
                bytes(s.used),
                bytes(s.bound),
                100.0 * s.share(),
                s.label
            );
            if let Some(after) = s.after {
                line.push_str(&format!("; {} after the death", bytes(after)));
            }
            line
        }
        None => "/dev/shm usage was not read".to_string(),
    }
}

/// Who wrote the segment that found no room: the creator a PyTorch segment
/// names, else the process whose stderr said so.
fn shm_writer_line(f: &Findings) -> Option<String> {
    let t = f.text.as_ref()?;
    if let Some(pid) = crate::before_death::shm_writer(&t.line) {
        return Some(format!(
            "the writer: pid {pid}{}, named in the text (a PyTorch segment's creator or the DataLoader worker)",
            title_of(f, pid).map_or(String::new(), |t| format!(" ({t})"))
        ));
    }
    let (_, x) = f.exit?;
    Some(format!(
        "the writer: pid {}{}, whose stderr reported it",
        x.pid,
        title_of(f, x.pid).map_or(String::new(), |t| format!(" ({t})"))
    ))
}

/// A process's title from the supervised tree's samples.
fn title_of(f: &Findings, pid: u32) -> Option<String> {
    f.evidence
        .samples
        .iter()
        .rev()
        .flat_map(|s| s.tree.iter())
        .find(|p| p.pid == pid && !p.title.is_empty())
        .map(|p| p.title.clone())
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

/// The host's memory at the death, labelled with where the reading comes from.
fn ram_line(f: &Findings) -> Option<String> {
    let (s, label) = f.system_at_death()?;
    Some(format!(
        "MemAvailable {} of MemTotal {}; swap free {} of {} ({label})",
        bytes(s.mem_available_bytes),
        bytes(s.mem_total_bytes),
        bytes_short(s.swap_free_bytes),
        bytes_short(s.swap_total_bytes)
    ))
}

fn address_space_lines(f: &Findings) -> Vec<String> {
    let mut ev = Vec::new();
    if let Some(limit) = f.as_limit {
        let vm = f
            .vm_line()
            .unwrap_or_else(|| "VmPeak/VmSize not read".to_string());
        ev.push(format!("RLIMIT_AS {}; {vm}", bytes(limit)));
    }
    if let Some(limit) = f.data_limit {
        let vm = f
            .vm_line()
            .unwrap_or_else(|| "VmPeak/VmSize not read".to_string());
        ev.push(format!(
            "RLIMIT_DATA {} (brk and private writable mappings count against it); {vm}",
            bytes(limit)
        ));
    }
    if let (Some((committed, limit)), Some((c, _))) = (f.strict_commit, &f.commit) {
        let mut line = format!(
            "strict overcommit (vm.overcommit_memory = 2): Committed_AS {} of CommitLimit {} ({:.1}%), {}",
            bytes(committed),
            bytes(limit),
            100.0 * committed as f64 / limit as f64,
            c.label
        );
        if let Some(after) = c.after {
            line.push_str(&format!("; {} after the death", bytes(after)));
        }
        ev.push(line);
    }
    ev
}

fn gpu_lines(f: &Findings) -> Vec<String> {
    let mut ev = Vec::new();
    if let Some((_, o)) = f.oom {
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
    } else if f.text.is_some() {
        ev.extend(text_lines(f));
    } else if let Some(line) = &f.cuda_line {
        ev.push(format!("stderr: {line}"));
    }
    ev.extend(device_line(f));
    let nvml = nvml_lines(f);
    if nvml.is_empty() && f.oom.is_none() {
        // Without NVML (NVIDIA_DRIVER_CAPABILITIES=compute, say) the text
        // alone named the device: say what shows the GPU.
        ev.extend(
            f.evidence
                .gpu_evidence()
                .map(|why| format!("no NVML reading; a GPU is in use: {why}")),
        );
    }
    ev.extend(nvml);
    if let Some(limit) = f.as_limit {
        ev.push(format!(
            "note: RLIMIT_AS is finite ({}); CUDA error 2 can be a host address-space failure, since GPU runtimes reserve virtual address space",
            bytes(limit)
        ));
    }
    ev
}

/// Which device failed and how the evidence says so; or why it cannot,
/// where several GPUs were in sight.
fn device_line(f: &Findings) -> Option<String> {
    let d = &f.devices;
    match (d.failing(), d.failing_how()) {
        (Some(dev), Some(how)) if dev.uuid.is_some() || dev.mapped.is_some() => {
            Some(format!("the failing device is {}: {how}", dev.label()))
        }
        (Some(_), Some(how)) if d.unmapped.is_some() => Some(format!("the failing device: {how}")),
        (None, _) if d.list.len() > 1 => Some(format!(
            "which of the {} GPUs in the evidence failed is unknown{}",
            d.list.len(),
            d.unmapped
                .as_ref()
                .map_or(String::new(), |why| format!(": {why}"))
        )),
        _ => None,
    }
}

/// NVML's newest reading of the failing device, its processes, and what
/// could not be resolved; never another device's.
fn nvml_lines(f: &Findings) -> Vec<String> {
    let Some(dev) = f.devices.failing() else {
        return Vec::new();
    };
    let mut ev = Vec::new();
    if let Some(why) = &dev.unreadable {
        ev.push(format!(
            "NVML could not read {} ({why}): its memory figures are unknown",
            dev.label()
        ));
    }
    let holders = f.gpu_holders();
    if let Some(gpu) = dev.nvml {
        let which = match (&dev.uuid, dev.is_mig()) {
            (Some(u), true) => format!("{u}, a MIG instance of GPU {}", gpu.index),
            _ => format!("GPU {}", gpu.index),
        };
        let mut line = format!(
            "NVML {which} ({}): used {} of {}, free {}",
            gpu.name,
            bytes_short(gpu.used_bytes),
            bytes_short(gpu.total_bytes),
            bytes(gpu.free_bytes)
        );
        if !holders.is_empty() {
            let procs: Vec<String> = holders.iter().map(Holder::describe).collect();
            line.push_str(&format!("; processes: {}", procs.join(", ")));
        }
        if !gpu.processes_unreadable.is_empty() {
            line.push_str(&format!(
                "; NVML refused its process list ({}): who else holds memory there is unknown",
                gpu.processes_unreadable
            ));
        }
        ev.push(line);
    }
    ev.extend(namespace_line(f, &holders));
    ev
}

/// Says when NVML's pids could not be resolved in this process's PID
/// namespace, and what each was taken for.
fn namespace_line(f: &Findings, holders: &[Holder]) -> Option<String> {
    let foreign: Vec<&Holder> = holders
        .iter()
        .filter(|h| {
            matches!(
                h.whose,
                Whose::Unresolved | Whose::OwnUnresolved | Whose::OtherUnresolved
            )
        })
        .collect();
    if foreign.is_empty() {
        return None;
    }
    let own = f.own_gpu_bytes();
    let each: Vec<String> = foreign
        .iter()
        .map(|h| {
            let used = h
                .used_bytes
                .map_or("an unknown amount".to_string(), bytes_short);
            let verdict = match (h.whose, own) {
                (Whose::OwnUnresolved, Some((o, what))) => {
                    format!(
                        "matches this process's own {} ({what}): it is this process",
                        bytes_short(o)
                    )
                }
                (Whose::OtherUnresolved, Some((o, what))) => format!(
                    "is not this process by its own {} ({what}): another process",
                    bytes_short(o)
                ),
                _ => "cannot be placed by the figures at hand".to_string(),
            };
            format!("pid {} ({used}) {verdict}", h.pid)
        })
        .collect();
    Some(format!(
        "NVML's pids are not resolvable in this process's PID namespace (a container, or pids the agent could not find in /proc): none is taken for this process or another by its number; {}",
        each.join("; ")
    ))
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
