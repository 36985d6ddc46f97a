//! Host-side causes: a cgroup limit, system RAM, the address-space limit,
//! strict overcommit, /dev/shm, swap thrash, a kill from outside.

use super::cause;
use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::pb;
use crate::units::{bytes, bytes_short};
use oomscope_proto::CauseKind;

// At or above this share of /dev/shm in use, a SIGBUS is a full /dev/shm;
// below it the SIGBUS may come from a truncated mapped file instead.
use crate::oom_texts::SHM_FULL_FRACTION;

/// A VmPeak at least this share of RLIMIT_AS means the process itself walked
/// into the limit; below it, one oversized request did.
const AS_NEAR_FRACTION: f64 = 0.5;

/// The kernel's own figures at the kill, quoted before anything read after
/// it: "the kernel's record at the kill: victim pid 123 (VLLM::Worker)
/// anon-rss 2.0 GiB, file-rss 6.5 MiB, shmem-rss 0 B; cgroup /x usage
/// 64.0 MiB of limit 64.0 MiB".
fn kernel_figures(k: &pb::KernelOomKill) -> String {
    if k.counted_only {
        return format!(
            "an OOM kill counted by cgroup {} (the kernel's record was not read: no victim figures)",
            k.oom_memcg
        );
    }
    let mut line = format!(
        "the kernel's record at the kill: victim pid {} ({}) anon-rss {}, file-rss {}, shmem-rss {}",
        k.pid,
        k.task,
        bytes_short(k.anon_rss_bytes),
        bytes_short(k.file_rss_bytes),
        bytes_short(k.shmem_rss_bytes)
    );
    if k.memcg_limit_bytes > 0 {
        let memcg = if k.oom_memcg.is_empty() {
            "the cgroup".to_string()
        } else {
            format!("cgroup {}", k.oom_memcg)
        };
        line.push_str(&format!(
            "; {memcg} usage {} of limit {}",
            bytes_short(k.memcg_usage_bytes),
            bytes_short(k.memcg_limit_bytes)
        ));
    }
    line
}

/// The victim's figures from the kernel's record, as metrics.
fn kernel_metrics(k: &pb::KernelOomKill) -> [(&'static str, f64); 3] {
    [
        ("victim_anon_rss_bytes", k.anon_rss_bytes as f64),
        ("victim_file_rss_bytes", k.file_rss_bytes as f64),
        ("victim_shmem_rss_bytes", k.shmem_rss_bytes as f64),
    ]
}

pub fn cgroup_limit(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let Some(m) = f.memcg.as_ref() else {
        return kernel_cgroup_limit(f, v);
    };
    // The kernel measured the victim at the kill; the counters were read
    // after it, when the victim's memory was already freed.
    let mut evidence: Vec<String> = f
        .kernel
        .map(|(_, k)| kernel_figures(k))
        .into_iter()
        .collect();
    evidence.extend(m.evidence.iter().cloned());
    let owner = f
        .counters
        .as_ref()
        .and_then(|c| c.levels().find(|l| l.after.path == m.owner_path));
    let mut metrics = vec![
        ("limit_bytes", m.limit_bytes as f64),
        ("peak_bytes", m.peak_bytes as f64),
        ("usage_bytes", m.usage_bytes as f64),
        ("owner_depth", m.owner_depth as f64),
    ];
    if let Some((_, k)) = f.kernel {
        metrics.extend(kernel_metrics(k));
    }
    if let Some(l) = owner {
        let s = l.after;
        if s.anon_bytes + s.file_bytes + s.shmem_bytes > 0 {
            let read_after_kill = f.kernel.is_some_and(|(kill_ns, _)| {
                let read_ns = f.counters.as_ref().map_or(0, |c| c.after.time_ns);
                read_ns == 0 || read_ns >= kill_ns
            });
            let when = if read_after_kill {
                ", read after the kill (the victim's pages already freed)"
            } else {
                ""
            };
            // File and shmem pages count against the limit too; this says which grew.
            evidence.push(format!(
                "cgroup {} memory.stat{when}: anon {}, file {}, shmem {}",
                s.path,
                bytes(s.anon_bytes),
                bytes(s.file_bytes),
                bytes(s.shmem_bytes)
            ));
            metrics.extend([
                ("anon_bytes", s.anon_bytes as f64),
                ("file_bytes", s.file_bytes as f64),
                ("shmem_bytes", s.shmem_bytes as f64),
            ]);
        }
    }
    Some(cause(
        CauseKind::CgroupLimit,
        m.confidence,
        evidence,
        &metrics,
    ))
}

/// A memcg kill the kernel recorded where the counters named no owner (a
/// missing file, a level this agent cannot read): the record names it.
fn kernel_cgroup_limit(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let (_, k) = f
        .kernel
        .filter(|(_, k)| k.constraint == "CONSTRAINT_MEMCG")?;
    let limit = v
        .cgroup
        .as_ref()
        .map_or(k.memcg_limit_bytes, |c| c.limit_bytes);
    let evidence = vec![
        kernel_figures(k),
        format!(
            "the kernel's OOM record: the limit of {} was hit; usage {} of limit {} at the kill",
            k.oom_memcg,
            bytes(k.memcg_usage_bytes),
            bytes(limit)
        ),
    ];
    let mut metrics = vec![
        ("limit_bytes", limit as f64),
        ("usage_bytes", k.memcg_usage_bytes as f64),
    ];
    metrics.extend(kernel_metrics(k));
    Some(cause(CauseKind::CgroupLimit, 0.95, evidence, &metrics))
}

pub fn host_ram_exhausted(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::HostRam || super::host_kernel::more_specific_than_exhaustion(f) {
        return None;
    }
    // The kernel's record, else the machine-wide counter where the death agrees with it.
    let kernel = f.kernel.filter(|(_, k)| k.constraint != "CONSTRAINT_MEMCG");
    let global = f.global_oom_agrees();
    let (mut evidence, mut metrics) = match (kernel, &global) {
        (Some((_, k)), _) => (
            vec![
                kernel_figures(k),
                format!(
                    "the kernel's OOM record ({}): it killed pid {} ({})",
                    if k.constraint.is_empty() {
                        "no constraint logged"
                    } else {
                        k.constraint.as_str()
                    },
                    k.pid,
                    k.task
                ),
            ],
            kernel_metrics(k).to_vec(),
        ),
        (None, Some(((b, a), _))) => (
            vec![format!(
                "/proc/vmstat oom_kill {b} -> {a} with no cgroup level at its limit"
            )],
            vec![("vmstat_oom_kill_delta", (a - b) as f64)],
        ),
        // Host RAM named by the runtime's own text: its cause says more.
        (None, None) => return None,
    };
    if let Some((s, label)) = f.system_at_death() {
        evidence.push(format!(
            "MemAvailable {} of MemTotal {} ({label})",
            bytes(s.mem_available_bytes),
            bytes(s.mem_total_bytes)
        ));
        metrics.extend([
            ("mem_total_bytes", s.mem_total_bytes as f64),
            ("mem_available_bytes", s.mem_available_bytes as f64),
            ("swap_free_bytes", s.swap_free_bytes as f64),
        ]);
    }
    // The kernel's record names the victim; vmstat counts kills anywhere on
    // the host, and only the child's SIGKILL with memory short ties it to us.
    let confidence = if kernel.is_some() { 0.95 } else { 0.9 };
    Some(cause(
        CauseKind::HostRamExhausted,
        confidence,
        evidence,
        &metrics,
    ))
}

pub fn address_space_limit(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let limit = f.as_limit?;
    let p = f.evidence.last_process();
    let vm_peak = p.map_or(0, |p| p.vm_peak_bytes);
    let vm_size = p.map_or(0, |p| p.vm_size_bytes);
    let mut evidence = vec![format!(
        "RLIMIT_AS {}; VmPeak {}; VmSize {}",
        bytes(limit),
        bytes(vm_peak),
        bytes(vm_size)
    )];
    let confidence = match v.domain {
        Domain::AddressSpace if vm_peak as f64 >= limit as f64 * AS_NEAR_FRACTION => 0.9,
        Domain::AddressSpace => {
            evidence.push(format!(
                "VmPeak is under {:.0}% of the limit: one large request was refused",
                AS_NEAR_FRACTION * 100.0
            ));
            0.7
        }
        // CUDA error 2 without an allocator OOM event: it may be the host's limit.
        Domain::GpuVram if f.oom.is_none() => {
            evidence.push(
                "CUDA error 2 can be a host address-space failure under a finite RLIMIT_AS"
                    .to_string(),
            );
            0.3
        }
        _ => return None,
    };
    if let Some(line) = &f.oom_line {
        evidence.insert(0, format!("stderr: {line}"));
    }
    let metrics = [
        ("limit_bytes", limit as f64),
        ("vm_peak_bytes", vm_peak as f64),
        ("vm_size_bytes", vm_size as f64),
    ];
    Some(cause(
        CauseKind::AddressSpaceLimit,
        confidence,
        evidence,
        &metrics,
    ))
}

/// RLIMIT_DATA refuses brk and private writable mappings (malloc's arenas,
/// anonymous mmap) past it: the address-space domain, like RLIMIT_AS.
pub fn data_limit(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::AddressSpace {
        return None;
    }
    let limit = f.data_limit?;
    let p = f.evidence.last_process();
    let vm_peak = p.map_or(0, |p| p.vm_peak_bytes);
    let vm_size = p.map_or(0, |p| p.vm_size_bytes);
    let mut evidence = vec![format!(
        "RLIMIT_DATA {}: the kernel refuses brk and private writable mappings past it; VmPeak {}, VmSize {} (code, stacks and shared mappings are in these but not in the limit)",
        bytes(limit),
        bytes(vm_peak),
        bytes(vm_size)
    )];
    if let Some(line) = &f.oom_line {
        evidence.insert(0, format!("stderr: {line}"));
    }
    let mut metrics = vec![
        ("limit_bytes", limit as f64),
        ("vm_peak_bytes", vm_peak as f64),
        ("vm_size_bytes", vm_size as f64),
    ];
    if let Some(r) = f.requested_bytes {
        evidence.push(format!("the failed request: {}", bytes(r)));
        metrics.push(("requested_bytes", r as f64));
    }
    // A tighter RLIMIT_AS, or strict overcommit, could have refused it as well.
    let confidence = match (f.as_limit, f.strict_commit) {
        (Some(a), _) if a <= limit => 0.5,
        (_, Some(_)) => 0.6,
        _ => 0.85,
    };
    Some(cause(CauseKind::DataLimit, confidence, evidence, &metrics))
}

/// Strict overcommit (mode 2) refused a reservation. Committed_AS is its
/// peak before the death: read after it, the dead process's commit is gone.
pub fn overcommit_limit(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::AddressSpace {
        return None;
    }
    let (committed, limit) = f.strict_commit?;
    let share = committed as f64 / limit as f64;
    let mut line = format!(
        "vm.overcommit_memory = 2: Committed_AS {} of CommitLimit {} ({:.1}%)",
        bytes(committed),
        bytes(limit),
        share * 100.0
    );
    let mut metrics = vec![
        ("committed_as_bytes", committed as f64),
        ("commit_limit_bytes", limit as f64),
        ("commit_share", share),
        ("commit_room_bytes", limit.saturating_sub(committed) as f64),
    ];
    if let Some((c, _)) = &f.commit {
        line.push_str(&format!(", {}", c.label));
        if let Some(after) = c.after {
            line.push_str(&format!("; {} after the death", bytes(after)));
            metrics.push(("committed_as_after_bytes", after as f64));
        }
    }
    let mut evidence = vec![line];
    if let Some(text) = &f.oom_line {
        evidence.push(format!("stderr: {text}"));
    }
    if share < crate::findings::COMMIT_NEAR_FRACTION {
        evidence.push(format!(
            "below {:.0}% of CommitLimit: one request larger than the {} left was refused",
            crate::findings::COMMIT_NEAR_FRACTION * 100.0,
            bytes(limit.saturating_sub(committed))
        ));
    }
    if let Some(r) = f.requested_bytes {
        evidence.push(format!("the failed request: {}", bytes(r)));
        metrics.push(("requested_bytes", r as f64));
    }
    // With a finite RLIMIT_AS or RLIMIT_DATA as well, either could have refused it.
    let confidence = if f.as_limit.is_some() || f.data_limit.is_some() {
        0.5
    } else {
        0.85
    };
    Some(cause(
        CauseKind::OvercommitLimit,
        confidence,
        evidence,
        &metrics,
    ))
}

/// /dev/shm ran out: a SIGBUS on a shared page, or the process's own words
/// (ENOSPC on /dev/shm, PyTorch's shm texts). The fill level is the peak
/// before the death: segments are unlinked as their processes die.
pub fn shm_full(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::Shm {
        return None;
    }
    let said = f.text_domain == Some(Domain::Shm);
    let mut evidence = match (&f.text, said) {
        (Some(t), true) => vec![
            format!("stderr: {}", t.line),
            format!("{}: {}", t.text.runtime, t.text.meaning),
        ],
        _ => vec![f.signal_text()],
    };
    let mut metrics = Vec::new();
    let mut confidence = if said { 0.9 } else { 0.6 };
    match &f.shm {
        Some(s) => {
            let mut line = format!(
                "/dev/shm used {} of {} ({:.1}%), {}",
                bytes(s.used),
                bytes(s.bound),
                s.share() * 100.0,
                s.label
            );
            if let Some(after) = s.after {
                line.push_str(&format!("; {} after the death", bytes(after)));
                metrics.push(("shm_used_after_bytes", after as f64));
            }
            evidence.push(line);
            if s.share() >= SHM_FULL_FRACTION {
                confidence = 0.9;
            } else if said {
                evidence.push(
                    "the readings missed the fill (a sample lies between fills and frees); the process's words decide".to_string(),
                );
            } else {
                evidence.push(
                    "/dev/shm is not full: a truncated memory-mapped file also raises SIGBUS"
                        .to_string(),
                );
                confidence = 0.4;
            }
            metrics.extend([
                ("shm_used_bytes", s.used as f64),
                ("shm_total_bytes", s.bound as f64),
            ]);
        }
        None => evidence.push("/dev/shm usage was not read".to_string()),
    }
    if let Some(pid) = f
        .oom_line
        .as_deref()
        .filter(|_| said)
        .and_then(crate::before_death::shm_writer)
    {
        evidence.push(format!("the writer: pid {pid}, named in the text"));
        metrics.push(("writer_pid", pid as f64));
    } else if let Some((_, x)) = f.exit.filter(|_| said) {
        evidence.push(format!(
            "the writer: pid {}, whose stderr reported it",
            x.pid
        ));
        metrics.push(("writer_pid", x.pid as f64));
    }
    Some(cause(CauseKind::ShmFull, confidence, evidence, &metrics))
}

pub fn swap_thrash(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let t = f.thrash.as_ref().filter(|t| t.thrashing)?;
    let metrics = [
        ("refaults_per_s", t.refaults_per_s()),
        ("refault_pages", t.refaults() as f64),
        ("refault_share", t.refault_share()),
        ("working_set_bytes", t.working_set_bytes as f64),
        ("pswpin_per_s", t.pswpin as f64 / t.window_s),
        ("pswpout_per_s", t.pswpout as f64 / t.window_s),
        ("psi_some_avg10", t.some_avg10),
        ("psi_full_avg10", t.full_avg10),
        ("psi_some_stall_s", t.some_stall_us as f64 / 1e6),
        ("psi_some_stall_share", t.stall_share()),
        ("window_s", t.window_s),
    ];
    let confidence = if v.domain == Domain::SwapThrash {
        0.8
    } else {
        0.4
    };
    Some(cause(
        CauseKind::SwapThrash,
        confidence,
        t.evidence(),
        &metrics,
    ))
}

pub fn external_kill(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::ExternalKill {
        return None;
    }
    let counted = f
        .counters
        .as_ref()
        .is_some_and(|c| c.any_oom_counter_moved());
    let evidence = vec![
        if counted {
            format!(
                "{}, no OOM counter of its cgroups moved and the kernel's log records no OOM kill of it",
                f.signal_text()
            )
        } else {
            format!("{} and no kernel OOM counter moved", f.signal_text())
        },
        "the kill came from outside the kernel's OOM paths: an orchestrator (liveness probe, eviction), a stop timeout, a userspace OOM daemon, or a person".to_string(),
    ];
    let runtime_s = f.exit.map_or(0.0, |(_, x)| x.runtime_ns as f64 / 1e9);
    Some(cause(
        CauseKind::ExternalKill,
        0.7,
        evidence,
        &[("signal", 9.0), ("runtime_s", runtime_s)], // vocab: a metric
    ))
}
