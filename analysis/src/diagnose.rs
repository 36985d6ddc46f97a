//! The whole verdict for one incident.

use crate::capacity;
use crate::causes;
use crate::domain::{decide, Domain};
use crate::evidence::Evidence;
use crate::failure;
use crate::findings::Findings;
use crate::fixes;
use crate::members;
use crate::pb;
use crate::runway::RUNWAY_PREFIX;
use crate::trigger;
use oomscope_proto::{CauseKind, Role, TriggerKind};

/// Causes read from the host around the process, not from the process:
/// beside a start-up failure they explain nothing.
const HOST_CONTEXT: &[CauseKind] = &[CauseKind::SwapThrash, CauseKind::OtherProcess];

/// Why a diagnosis has no memory domain, in words: nothing failed, or the
/// process failed while starting for a reason that no memory explains.
pub fn no_domain_reason(d: &pb::Diagnosis) -> &'static str {
    match d.causes.first() {
        Some(c) if c.kind == CauseKind::StartupFailure => {
            "no memory ran out: it failed while starting"
        }
        _ => "nothing failed",
    }
}

/// The memory domain, as an incident row names it ([`crate::attribute_domain`]'s,
/// `Unknown` where nothing decides it), or None where the process failed at
/// start-up for a reason that no memory explains.
pub fn memory_domain(e: &Evidence) -> Option<Domain> {
    let f = Findings::gather(e);
    let verdict = decide(&f);
    let startup = causes::startup_failure::read(&f, &verdict).is_some();
    (!startup).then_some(verdict.domain)
}

/// Domain, trigger, exit, cgroup, evidence, causes, fixes and capacity for
/// one incident, or for one agent's timeline without one (a leak hunt: no
/// domain, but trigger and causes still apply).
pub fn diagnose(e: &Evidence) -> pb::Diagnosis {
    let f = Findings::gather(e);
    let mut verdict = decide(&f);
    let mut causes = causes::analyze(&f, &verdict);
    // A failure at start-up that no memory explains has no memory domain:
    // the host's pressure and its other processes are context around it.
    let startup = causes.iter().any(|c| c.kind == CauseKind::StartupFailure);
    if startup {
        causes.retain(|c| !HOST_CONTEXT.iter().any(|k| c.kind == *k));
        causes.sort_by_key(|c| c.kind != CauseKind::StartupFailure);
        verdict.evidence.push(
            "no memory domain: the process failed while starting, for the error its stderr names (startup_failure)"
                .to_string(),
        );
    }
    let mut trigger = trigger::decide(&f, &verdict);
    // The instance's other processes: a member's growth is a cause of its
    // own, and the one that took the member the failure took leads.
    // (A probe that drove it is no process of it: its requests are read by
    // the trigger.)
    let member_verdicts = e
        .members
        .iter()
        .filter(|m| m.hello.as_ref().is_some_and(|h| h.role != Role::Probe))
        .filter_map(|m| Some((m.hello.as_ref()?, diagnose(m))))
        .collect();
    let from_members = members::causes(&f, &causes, member_verdicts);
    if !from_members.is_empty() {
        let kinds: Vec<String> = from_members.iter().map(|c| c.kind.clone()).collect();
        causes.retain(|c| !kinds.contains(&c.kind));
        causes.extend(from_members);
        causes.sort_by(|a, b| b.confidence.total_cmp(&a.confidence));
        // Trigger and causes never disagree: growth that stands as a cause
        // is growth over repeated work.
        let growth_leads = causes
            .first()
            .filter(|c| matches!(c.kind.parse(), Ok(CauseKind::Leak | CauseKind::HostGrowth)));
        if let Some(line) = growth_leads.and_then(members::trigger_line) {
            if !matches!(trigger, Some((TriggerKind::RepeatedRequests, _))) {
                trigger = Some((TriggerKind::RepeatedRequests, line));
            }
        }
    }
    if e.ended && !verdict.failed {
        causes.iter_mut().for_each(members::strip_runway);
        if causes
            .iter()
            .any(|c| matches!(c.kind.parse(), Ok(CauseKind::Leak | CauseKind::HostGrowth)))
        {
            verdict
                .evidence
                .push("the process has ended: its growth has no runway left".to_string());
        }
    }
    if let Some((t, line)) = &trigger {
        verdict
            .evidence
            .push(format!("trigger {}: {line}", t.as_str()));
    }
    // A full KV pool that held its whole load is a fact, not a cause.
    verdict.evidence.extend(causes::full_without_pressure(&f));
    // Where nothing failed yet, the runway of the most likely growth comes
    // first: how long is left matters more than how it was measured.
    if let Some(line) = causes
        .iter()
        .filter(|_| !verdict.failed)
        .flat_map(|c| c.evidence.iter())
        .find(|l| l.starts_with(RUNWAY_PREFIX))
    {
        verdict.evidence.insert(0, line.clone());
    }
    let fixes = if verdict.failed || !causes.is_empty() {
        fixes::rank(&f, &verdict, &causes)
    } else {
        Vec::new()
    };
    let victim = victim(&f);
    let capacity = capacity::estimate(e, &f.timeline, f.failure.as_ref())
        .and_then(|c| serde_json::to_string(&c).ok())
        .unwrap_or_default();
    // The agent's name, as `incidents` and `--agent` use it; its id when it has none.
    let agent = e
        .hello
        .as_ref()
        .map(|h| h.name.clone())
        .filter(|n| !n.is_empty())
        .or_else(|| e.incident.as_ref().map(|i| i.agent.clone()))
        .filter(|a| !a.is_empty())
        .or_else(|| {
            e.hello
                .as_ref()
                .map(|h| h.agent_id.clone())
                .filter(|a| !a.is_empty())
        });
    pb::Diagnosis {
        incident: e
            .incident
            .as_ref()
            .map(|i| i.id.clone())
            .filter(|i| !i.is_empty()),
        agent,
        domain: (verdict.failed && !startup).then(|| verdict.domain.as_str().to_string()),
        trigger: trigger.map(|(t, _)| t.as_str().to_string()),
        causes,
        fixes,
        capacity,
        evidence: verdict.evidence,
        // What ended the instance: the main process's end, also when the
        // failure took another process (that one's is the victim's).
        exit: main_exit(&f).map(|x| pb::ExitStatus {
            code: x.exit_code,
            signal: x.signal,
        }),
        cgroup: verdict.cgroup,
        failure: failure::of_incident(e),
        victim,
        // A kill only counted by its cgroup (`oomscope node` without the
        // kernel's log) has no report of the kernel's to show.
        kernel_report: f
            .kernel
            .filter(|(_, k)| !k.counted_only)
            .map(|(_, k)| kernel_report(k)),
        device: verdict.device,
    }
}

/// The kernel's figures at its OOM kill, as its record gives them.
fn kernel_report(k: &pb::KernelOomKill) -> pb::KernelReport {
    pb::KernelReport {
        pid: k.pid,
        command: k.task.clone(),
        anon_rss_bytes: k.anon_rss_bytes,
        file_rss_bytes: k.file_rss_bytes,
        shmem_rss_bytes: k.shmem_rss_bytes,
        total_vm_bytes: k.total_vm_bytes,
        constraint: k.constraint.clone(),
        oom_memcg: k.oom_memcg.clone(),
        task_memcg: k.task_memcg.clone(),
        memcg_usage_bytes: k.memcg_usage_bytes,
        memcg_limit_bytes: k.memcg_limit_bytes,
        oom_score_adj: k.oom_score_adj,
        order: k.order,
        nodemask: k.nodemask.clone(),
        mems_allowed: k.mems_allowed.clone(),
        cpuset: k.cpuset.clone(),
    }
}

/// The process the failure took: the kernel's OOM victim, else the child
/// that died, else the agent's own process (a device OOM inside it, a lost
/// agent). None when nothing died or failed (a clean exit, a stop, a
/// slowdown, even one the verdict names as thrash). Its command and title
/// come from the supervised tree, the process list, the child's start or the
/// Hello, whichever knew the pid.
fn victim(f: &Findings) -> Option<pb::Victim> {
    let e = f.evidence;
    if !f.failed {
        return None;
    }
    let hello = e.hello.clone().unwrap_or_default();
    let (pid, title) = match (f.kernel, f.exit) {
        (Some((_, k)), _) => (k.pid, k.task.clone()),
        (None, Some((_, x))) => (x.pid, x.title.clone()),
        (None, None) => (hello.pid, hello.title.clone()),
    };
    if pid == 0 {
        return None;
    }
    let seen: Vec<&pb::ProcessInfo> = e
        .samples
        .iter()
        .rev()
        .flat_map(|s| s.tree.iter())
        .chain(
            e.process_list()
                .into_iter()
                .flat_map(|l| l.host_top_rss.iter()),
        )
        .filter(|p| p.pid == pid)
        .collect();
    let known = seen.first().copied();
    // The newest command line read while it lived: read as it died, a
    // process has no command line left and the agent wrote `[comm]`.
    let lived = seen
        .iter()
        .map(|p| p.command.as_str())
        .find(|c| !c.is_empty() && !is_placeholder(c));
    let member_command = f
        .exit
        .filter(|(_, x)| x.member && x.pid == pid && !x.command.is_empty())
        .map(|(_, x)| x.command.clone());
    let command = lived
        .map(str::to_string)
        .or(member_command)
        .or_else(|| {
            e.child_start(pid)
                .map(|s| s.command.join(" "))
                .filter(|c| !c.is_empty())
        })
        .or_else(|| known.map(|p| p.command.clone()))
        .unwrap_or_default();
    let title = Some(title)
        .filter(|t| !t.is_empty())
        .or_else(|| known.map(|p| p.title.clone()).filter(|t| !t.is_empty()))
        .or_else(|| (pid == hello.pid).then(|| hello.title.clone()))
        .unwrap_or_default();
    let status = f
        .evidence
        .events
        .iter()
        .find_map(|ev| match &ev.kind {
            Some(pb::event::Kind::ChildExit(x)) if x.member && x.pid == pid => Some(x),
            _ => None,
        })
        .map(|x| pb::ExitStatus {
            code: x.exit_code,
            signal: x.signal,
        });
    Some(pb::Victim {
        pid,
        command,
        title,
        status,
    })
}

/// `[python3]`: what the agent writes for a process whose command line it
/// could not read (gone, or a kernel thread).
fn is_placeholder(command: &str) -> bool {
    command.starts_with('[') && command.ends_with(']')
}

/// The end of the instance's main process: the death's own where it is
/// the main process's, else the main process's end after the death.
fn main_exit<'a>(f: &Findings<'a>) -> Option<&'a pb::ChildExit> {
    let (t, x) = f.exit?;
    if !x.member {
        return Some(x);
    }
    f.evidence.main_exit_after(t).map(|(_, m)| m)
}
