//! The measurements a verdict is made of, gathered once from the evidence.
//! The domain verdict, the causes and the fixes all read these.

use crate::before_death::{self, PeakReading};
use crate::counters::{
    find_lost_memcg_oom, find_memcg_oom, global_oom_kill, CounterChange, MemcgOom,
};
use crate::devices::{Devices, Holder};
use crate::evidence::Evidence;
use crate::failure::AtFailure;
use crate::memory_domain::Domain;
use crate::oom_texts::{self, cuda_oom_line, Memory, TextMatch};
use crate::pb;
use crate::settings::{self, Runtime, Settings};
use crate::thrash::{read_thrash, ThrashReading};
use crate::timeline::Timeline;
use crate::units::{bytes, seconds, signal_name};
use oomscope_proto::IncidentKind;

pub const SIGBUS: i32 = 7;
pub const SIGKILL: i32 = 9;

/// MemAvailable under this share of MemTotal is memory that ran short: the
/// kernel reclaims until little is left before it kills.
pub const LOW_AVAILABLE_FRACTION: f64 = 0.1;

/// Under strict overcommit (mode 2) the kernel refuses a mapping that would
/// take Committed_AS past CommitLimit; the refused request itself is not
/// counted, so at the failure Committed_AS sits near, not at, the limit.
/// 90% leaves room for a request of a tenth of the limit.
pub const COMMIT_NEAR_FRACTION: f64 = 0.9;

pub struct Findings<'a> {
    pub evidence: &'a Evidence,
    pub exit: Option<(i64, &'a pb::ChildExit)>,
    pub oom: Option<(i64, &'a pb::Oom)>,
    /// The signal that ended the child, and whether it was read from a shell's
    /// 128+N exit code rather than from the wait status.
    pub signal: Option<(i32, bool)>,
    pub counters: Option<CounterChange>,
    pub memcg: Option<MemcgOom>,
    pub global_oom: Option<(u64, u64)>,
    pub thrash: Option<ThrashReading>,
    /// The kernel's OOM record of a process of this instance.
    pub kernel: Option<(i64, &'a pb::KernelOomKill)>,
    /// The stop signal `oomscope run` passed on before the child ended.
    pub stop: Option<i32>,
    /// The runtime's memory text on stderr (the table's most specific entry).
    pub text: Option<TextMatch>,
    /// The domain that text names, where it names one.
    pub text_domain: Option<Domain>,
    /// The stderr line that reports an allocation failure.
    pub oom_line: Option<String>,
    pub cuda_line: Option<String>,
    pub as_limit: Option<u64>,
    /// The finite soft RLIMIT_DATA.
    pub data_limit: Option<u64>,
    /// (Committed_AS, CommitLimit) when overcommit is strict and it refused:
    /// near its limit, or an allocation refused whatever the share (one
    /// large request). Committed_AS is the peak before the death.
    pub strict_commit: Option<(u64, u64)>,
    /// Committed_AS against CommitLimit at its peak before the death, and
    /// the overcommit mode.
    pub commit: Option<(PeakReading, i32)>,
    /// /dev/shm use at its peak before the death.
    pub shm: Option<PeakReading>,
    /// The size of the failed request, where the stderr gives one.
    pub requested_bytes: Option<u64>,
    /// Something failed: a non-clean exit, a device OOM, or an incident with neither.
    pub failed: bool,
    /// The samples as series to fit.
    pub timeline: Timeline,
    /// The device allocator at the failed allocation.
    pub failure: Option<AtFailure>,
    /// The device limit: the failure's, else the failing (or only used)
    /// device's cap or total; 0 if unknown.
    pub device_limit: u64,
    /// The GPU readings joined by device identity, and the failing device.
    pub devices: Devices<'a>,
    /// The runtime's settings: its command line and recorded environment
    /// (see `runtime_settings`).
    pub settings: Settings,
}

impl<'a> Findings<'a> {
    pub fn gather(e: &'a Evidence) -> Findings<'a> {
        let agent_lost = e
            .incident
            .as_ref()
            .is_some_and(|i| i.kind == IncidentKind::AgentLost);
        let exit = e.incident_exit();
        let oom = e.oom();
        let signal = exit.and_then(|(_, x)| match (x.signal, x.exit_code) {
            (Some(s), _) => Some((s, false)),
            // A shell (or `docker run`) reports a child's death by signal N as 128+N.
            (None, Some(c)) if (129..=159).contains(&c) => Some((c - 128, true)),
            _ => None,
        });
        let clean_exit =
            exit.is_some_and(|(_, x)| x.signal.is_none() && x.exit_code.unwrap_or(0) == 0);
        let kernel = e.kernel_oom_kill();
        let stop = exit.and_then(|(_, x)| x.stop_signal);
        // A passed-on stop ends the child without failing it, unless the
        // kernel killed a process of the instance for memory.
        let stopped = stop.is_some();
        let failed = oom.is_some()
            || kernel.is_some()
            || (exit.is_some() && !clean_exit && !stopped)
            || (exit.is_none() && e.incident.is_some());
        let counters = CounterChange::from_evidence(e);
        let sigkill = signal.is_some_and(|(s, _)| s == SIGKILL);
        // A supervisor lost without a goodbye cannot report its child's
        // death: its last readings must speak for it.
        let lost = exit.is_none() && agent_lost;
        let memcg = counters.as_ref().and_then(|c| {
            find_memcg_oom(c, sigkill).or_else(|| lost.then(|| find_lost_memcg_oom(c)).flatten())
        });
        let global_oom = counters.as_ref().and_then(global_oom_kill);
        let stderr = exit.map_or("", |(_, x)| x.stderr_tail.as_str());
        let oom_error = oom
            .map(|(_, o)| format!("{}: {}", o.error_type, o.error_text))
            .unwrap_or_default();
        let cuda_line = cuda_oom_line(stderr).or_else(|| cuda_oom_line(&oom_error));
        let shm = before_death::shm(e);
        // A bare ENOSPC names no filesystem: /dev/shm's fill says whether it is its.
        let text = oom_texts::find(stderr).or_else(|| {
            shm.as_ref()
                .and_then(|s| oom_texts::enospc_on_full_shm(stderr, s.used, s.bound))
        });
        let text_domain = text.as_ref().and_then(|t| t.domain(e.gpu_seen()));
        let commit = before_death::commit(e);
        // Strict overcommit refuses by reservation: a host allocation that
        // failed under mode 2 was refused by it, however far below the
        // limit the rest sat (one large request).
        let refused = text
            .as_ref()
            .is_some_and(|t| matches!(t.text.memory, Memory::Unsaid | Memory::Host));
        let strict_commit = commit.as_ref().and_then(|(c, mode)| {
            let strict = *mode == 2 && (refused || c.share() >= COMMIT_NEAR_FRACTION);
            strict.then_some((c.used, c.bound))
        });
        let devices = Devices::of(e);
        let timeline = Timeline::of_device(e, devices.failing_key().as_ref());
        let failure = AtFailure::from_evidence(e, oom, &timeline, &devices);
        let device_limit = failure
            .as_ref()
            .map(|f| f.limit_bytes)
            .filter(|&l| l > 0)
            .unwrap_or_else(|| devices.limit_bytes());
        let settings = runtime_settings(e, text.as_ref());
        Findings {
            evidence: e,
            settings,
            timeline,
            failure,
            device_limit,
            devices,
            exit,
            oom,
            signal,
            counters,
            memcg,
            global_oom,
            thrash: read_thrash(&e.samples),
            kernel,
            stop,
            oom_line: text.as_ref().map(|t| t.line.clone()),
            text,
            text_domain,
            cuda_line,
            as_limit: e.address_space_limit(),
            data_limit: e.data_limit(),
            strict_commit,
            commit,
            shm,
            requested_bytes: before_death::requested_bytes(stderr),
            failed,
        }
    }

    /// What this process is known to hold on the failing device at least,
    /// and where that figure comes from: PyTorch's "this process has"
    /// (non-PyTorch memory included), else its allocator's reserved bytes.
    pub fn own_gpu_bytes(&self) -> Option<(u64, &'static str)> {
        let x = self.failure.as_ref();
        x.and_then(|x| x.text.process_bytes)
            .map(|b| (b, "PyTorch's \"this process has\""))
            .or_else(|| {
                x.map(|x| x.reserved_bytes)
                    .filter(|&r| r > 0)
                    .map(|r| (r, "reserved by PyTorch"))
            })
    }

    /// The processes NVML (or PyTorch's text) reports on the failing
    /// device, each placed as this process's or another's where the
    /// evidence can tell.
    pub fn gpu_holders(&self) -> Vec<Holder> {
        let own = self.own_gpu_bytes().map(|(b, _)| b);
        self.devices.failing_holders(self.evidence, own)
    }

    /// The runtime, where the evidence names one.
    pub fn runtime(&self) -> Option<Runtime> {
        self.settings.runtime
    }

    /// The runtime reserves its KV cache as one pool at start-up.
    pub fn preallocated_kv(&self) -> bool {
        self.runtime().is_some_and(Runtime::preallocates_kv)
    }

    /// The host limit that growth runs into: the tightest cgroup limit, else MemTotal.
    pub fn host_limit(&self) -> Option<(u64, &'static str)> {
        if let Some(l) = self
            .timeline
            .points
            .iter()
            .rev()
            .find_map(|p| p.cgroup_limit)
        {
            return Some((l, "the cgroup limit"));
        }
        self.evidence
            .last_system()
            .map(|s| s.mem_total_bytes)
            .filter(|&t| t > 0)
            .map(|t| (t, "MemTotal"))
    }

    pub fn is_signal(&self, sig: i32) -> bool {
        self.signal.is_some_and(|(s, _)| s == sig)
    }

    pub fn thrashing(&self) -> bool {
        self.thrash.as_ref().is_some_and(|t| t.thrashing)
    }

    /// The system reading that stands for the moment of the death: the last
    /// sample before it, else the reading at the child's exit (the process
    /// was already dead, so its memory was back), with a label that says which.
    pub fn system_at_death(&self) -> Option<(&'a pb::SystemMemory, String)> {
        let e = self.evidence;
        let death = e.death_time();
        let before = e
            .samples
            .iter()
            .rev()
            .filter(|s| death.is_none_or(|d| s.time_ns < d))
            .find_map(|s| s.system.as_ref().map(|m| (s.time_ns, m)))
            .filter(|(_, m)| m.mem_total_bytes > 0);
        if let Some((t, m)) = before {
            let label = match death {
                Some(d) => format!("the last sample, {} before the death", seconds(d - t)),
                None => "the last sample".to_string(),
            };
            return Some((m, label));
        }
        self.exit
            .and_then(|(_, x)| x.after.as_ref())
            .and_then(|c| c.system.as_ref())
            .filter(|m| m.mem_total_bytes > 0)
            .map(|m| (m, "read after the death".to_string()))
    }

    /// Memory ran short around the death: MemAvailable low in the reading
    /// before it or after it (after a kill the victim's memory is back, so a
    /// low reading then is low all the more), or the process's own words.
    pub fn memory_short(&self) -> Option<String> {
        let after = self
            .exit
            .and_then(|(_, x)| x.after.as_ref())
            .and_then(|c| c.system.as_ref())
            .map(|m| (m, "read after the death".to_string()));
        let low = self
            .system_at_death()
            .into_iter()
            .chain(after)
            .find(|(m, _)| {
                m.mem_total_bytes > 0
                    && (m.mem_available_bytes as f64)
                        < m.mem_total_bytes as f64 * LOW_AVAILABLE_FRACTION
            });
        if let Some((_, label)) = low {
            // The numbers are in the RAM line; this says why they count.
            return Some(format!(
                "memory was short: MemAvailable under {:.0}% of MemTotal ({label})",
                LOW_AVAILABLE_FRACTION * 100.0
            ));
        }
        self.oom_line
            .as_ref()
            .map(|l| format!("memory was short: the process reported a failed allocation ({l})"))
    }

    /// The machine-wide OOM counter moved, and this process's death agrees:
    /// it was killed by SIGKILL (a kernel record would have decided earlier)
    /// and memory ran short. vmstat counts every cgroup's kills on the host,
    /// so the counter alone never names a domain.
    pub fn global_oom_agrees(&self) -> Option<((u64, u64), String)> {
        let moved = self.global_oom?;
        if !self.is_signal(SIGKILL) {
            return None;
        }
        self.memory_short().map(|why| (moved, why))
    }

    /// "the kernel log could not be read (why)", when the agent said so.
    pub fn kernel_log_line(&self) -> Option<String> {
        let why = self.evidence.kernel_log_unreadable()?;
        Some(if why.is_empty() {
            "the kernel log could not be read, so no kernel OOM record could confirm or rule out a kill".to_string()
        } else {
            format!("the kernel log could not be read ({why}), so no kernel OOM record could confirm or rule out a kill")
        })
    }

    /// "killed by signal 9 (SIGKILL)" or "exit code 137 (128 + 9, SIGKILL)".
    pub fn signal_text(&self) -> String {
        match self.signal {
            Some((s, false)) => format!("killed by signal {s} ({})", signal_name(s)),
            Some((s, true)) => format!("exit code {} (128 + {s}, {})", s + 128, signal_name(s)),
            None => "not killed by a signal".to_string(),
        }
    }

    /// How the child ended, for the first evidence line.
    pub fn exit_line(&self) -> Option<String> {
        let (_, x) = self.exit?;
        let how = match (x.signal, x.exit_code) {
            (Some(s), _) => format!(
                "killed by signal {s} ({}){}",
                signal_name(s),
                if x.core_dumped { ", core dumped" } else { "" }
            ),
            (None, Some(c)) => format!("exited with code {c}"),
            (None, None) => "ended (no exit status recorded)".to_string(),
        };
        let who = match x.member {
            true if !x.title.is_empty() => format!("member pid {} ({})", x.pid, x.title),
            true => format!("member pid {}", x.pid),
            false => format!("child pid {}", x.pid),
        };
        let mut line = format!("{who} {how} after {}", seconds(x.runtime_ns as i64));
        if x.member {
            let t = self.exit.map_or(0, |(t, _)| t);
            if let Some((_, main)) = self.evidence.main_exit_after(t) {
                // The kernel may take the main process too, while the first
                // victim's memory is still being freed: a kill of its own.
                let killed_too = self.evidence.events.iter().any(|e| {
                    matches!(&e.kind, Some(pb::event::Kind::KernelOomKill(k)) if k.pid == main.pid)
                });
                let then = match (main.signal, main.exit_code) {
                    (Some(_), _) if killed_too => {
                        "was OOM-killed by the kernel too (its own record)".to_string()
                    }
                    (Some(s), _) => format!("was killed by signal {s} ({})", signal_name(s)),
                    (None, Some(c)) => format!("exited with code {c}"),
                    (None, None) => "ended".to_string(),
                };
                let why = match killed_too {
                    true => "",
                    false => ": a consequence, not a clean stop",
                };
                line.push_str(&format!(
                    "; then the main process (pid {}) {then}{why}",
                    main.pid
                ));
            }
        }
        if x.attempt > 0 {
            line.push_str(&format!(" (restart {})", x.attempt));
        }
        if x.crash_loop {
            line.push_str("; restarts gave up (crash loop)");
        }
        Some(line)
    }

    /// "VmPeak 250.0 MiB (...); VmSize 249.0 MiB (...)" of the last process reading.
    pub fn vm_line(&self) -> Option<String> {
        let p = self.evidence.last_process()?;
        (p.vm_peak_bytes > 0 || p.vm_size_bytes > 0).then(|| {
            format!(
                "VmPeak {}; VmSize {}",
                bytes(p.vm_peak_bytes),
                bytes(p.vm_size_bytes)
            )
        })
    }

    /// "no OOM counter moved (child start/exit)" or the counters that did.
    pub fn counters_line(&self) -> String {
        match &self.counters {
            None => "no before/after kernel counters were recorded".to_string(),
            Some(c) if !c.any_oom_counter_moved() => format!(
                "no kernel OOM counter moved between the {} readings: cgroup oom_kill/oom/failcnt and /proc/vmstat oom_kill unchanged",
                c.source
            ),
            Some(c) => format!("counters that moved ({}): {}", c.source, c.moved_lines().join("; ")),
        }
    }
}

/// The runtime's settings from the Hello (command line, recorded
/// environment). Where they name no serving runtime, the runtime's own
/// memory text or the numbers its plugin reported do: the values are then
/// unknown, but the setting to change is not.
fn runtime_settings(e: &Evidence, text: Option<&TextMatch>) -> Settings {
    let mut s = e.hello.as_ref().map(settings::of_hello).unwrap_or_default();
    if matches!(s.runtime, None | Some(Runtime::Pytorch)) {
        let named = text
            .and_then(|t| Runtime::from_name(t.text.runtime))
            .or_else(|| crate::kv_pool_figures::reported_runtime(e));
        if named.is_some() {
            s.runtime = named;
        }
    }
    s
}
