//! One failure, one incident. A multi-process server that loses a worker to
//! the kernel shows it several ways at once: the kernel's record of the kill
//! (seen by `oomscope run`), the worker's stream breaking (agent_lost), the
//! server exiting non-zero or by a signal. These are one incident, led by the
//! part with the strongest evidence. Likewise one crash loop is one incident,
//! many agents lost together are one mass disconnect, and an agent that ends
//! with its instance's clean stop is not lost at all.
//!
//! The rules are pure ([`strength`], [`Plan`]); `settle` and
//! `ended_with_instance` apply them to the store.

use anyhow::Result;

use crate::pb;
use crate::store::Store;
use oomscope_proto::{IncidentKind, Role};

/// Deaths of one instance this close together are one failure: a worker
/// killed, then the server noticing and exiting, takes seconds, plus the
/// lost-agent grace.
pub const CORRELATION_WINDOW_NS: i64 = 30 * 1_000_000_000;

/// Agents lost within this span of each other were lost together (a node
/// or network gone, a collector that came back without them).
pub const MASS_DISCONNECT_WINDOW_NS: i64 = 3 * 1_000_000_000;

/// At least this many agents lost together are one mass disconnect.
pub const MASS_DISCONNECT_AGENTS: usize = 3;

/// How the summary of a kernel OOM kill known only from its cgroup's
/// counter begins (`oomscope node` reports one when the kernel's record did
/// not come within its wait); the record, when it comes later, joins that
/// incident and its summary replaces this one.
pub const COUNTED_KILL_SUMMARY: &str = "an OOM kill counted by";

/// Whether `new`, merging into `leader`, brings the kernel's own record of
/// the kill that `leader` knew only from the counter: then its summary
/// (the victim, its anon-rss) becomes the leader's.
pub fn names_a_counted_kill(new: &pb::Incident, leader: &pb::Incident) -> bool {
    new.kind == IncidentKind::KernelOomKill
        && leader.kind == IncidentKind::KernelOomKill
        && leader.summary.starts_with(COUNTED_KILL_SUMMARY)
        && !new.summary.starts_with(COUNTED_KILL_SUMMARY)
}

/// How much an incident of `kind` says about the failure: the kernel's own
/// record first, a process killed by a signal, a failed exit with an OOM
/// text, then the crash loop and the streams that merely broke. Kinds that
/// are not deaths (an allocator OOM the process survived, a restart storm)
/// are not correlated: 0.
pub fn strength(kind: &str) -> u8 {
    match kind_of(kind) {
        Some(IncidentKind::KernelOomKill) => 5,
        Some(IncidentKind::Signal | IncidentKind::MemberDied) => 4,
        Some(IncidentKind::ExitOomText) => 3,
        // A member that gave up with a code says less than the text another
        // process printed about why (vLLM's engine exits 1, its API server
        // prints the KV cache's "Available memory ... less than requested").
        Some(IncidentKind::MemberFailed) => 2,
        // A start that failed on its own error: its crash loop (a pattern
        // of them) leads it, not strength (see `plan`).
        Some(IncidentKind::FailedStart) => 2,
        Some(IncidentKind::CrashLoop) => 2,
        Some(IncidentKind::MassDisconnect | IncidentKind::AgentLost) => 1,
        _ => 0,
    }
}

/// The kind an incident's name says; None for a name this build does not
/// know, which correlates with nothing.
fn kind_of(name: &str) -> Option<IncidentKind> {
    name.parse().ok()
}

/// What to do with a newly recorded incident, given the incidents it may
/// belong with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// It stands alone.
    Alone,
    /// It is part of `leader`.
    MergeInto { leader: String },
    /// It leads: these (earlier, weaker) merge into it.
    Lead { absorb: Vec<String> },
    /// It completes a mass disconnect: `leader` becomes one (its summary
    /// rewritten for `agents` agents) and the new one and `absorb` merge into it.
    MassDisconnect {
        leader: String,
        absorb: Vec<String>,
        agents: usize,
    },
}

/// The plan for `new` among `same_instance` (not merged, of the same
/// instance, within the correlation window) and `lost_nearby` (agent_lost
/// or mass_disconnect incidents of any instance within the mass-disconnect
/// window, `new` excluded).
pub fn plan(
    new: &pb::Incident,
    same_instance: &[pb::Incident],
    lost_nearby: &[pb::Incident],
) -> Plan {
    let s = strength(&new.kind);
    if s == 0 {
        return Plan::Alone;
    }
    let peers: Vec<&pb::Incident> = same_instance
        .iter()
        .filter(|i| i.id != new.id && strength(&i.kind) > 0)
        // A crash loop folds with crash loops and the failed starts it
        // counts; deaths with deaths.
        .filter(|i| match (kind_of(&new.kind), kind_of(&i.kind)) {
            (Some(IncidentKind::CrashLoop), k) => {
                matches!(k, Some(IncidentKind::CrashLoop | IncidentKind::FailedStart))
            }
            (Some(IncidentKind::FailedStart), Some(IncidentKind::CrashLoop)) => true,
            (_, k) => k != Some(IncidentKind::CrashLoop),
        })
        .collect();
    // One crash loop: the first leads; its failed starts are its parts,
    // before it or after.
    if matches!(
        kind_of(&new.kind),
        Some(IncidentKind::CrashLoop | IncidentKind::FailedStart)
    ) {
        if let Some(looped) = peers
            .iter()
            .filter(|i| i.kind == IncidentKind::CrashLoop)
            .min_by_key(|i| (i.time_ns, i.id.clone()))
        {
            return Plan::MergeInto {
                leader: looped.id.clone(),
            };
        }
        if new.kind == IncidentKind::CrashLoop {
            return Plan::Lead {
                absorb: peers.iter().map(|i| i.id.clone()).collect(),
            };
        }
    }
    if let Some(leader) = peers
        .iter()
        .max_by_key(|i| (strength(&i.kind), std::cmp::Reverse(i.time_ns)))
    {
        if strength(&leader.kind) >= s {
            return Plan::MergeInto {
                leader: leader.id.clone(),
            };
        }
        return Plan::Lead {
            absorb: peers.iter().map(|i| i.id.clone()).collect(),
        };
    }
    if new.kind == IncidentKind::AgentLost {
        if let Some(mass) = lost_nearby
            .iter()
            .find(|i| i.kind == IncidentKind::MassDisconnect)
        {
            return Plan::MergeInto {
                leader: mass.id.clone(),
            };
        }
        let lost: Vec<&pb::Incident> = lost_nearby
            .iter()
            .filter(|i| i.kind == IncidentKind::AgentLost)
            .collect();
        if lost.len() + 1 >= MASS_DISCONNECT_AGENTS {
            let first = lost
                .iter()
                .min_by_key(|i| (i.time_ns, i.id.clone()))
                .expect("non-empty");
            return Plan::MassDisconnect {
                leader: first.id.clone(),
                absorb: lost
                    .iter()
                    .filter(|i| i.id != first.id)
                    .map(|i| i.id.clone())
                    .collect(),
                agents: lost.len() + 1,
            };
        }
    }
    Plan::Alone
}

/// Correlates `new` (just stored) with what the store holds. Returns it when
/// it is an incident of its own (alone or leading), None when it merged into
/// another.
pub fn settle(store: &mut Store, new: pb::Incident) -> Result<Option<pb::Incident>> {
    match device_oom_plan(store, &new)? {
        Some(Plan::MergeInto { leader }) => {
            store.merge_incident(&new.id, &leader)?;
            tracing::info!(
                incident = new.id,
                leader,
                "one failure: merged into its incident"
            );
            return Ok(None);
        }
        Some(Plan::Lead { absorb }) => {
            for id in &absorb {
                store.merge_incident(id, &new.id)?;
            }
            return Ok(Some(new));
        }
        _ => {}
    }
    if strength(&new.kind) == 0 {
        return Ok(Some(new));
    }
    let instance = store.instance_of(&new.agent_id)?.unwrap_or_default();
    let same_instance = if instance.is_empty() {
        Vec::new()
    } else {
        store.incidents_of_instance(
            &instance,
            new.time_ns - CORRELATION_WINDOW_NS,
            new.time_ns + CORRELATION_WINDOW_NS,
        )?
    };
    // Deaths are one failure only within one run of the instance: a
    // supervisor's restarts are runs of their own, and each child's end
    // (a signal, a failed exit) closes its own run.
    let supervisor = match store.instance(&instance)? {
        Some(inst) => inst.supervisor().map(|m| m.agent_id.clone()),
        None => None,
    };
    let run_of = |t: i64| -> Result<Option<u64>> {
        match &supervisor {
            Some(sup) => store.run_of(sup, t),
            None => Ok(None),
        }
    };
    let new_run = run_of(new.time_ns)?;
    let mut same_run = Vec::new();
    for i in same_instance {
        let both_ends = ends_a_run(&i.kind) && ends_a_run(&new.kind);
        if !both_ends && run_of(i.time_ns)? == new_run {
            same_run.push(i);
        }
    }
    let mut same_instance = same_run;
    // One crash loop per service: the fleet's and the supervisor's own say
    // the same, and the failed starts in a row are its parts, whichever
    // `oomscope run` (its restarts, or separate calls) made them.
    let looped_with = match kind_of(&new.kind) {
        Some(IncidentKind::CrashLoop) => &[IncidentKind::CrashLoop, IncidentKind::FailedStart][..],
        Some(IncidentKind::FailedStart) => &[IncidentKind::CrashLoop][..],
        _ => &[][..],
    };
    for kind in looped_with {
        for i in store.incidents_of_kind(
            kind.as_str(),
            new.time_ns - CRASH_LOOP_FOLD_NS,
            new.time_ns + CORRELATION_WINDOW_NS,
        )? {
            let same_name = !new.agent_name.is_empty() && i.agent_name == new.agent_name;
            if same_name && i.id != new.id && !same_instance.iter().any(|s| s.id == i.id) {
                same_instance.push(i);
            }
        }
    }
    let mut lost_nearby = Vec::new();
    if new.kind == IncidentKind::AgentLost {
        // Lost together means alive together: a service's successive
        // restarts dying one after another are a crash loop, not this.
        let born = |agent: &str| store.first_seen(agent);
        let new_born = born(&new.agent_id)?.unwrap_or(i64::MIN);
        for kind in [IncidentKind::AgentLost, IncidentKind::MassDisconnect] {
            for i in store.incidents_of_kind(
                kind.as_str(),
                new.time_ns - MASS_DISCONNECT_WINDOW_NS,
                new.time_ns + MASS_DISCONNECT_WINDOW_NS,
            )? {
                let together =
                    new_born < i.time_ns && born(&i.agent_id)?.unwrap_or(i64::MIN) < new.time_ns;
                if i.id != new.id && together {
                    lost_nearby.push(i);
                }
            }
        }
    }
    match plan(&new, &same_instance, &lost_nearby) {
        Plan::Alone => Ok(Some(new)),
        Plan::MergeInto { leader } => {
            store.merge_incident(&new.id, &leader)?;
            if let Some(l) = store.incident(&leader)? {
                if l.kind == IncidentKind::MassDisconnect {
                    let n = store.merged_count(&leader)? + 1;
                    let kind = IncidentKind::MassDisconnect.as_str();
                    store.update_incident(&leader, kind, &mass_summary(n as usize))?;
                } else if names_a_counted_kill(&new, &l) {
                    store.update_incident(&leader, &l.kind, &new.summary)?;
                }
            }
            tracing::info!(
                incident = new.id,
                leader,
                "one failure: merged into its incident"
            );
            Ok(None)
        }
        Plan::Lead { absorb } => {
            for id in &absorb {
                store.merge_incident(id, &new.id)?;
            }
            Ok(Some(new))
        }
        Plan::MassDisconnect {
            leader,
            absorb,
            agents,
        } => {
            let kind = IncidentKind::MassDisconnect.as_str();
            store.update_incident(&leader, kind, &mass_summary(agents))?;
            for id in absorb.iter().chain(std::iter::once(&new.id)) {
                store.merge_incident(id, &leader)?;
            }
            Ok(None)
        }
    }
}

/// Incidents that follow a device OOM as its consequence: the exit with
/// its text, and a member (a GPU worker) that gave up with a code after
/// its OOM (`member_failed`); a member killed by a signal is a death of its
/// own (the kernel's or someone's), not this rule's.
const AFTER_DEVICE_OOM: [IncidentKind; 2] = [IncidentKind::ExitOomText, IncidentKind::MemberFailed];

/// One device failure, one incident: threads that outgrow a device
/// together fail within milliseconds of each other, and a server that
/// gives up on an OOM exits seconds later with its text (or its GPU worker
/// exits with a code, `member_failed`). Within [`CORRELATION_WINDOW_NS`],
/// for the same process or instance, the first device OOM (with the
/// allocator's state) leads: a later OOM or an incident of
/// [`AFTER_DEVICE_OOM`] merges into it, and an OOM stored after such an
/// incident (the agent's stream and the supervisor's arrive in any order)
/// takes it and any later OOMs in. None: the rule does not apply.
fn device_oom_plan(store: &Store, new: &pb::Incident) -> Result<Option<Plan>> {
    let new_kind = kind_of(&new.kind);
    let follows = new_kind.is_some_and(|k| AFTER_DEVICE_OOM.contains(&k));
    if new_kind != Some(IncidentKind::Oom) && !follows {
        return Ok(None);
    }
    let instance = store.instance_of(&new.agent_id)?.unwrap_or_default();
    let mut related = Vec::new();
    for kind in std::iter::once(IncidentKind::Oom).chain(AFTER_DEVICE_OOM) {
        for i in store.incidents_of_kind(
            kind.as_str(),
            new.time_ns - CORRELATION_WINDOW_NS,
            new.time_ns + CORRELATION_WINDOW_NS,
        )? {
            let same = i.agent_id == new.agent_id
                || (!instance.is_empty()
                    && store.instance_of(&i.agent_id)?.as_deref() == Some(instance.as_str()));
            if same && i.id != new.id {
                related.push(i);
            }
        }
    }
    let first_oom = related
        .iter()
        .filter(|i| i.kind == IncidentKind::Oom)
        .min_by_key(|i| (i.time_ns, i.id.clone()));
    let leads = |o: &pb::Incident| (o.time_ns, &o.id) < (new.time_ns, &new.id);
    if let Some(first) = first_oom.filter(|o| follows || leads(o)) {
        return Ok(Some(Plan::MergeInto {
            leader: first.id.clone(),
        }));
    }
    if new_kind != Some(IncidentKind::Oom) {
        return Ok(None);
    }
    let absorb: Vec<String> = related.into_iter().map(|i| i.id).collect();
    Ok((!absorb.is_empty()).then_some(Plan::Lead { absorb }))
}

/// Incidents raised by a child's end (`ChildExit`): each closes a run.
fn ends_a_run(kind: &str) -> bool {
    matches!(
        kind_of(kind),
        Some(IncidentKind::Signal | IncidentKind::ExitOomText | IncidentKind::FailedStart)
    )
}

/// How far back a crash loop gathers the crash loops and failed starts of
/// its service: longer than the fleet's crash-loop window (5 min by default).
pub const CRASH_LOOP_FOLD_NS: i64 = 10 * 60 * 1_000_000_000;

fn mass_summary(agents: usize) -> String {
    format!(
        "{agents} agents stopped streaming within {} s of each other without a Goodbye \
         (a host or the network gone, or a collector that came back without them): one incident, not {agents}",
        MASS_DISCONNECT_WINDOW_NS / 1_000_000_000
    )
}

/// A member's stream that broke this soon after the instance began to stop
/// (or even this much before it, as clocks and stream teardown go) ended
/// with it.
pub const STOP_SLACK_NS: i64 = 1_000_000_000;

/// Whether `agent_id`, whose stream broke at `broke_at_ns`, ended with its
/// instance rather than died: the instance had begun to stop by then (the
/// supervisor passed a stop signal on, its child had ended cleanly, or the
/// founding process had said a clean Goodbye), or the supervisor saw this
/// member's own process end cleanly. A member that died first is a death
/// whatever the main process did afterwards: its exit 0 is a consequence.
pub fn ended_with_instance(store: &Store, agent_id: &str, broke_at_ns: i64) -> Result<bool> {
    let Some(instance) = store.instance_of(agent_id)? else {
        return Ok(false);
    };
    let Some(inst) = store.instance(&instance)? else {
        return Ok(false);
    };
    let own_pid = store.hello(agent_id)?.map(|h| h.pid);
    for m in inst.members.iter().filter(|m| m.agent_id != agent_id) {
        if m.role == Role::Supervisor {
            let stopping = instance_stopping(
                store,
                &m.agent_id,
                broke_at_ns.saturating_add(STOP_SLACK_NS),
            )?;
            let ended_cleanly = store
                .child_exits(&m.agent_id)?
                .iter()
                .any(|(_, x)| x.member && Some(x.pid) == own_pid && is_clean_end(x));
            if stopping || ended_cleanly {
                return Ok(true);
            }
        } else if m.agent_id == instance {
            if let Some((t, bye)) = store.latest_goodbye(&m.agent_id)? {
                if t <= broke_at_ns.saturating_add(STOP_SLACK_NS) && bye.exit_code == 0 {
                    return Ok(true);
                }
            }
        }
    }
    Ok(false)
}

/// Stop signals (SIGHUP, SIGINT, SIGTERM): how a server stops its workers;
/// and SIGPIPE, a pipe whose reader went first. A process of the tree ended
/// by one did not fail.
pub const STOP_SIGNALS: [i32; 4] = [1, 2, 13, 15];

/// Whether `supervisor`'s instance had begun to stop by `time_ns`: it had
/// passed a stop signal on, or its child had ended cleanly (the supervisor
/// restarts nothing after either). A process of the tree that dies after
/// that ends with the instance.
pub fn instance_stopping(store: &Store, supervisor: &str, time_ns: i64) -> Result<bool> {
    if store
        .latest_stop_forwarded(supervisor)?
        .is_some_and(|t| t <= time_ns)
    {
        return Ok(true);
    }
    Ok(store
        .child_exits(supervisor)?
        .iter()
        .any(|(t, x)| !x.member && *t <= time_ns && is_clean_end(x)))
}

/// A child's end that is not a failure: it exited 0, or it ended after a
/// stop signal that `oomscope run` passed on (or, for another process of
/// the tree, by a stop signal).
pub fn is_clean_end(exit: &pb::ChildExit) -> bool {
    let stopped_by_signal = exit.member && exit.signal.is_some_and(|s| STOP_SIGNALS.contains(&s));
    !exit.crash_loop
        && (exit.exit_code == Some(0) || exit.stop_signal.is_some() || stopped_by_signal)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inc(id: &str, kind: IncidentKind, t: i64) -> pb::Incident {
        pb::Incident {
            id: id.into(),
            kind: kind.to_string(),
            time_ns: t,
            ..Default::default()
        }
    }

    #[test]
    fn a_weaker_death_merges_into_the_kernel_kill_and_a_stronger_one_leads() {
        let kill = inc("i1", IncidentKind::KernelOomKill, 10);
        let lost = inc("i2", IncidentKind::AgentLost, 12);
        assert_eq!(
            plan(&lost, std::slice::from_ref(&kill), &[]),
            Plan::MergeInto {
                leader: "i1".into()
            }
        );
        // The worker's stream broke first; the kernel's record came after.
        assert_eq!(
            plan(&kill, std::slice::from_ref(&lost), &[]),
            Plan::Lead {
                absorb: vec!["i2".into()]
            }
        );
    }

    #[test]
    fn an_allocator_oom_and_a_restart_storm_stand_alone() {
        let kill = inc("i1", IncidentKind::KernelOomKill, 10);
        assert_eq!(
            plan(
                &inc("i2", IncidentKind::Oom, 11),
                std::slice::from_ref(&kill),
                &[]
            ),
            Plan::Alone
        );
        assert_eq!(
            plan(&inc("i3", IncidentKind::RestartStorm, 11), &[kill], &[]),
            Plan::Alone
        );
    }

    #[test]
    fn crash_loops_fold_with_crash_loops_only() {
        let looped = inc("i1", IncidentKind::CrashLoop, 10);
        assert_eq!(
            plan(
                &inc("i2", IncidentKind::CrashLoop, 11),
                std::slice::from_ref(&looped),
                &[]
            ),
            Plan::MergeInto {
                leader: "i1".into()
            }
        );
        assert_eq!(
            plan(&inc("i3", IncidentKind::AgentLost, 11), &[looped], &[]),
            Plan::Alone
        );
    }

    #[test]
    fn a_crash_loop_leads_its_failed_starts_and_later_ones_join_it() {
        let starts = [
            inc("i1", IncidentKind::FailedStart, 10),
            inc("i2", IncidentKind::FailedStart, 20),
        ];
        assert_eq!(
            plan(&inc("i3", IncidentKind::CrashLoop, 30), &starts, &[]),
            Plan::Lead {
                absorb: vec!["i1".into(), "i2".into()]
            }
        );
        let looped = inc("i3", IncidentKind::CrashLoop, 30);
        assert_eq!(
            plan(
                &inc("i4", IncidentKind::FailedStart, 40),
                std::slice::from_ref(&looped),
                &[]
            ),
            Plan::MergeInto {
                leader: "i3".into()
            }
        );
        // A second crash loop of the service folds into the first, even
        // beside failed starts not yet absorbed.
        assert_eq!(
            plan(
                &inc("i5", IncidentKind::CrashLoop, 50),
                &[looped, starts[0].clone()],
                &[]
            ),
            Plan::MergeInto {
                leader: "i3".into()
            }
        );
        // Failed starts alone are separate deaths until they loop.
        assert_eq!(
            plan(&inc("i6", IncidentKind::FailedStart, 60), &[], &[]),
            Plan::Alone
        );
    }

    #[test]
    fn the_third_agent_lost_together_makes_a_mass_disconnect() {
        let a = inc("i1", IncidentKind::AgentLost, 10);
        let b = inc("i2", IncidentKind::AgentLost, 11);
        assert_eq!(plan(&b, &[], std::slice::from_ref(&a)), Plan::Alone);
        let c = inc("i3", IncidentKind::AgentLost, 12);
        assert_eq!(
            plan(&c, &[], &[a.clone(), b.clone()]),
            Plan::MassDisconnect {
                leader: "i1".into(),
                absorb: vec!["i2".into()],
                agents: 3
            }
        );
        let mass = inc("i1", IncidentKind::MassDisconnect, 10);
        assert_eq!(
            plan(&inc("i4", IncidentKind::AgentLost, 12), &[], &[mass]),
            Plan::MergeInto {
                leader: "i1".into()
            }
        );
    }

    #[test]
    fn a_stop_is_a_clean_end_and_a_crash_loop_is_not() {
        let stop = pb::ChildExit {
            signal: Some(15),
            stop_signal: Some(15),
            ..Default::default()
        };
        assert!(is_clean_end(&stop));
        assert!(is_clean_end(&pb::ChildExit {
            exit_code: Some(0),
            ..Default::default()
        }));
        assert!(!is_clean_end(&pb::ChildExit {
            exit_code: Some(1),
            ..Default::default()
        }));
        assert!(!is_clean_end(&pb::ChildExit {
            exit_code: Some(0),
            crash_loop: true,
            ..Default::default()
        }));
    }
}
