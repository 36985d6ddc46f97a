//! What the analysis is given: one agent's messages around one incident.

use crate::pb;
use crate::pb::event::Kind;
use crate::settings::ENV_LABEL_PREFIX;
use oomscope_proto::{IncidentKind, Role};

/// The runtime's count of engine steps in a context's numbers (the vLLM
/// plugin's): a worker's growth per model step is read against it.
pub const ENGINE_STEPS: &str = "engine_steps";

/// The Hello label where `oomscope run` says where it placed itself: moved
/// out of the cgroup it watches (so an OOM there cannot take it), or why it
/// stayed in it.
pub const SUPERVISOR_CGROUP_LABEL: &str = "supervisor_cgroup";

/// Everything known about one agent around one incident, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Evidence {
    pub hello: Option<pb::Hello>,
    pub samples: Vec<pb::Sample>,
    pub events: Vec<pb::Event>,
    pub incident: Option<IncidentRef>,
    /// The instance's other processes that have an agent of their own, each
    /// with its own messages over the same span (no incident, no members of
    /// its own): a worker's heap census is in no other timeline.
    pub members: Vec<Evidence>,
    /// The process died (its agent was lost: no Goodbye): a growth it
    /// showed has no runway left to state.
    pub ended: bool,
}

/// The incident being diagnosed, as the collector recorded it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncidentRef {
    pub id: String,
    /// "oom" | "signal" | "exit_oom_text" | "agent_lost" | "crash_loop"
    pub kind: String,
    pub time_ns: i64,
    pub agent: String,
}

impl Evidence {
    /// The child exit the incident is about: the one nearest the incident's
    /// time (another process of the tree's, for a member's death), else the
    /// last end of the child itself.
    pub fn child_exit(&self) -> Option<(i64, &pb::ChildExit)> {
        if self.incident.is_none() {
            return self.events.iter().rev().find_map(|e| match &e.kind {
                Some(Kind::ChildExit(x)) if !x.member => Some((e.time_ns, x)),
                _ => None,
            });
        }
        self.nearest(|k| match k {
            Kind::ChildExit(x) => Some(x),
            _ => None,
        })
    }

    /// The exit that is this incident's: [`Self::child_exit`], but for a
    /// lost agent, whose incident is its own loss, never a member that
    /// ended cleanly before it (a launcher shim such as pyenv's, a helper).
    pub fn incident_exit(&self) -> Option<(i64, &pb::ChildExit)> {
        let lost = self
            .incident
            .as_ref()
            .is_some_and(|i| i.kind == IncidentKind::AgentLost);
        self.child_exit()
            .filter(|(_, x)| !(lost && x.member && x.signal.is_none() && x.exit_code == Some(0)))
    }

    /// The end of the child `oomscope run` started, after `after_ns`: what
    /// the main process did once another process of its tree had died.
    pub fn main_exit_after(&self, after_ns: i64) -> Option<(i64, &pb::ChildExit)> {
        self.events.iter().find_map(|e| match &e.kind {
            Some(Kind::ChildExit(x)) if !x.member && e.time_ns >= after_ns => Some((e.time_ns, x)),
            _ => None,
        })
    }

    /// The device OOM the incident is about (nearest its time, else the last).
    pub fn oom(&self) -> Option<(i64, &pb::Oom)> {
        self.nearest(|k| match k {
            Kind::Oom(x) => Some(x),
            _ => None,
        })
    }

    /// The kernel's OOM record the incident is about (nearest its time, else
    /// the last). `oomscope run` sends only records whose pid belongs to its
    /// instance, so any record here names one of this instance's processes.
    /// Where an exit is judged, the record must fall within that child's life
    /// (a kill from an earlier restart does not explain a later exit); the
    /// kernel's log may come a few seconds after the death.
    pub fn kernel_oom_kill(&self) -> Option<(i64, &pb::KernelOomKill)> {
        // The kernel's own record before a count of the same kill: a record
        // that came after the counter's wait (`oomscope node`) sits beside
        // the counted kill, within the log's lag of it.
        let near = |t: i64| {
            self.incident
                .as_ref()
                .is_none_or(|i| t.abs_diff(i.time_ns) <= KMSG_LAG_NS as u64)
        };
        let recorded = self
            .nearest(|k| match k {
                Kind::KernelOomKill(x) if x.oom_group.is_empty() && !x.counted_only => Some(x),
                _ => None,
            })
            .filter(|(t, _)| near(*t));
        // The victim the kernel chose, not the tasks memory.oom.group took with it.
        let found = recorded
            .or_else(|| {
                self.nearest(|k| match k {
                    Kind::KernelOomKill(x) if x.oom_group.is_empty() => Some(x),
                    _ => None,
                })
            })
            .or_else(|| {
                self.nearest(|k| match k {
                    Kind::KernelOomKill(x) => Some(x),
                    _ => None,
                })
            })?;
        match self.child_exit() {
            Some((t, x)) => {
                let born = t.saturating_sub(x.runtime_ns as i64 + KMSG_LAG_NS);
                (born..=t.saturating_add(KMSG_LAG_NS))
                    .contains(&found.0)
                    .then_some(found)
            }
            None => Some(found),
        }
    }

    /// When the process died or failed: the child's exit, else the device
    /// OOM, else the kernel's record, else the incident.
    pub fn death_time(&self) -> Option<i64> {
        self.child_exit()
            .map(|(t, _)| t)
            .or_else(|| self.oom().map(|(t, _)| t))
            .or_else(|| self.kernel_oom_kill().map(|(t, _)| t))
            .or_else(|| self.incident.as_ref().map(|i| i.time_ns))
    }

    /// The evidence shows a GPU: announced, read by NVML, or an allocator's.
    pub fn gpu_seen(&self) -> bool {
        self.gpu_evidence().is_some()
    }

    /// What shows a GPU, in words: a device reading (announced, NVML's, an
    /// allocator's, a device OOM), else what says CUDA is in use without NVML
    /// (a CUDA build of torch in the Hello's versions, CUDA_VISIBLE_DEVICES
    /// naming a device), here or in a member's evidence. vLLM's CPU build
    /// has none of these.
    pub fn gpu_evidence(&self) -> Option<String> {
        let h = self.hello.as_ref();
        if h.is_some_and(|h| !h.gpus.is_empty()) {
            return Some("the agent announced its GPUs".to_string());
        }
        if self.samples.iter().any(|s| !s.gpus.is_empty()) {
            return Some("NVML read the GPUs".to_string());
        }
        if self.samples.iter().any(|s| !s.allocator.is_empty()) {
            return Some("a device allocator was read".to_string());
        }
        if self.oom().is_some() {
            return Some("a device allocation failed".to_string());
        }
        // A CUDA build of torch in the versions is no evidence: pip's
        // default torch is one, on CPU-only hosts too.
        let visible = h.and_then(|h| {
            h.cuda_visible_devices.clone().or_else(|| {
                h.labels
                    .get(&format!("{ENV_LABEL_PREFIX}CUDA_VISIBLE_DEVICES"))
                    .cloned()
            })
        });
        if let Some(v) = visible.filter(|v| names_a_device(v)) {
            return Some(format!("CUDA_VISIBLE_DEVICES={v}"));
        }
        self.members.iter().find_map(|m| {
            let h = m.hello.as_ref()?;
            m.gpu_evidence()
                .map(|why| format!("{why} (pid {}, {})", h.pid, h.role))
        })
    }

    /// The Hello's `kernel_log` label when it says the log could not be read:
    /// the reason, as the agent gave it.
    pub fn kernel_log_unreadable(&self) -> Option<&str> {
        let label = self.hello.as_ref()?.labels.get("kernel_log")?;
        label
            .strip_prefix("unreadable")
            .map(|why| why.trim_start_matches([':', ' ']))
    }

    /// Where `oomscope run` placed itself against the cgroup it watches (its
    /// Hello's [`SUPERVISOR_CGROUP_LABEL`]), as it said it.
    pub fn supervisor_cgroup(&self) -> Option<&str> {
        self.hello
            .as_ref()?
            .labels
            .get(SUPERVISOR_CGROUP_LABEL)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }

    /// The agent read the kernel's log throughout (its Hello's `kernel_log`
    /// label says "readable"): a kill of this instance would be on record.
    pub fn kernel_log_readable(&self) -> bool {
        self.hello
            .as_ref()
            .and_then(|h| h.labels.get("kernel_log"))
            .is_some_and(|l| l == "readable")
    }

    /// The ChildStart of the given pid, the last one if restarts reused it.
    pub fn child_start(&self, pid: u32) -> Option<&pb::ChildStart> {
        self.events.iter().rev().find_map(|e| match &e.kind {
            Some(Kind::ChildStart(s)) if s.pid == pid => Some(s),
            _ => None,
        })
    }

    /// The evidence came from `oomscope run`: the supervisor's own (its
    /// Hello, or its child's start and exit), or that of an agent in a
    /// process it started, which it handed its instance and its agent id
    /// (`OOMSCOPE_INSTANCE`, `OOMSCOPE_SUPERVISOR_AGENT`). A probe's agent
    /// is handed the probed server's instance, which says nothing of a
    /// supervisor.
    pub fn from_supervisor(&self) -> bool {
        let supervised_events = self
            .events
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::ChildStart(_) | Kind::ChildExit(_))));
        supervised_events
            || self.hello.as_ref().is_some_and(|h| {
                h.role == Role::Supervisor
                    || h.labels
                        .get("supervisor_agent")
                        .is_some_and(|s| !s.is_empty())
                    || (h.role != Role::Probe && !h.instance.is_empty() && h.instance != h.agent_id)
            })
    }

    /// The newest process list.
    pub fn process_list(&self) -> Option<&pb::ProcessList> {
        self.nearest(|k| match k {
            Kind::ProcessList(x) => Some(x),
            _ => None,
        })
        .map(|(_, p)| p)
    }

    /// The agent's own pid(s): the supervisor, its child and the child's
    /// descendants (the supervised tree: vLLM's engine core and workers), or
    /// the server.
    pub fn own_pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.hello.iter().map(|h| h.pid).collect();
        if let Some((_, x)) = self.child_exit() {
            pids.push(x.pid);
        }
        pids.extend(
            self.samples
                .iter()
                .filter_map(|s| s.process.as_ref().map(|p| p.pid)),
        );
        pids.extend(
            self.samples
                .iter()
                .flat_map(|s| s.tree.iter().map(|p| p.pid)),
        );
        pids.retain(|&p| p != 0);
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// The process reading nearest the end: the child's at its exit, else the last sample's.
    pub fn last_process(&self) -> Option<&pb::ProcessMemory> {
        self.child_exit()
            .and_then(|(_, x)| x.process.as_ref())
            .or_else(|| self.samples.iter().rev().find_map(|s| s.process.as_ref()))
    }

    /// The soft RLIMIT_AS in force, if finite: the exiting child's, else the
    /// last sample's, else the one the agent announced.
    pub fn address_space_limit(&self) -> Option<u64> {
        let from_process = self.last_process().map(|p| p.address_space_limit_bytes);
        let from_hello = self
            .hello
            .as_ref()
            .and_then(|h| h.rlimits.as_ref())
            .map(|r| r.address_space_bytes);
        [from_process, from_hello]
            .into_iter()
            .flatten()
            .find(|&b| is_finite_limit(b))
    }

    /// The soft RLIMIT_DATA in force, if finite, read like RLIMIT_AS.
    pub fn data_limit(&self) -> Option<u64> {
        let from_process = self.last_process().map(|p| p.data_limit_bytes);
        let from_hello = self
            .hello
            .as_ref()
            .and_then(|h| h.rlimits.as_ref())
            .map(|r| r.data_bytes);
        [from_process, from_hello]
            .into_iter()
            .flatten()
            .find(|&b| is_finite_limit(b))
    }

    /// The newest system reading: at the child's exit, else the last sample.
    pub fn last_system(&self) -> Option<&pb::SystemMemory> {
        self.child_exit()
            .and_then(|(_, x)| x.after.as_ref())
            .and_then(|c| c.system.as_ref())
            .or_else(|| self.samples.iter().rev().find_map(|s| s.system.as_ref()))
    }

    fn nearest<'a, T>(&'a self, pick: impl Fn(&'a Kind) -> Option<&'a T>) -> Option<(i64, &'a T)> {
        let found = self
            .events
            .iter()
            .filter_map(|e| e.kind.as_ref().and_then(&pick).map(|x| (e.time_ns, x)));
        match &self.incident {
            // Ties go to the later event: it is the one nearer the death.
            Some(inc) => found.fold(None, |best: Option<(i64, &T)>, (t, x)| match best {
                Some((bt, _)) if t.abs_diff(inc.time_ns) > bt.abs_diff(inc.time_ns) => best,
                _ => Some((t, x)),
            }),
            None => found.last(),
        }
    }
}

/// CUDA_VISIBLE_DEVICES leaves a device visible: its first entry is an
/// ordinal or a GPU/MIG uuid. CUDA stops at the first entry it cannot read,
/// so "", "-1" or "NoDevFiles" hide every device.
pub fn names_a_device(cuda_visible_devices: &str) -> bool {
    let first = cuda_visible_devices.split(',').next().unwrap_or("").trim();
    (!first.is_empty() && first.bytes().all(|b| b.is_ascii_digit()))
        || first.starts_with("GPU-")
        || first.starts_with("MIG-")
}

/// How long after a death the kernel's record may still be read (the
/// supervisor waits briefly for a kill's last line).
pub const KMSG_LAG_NS: i64 = 10_000_000_000;

/// 0 means unlimited in the proto; RLIM_INFINITY (all ones) and v1's
/// "unlimited" (PAGE_COUNTER_MAX pages, about 2^63) can still leak through from
/// a raw reading, so anything at or above 2^62 bytes is treated as no limit.
pub fn is_finite_limit(bytes: u64) -> bool {
    bytes > 0 && bytes < (1u64 << 62)
}
