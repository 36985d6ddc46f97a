//! Which stored messages are incidents, and recording them.
//!
//! An incident is a moment worth a diagnosis: an allocator OOM, a child killed
//! by a signal, a failed exit whose stderr speaks of memory, a crash loop, or
//! an agent that went silent without a Goodbye. A clean exit is not one.

use anyhow::Result;

use oomscope_analysis::error_line::error_line;
use oomscope_analysis::units::{bytes_short as bytes, clip, signal_name};
use oomscope_analysis::{enospc_on_full_shm, is_oom_text, STARTUP_WINDOW_NS};

use crate::correlate;
use crate::fleet::{self, nanos, FleetPolicy};
use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::event::Kind as EventKind;
use crate::store::{now_ns, Store};
use crate::verdict;

use oomscope_proto::IncidentKind;

/// The incident a message raises, if any, without agent or domain filled in.
/// One incident per event: a crash loop's last exit is reported as the crash
/// loop (its summary still names the signal or exit code).
pub fn detect(msg: &pb::AgentMessage) -> Option<pb::Incident> {
    let Some(Body::Event(event)) = &msg.body else {
        return None;
    };
    let (kind, summary) = match event.kind.as_ref()? {
        EventKind::Oom(oom) => (IncidentKind::Oom, oom_summary(oom)),
        // A task memory.oom.group took with the victim: the victim's record
        // is the incident; this one is its evidence.
        EventKind::KernelOomKill(k) if !k.oom_group.is_empty() => return None,
        EventKind::KernelOomKill(k) => (IncidentKind::KernelOomKill, kernel_kill_summary(k)),
        // A stop `oomscope run` passed on is not a failure; a kernel kill
        // during it has its own record, and so its own incident.
        EventKind::ChildExit(exit) if exit.stop_signal.is_some() && !exit.crash_loop => {
            return None
        }
        // Another process of the tree: a kill or a failed exit is a death
        // of the instance whatever the main process does next (its exit 0
        // after its engine died is a consequence, not a clean stop). A stop
        // signal is how servers stop their own workers: no failure.
        EventKind::ChildExit(exit) if exit.member => {
            let kind = match (exit.signal, exit.exit_code) {
                (Some(sig), _) if !correlate::STOP_SIGNALS.contains(&sig) => {
                    IncidentKind::MemberDied
                }
                (None, Some(code)) if code != 0 => IncidentKind::MemberFailed,
                _ => return None,
            };
            (kind, exit_summary(exit))
        }
        EventKind::ChildExit(exit) => {
            let how = exit_summary(exit);
            if exit.crash_loop {
                let said = error_line(&exit.stderr_tail)
                    .map(|l| format!("; stderr: {}", clip(&l, 160)))
                    .unwrap_or_default();
                (
                    IncidentKind::CrashLoop,
                    format!(
                        "gave up restarting after attempt {}: {how}{said}",
                        exit.attempt
                    ),
                )
            } else if exit.signal.is_some() {
                (IncidentKind::Signal, how)
            } else if exit.exit_code.unwrap_or(0) != 0 {
                match oom_line(&exit.stderr_tail)
                    .map(str::to_string)
                    .or_else(|| shm_enospc_line(exit))
                {
                    Some(line) => (
                        IncidentKind::ExitOomText,
                        format!("{how}; stderr: {}", clip(&line, 160)),
                    ),
                    // A plain failed exit long after the start is no memory
                    // incident; while starting it is one start that failed.
                    None if started_just_now(exit) => {
                        let said = error_line(&exit.stderr_tail)
                            .map(|l| format!("; stderr: {}", clip(&l, 160)))
                            .unwrap_or_default();
                        (
                            IncidentKind::FailedStart,
                            format!("{how}, while starting{said}"),
                        )
                    }
                    None => return None,
                }
            } else {
                return None;
            }
        }
        _ => return None,
    };
    Some(pb::Incident {
        kind: kind.to_string(),
        time_ns: event.time_ns,
        summary,
        seq: msg.seq,
        ..Default::default()
    })
}

/// Records the incidents that `messages` (just stored for `agent_id`) raise.
/// Runs on duplicates too, so that a crash between storing a message and
/// recording its incident heals when the agent resends it; the store keeps
/// one incident per (agent, seq, kind). Returns the newly recorded ones.
pub fn record(
    store: &mut Store,
    agent_id: &str,
    messages: &[pb::AgentMessage],
) -> Result<Vec<pb::Incident>> {
    let mut recorded = Vec::new();
    for msg in messages {
        let Some(mut incident) = detect(msg) else {
            continue;
        };
        if store.has_incident(agent_id, incident.seq, &incident.kind)? {
            continue;
        }
        if (incident.kind == IncidentKind::MemberDied
            || incident.kind == IncidentKind::MemberFailed)
            && correlate::instance_stopping(store, agent_id, incident.time_ns)?
        {
            tracing::info!(
                agent_id,
                "{}: the instance was already stopping",
                incident.summary
            );
            continue;
        }
        incident.agent_id = agent_id.to_string();
        incident.domain = attribute_domain(store, agent_id, &incident);
        recorded.extend(file(store, &incident)?);
    }
    Ok(recorded)
}

/// Stores `incident` and correlates it (see `correlate`): Some when it is an
/// incident of its own, None when it was a duplicate or merged into another.
fn file(store: &mut Store, incident: &pb::Incident) -> Result<Option<pb::Incident>> {
    match store.insert_incident(incident)? {
        Some(stored) => correlate::settle(store, stored),
        None => Ok(None),
    }
}

/// Records that `agent_id`'s stream broke at `broke_at_ns` and it did not
/// come back within `grace`. Its samples stay: they are the evidence.
pub fn record_lost(
    store: &mut Store,
    agent_id: &str,
    broke_at_ns: i64,
    grace: std::time::Duration,
) -> Result<Option<pb::Incident>> {
    // `oomscope probe` observes an instance: its stream's end is no death
    // (and so never one of a mass disconnect's agents either).
    if store
        .hello(agent_id)?
        .is_some_and(|h| h.role == oomscope_proto::Role::Probe)
    {
        store.set_state(agent_id, "ended", now_ns())?;
        tracing::info!(agent_id, "a probe's stream ended: not lost");
        return Ok(None);
    }
    if correlate::ended_with_instance(store, agent_id, broke_at_ns)? {
        store.set_state(agent_id, "ended", now_ns())?;
        tracing::info!(agent_id, "ended with its instance's clean stop: not lost");
        return Ok(None);
    }
    insert_lost(store, agent_id, broke_at_ns, |name| {
        format!(
            "agent {name:?} ({agent_id}) stopped streaming without a Goodbye and did not reconnect within {:.1} s",
            grace.as_secs_f64()
        )
    })
}

/// An agent_lost incident at `time_ns`, its domain named from the history.
fn insert_lost(
    store: &mut Store,
    agent_id: &str,
    time_ns: i64,
    summary: impl FnOnce(&str) -> String,
) -> Result<Option<pb::Incident>> {
    let name = store.hello(agent_id)?.map(|h| h.name).unwrap_or_default();
    let mut incident = pb::Incident {
        agent_id: agent_id.to_string(),
        summary: summary(&name),
        agent_name: name,
        kind: IncidentKind::AgentLost.to_string(),
        time_ns,
        seq: 0,
        ..Default::default()
    };
    incident.domain = attribute_domain(store, agent_id, &incident);
    file(store, &incident)
}

/// After another process delivered a dead agent's spool (a `recovery`
/// stream): the agent died without a Goodbye, so it gets an agent_lost
/// incident at its last evidence, unless it already has one, whose domain is
/// then named again with the evidence that just arrived. Nothing for an
/// agent whose spool held its Goodbye (it exited cleanly).
pub fn record_recovered(store: &mut Store, agent_id: &str) -> Result<Option<pb::Incident>> {
    // It said Goodbye (its evidence complete or not): no death to record.
    if matches!(
        store.state(agent_id)?.as_deref(),
        Some("disconnected" | oomscope_proto::EVIDENCE_INCOMPLETE_STATE)
    ) {
        return Ok(None);
    }
    let known = store.incidents(Some(agent_id))?;
    let lost: Vec<_> = known
        .iter()
        .filter(|i| i.kind == IncidentKind::AgentLost)
        .collect();
    if !lost.is_empty() {
        for incident in lost {
            let domain = attribute_domain(store, agent_id, incident);
            if domain != incident.domain {
                store.set_incident_domain(&incident.id, &domain)?;
            }
        }
        return Ok(None);
    }
    let died_by = store.last_message_time(agent_id)?.unwrap_or_else(now_ns);
    store.set_state(agent_id, "lost", now_ns())?;
    insert_lost(store, agent_id, died_by, |name| {
        format!(
            "agent {name:?} ({agent_id}) died without a Goodbye; another agent on its host delivered what it had left unsent"
        )
    })
}

/// How much history before an incident the ingest path reads to name its
/// domain. The domain rests on the failure itself and the counters around it,
/// so the recent window is enough, and it keeps the ingest path
/// (which acks only after this) from reading days of samples of a long-lived
/// agent. `oomscope diagnose` still reads everything.
pub const INGEST_EVIDENCE_WINDOW_NS: i64 = 10 * 60 * 1_000_000_000;

/// The memory domain the analysis blames for `incident`, from the agent's
/// recent history; "" when the history cannot be read.
fn attribute_domain(store: &Store, agent_id: &str, incident: &pb::Incident) -> String {
    let from = incident.time_ns.saturating_sub(INGEST_EVIDENCE_WINDOW_NS);
    let history = match store.history(agent_id, from, incident.time_ns) {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(
                agent_id,
                "no domain for the incident: reading its history failed: {e:#}"
            );
            return String::new();
        }
    };
    let evidence = history.into_evidence(Some(verdict::incident_ref(incident)));
    verdict::attribute_domain(&evidence)
}

fn oom_summary(oom: &pb::Oom) -> String {
    let mut s = format!(
        "allocation of {} failed on device {}",
        bytes(oom.requested_bytes),
        oom.device
    );
    if !oom.error_type.is_empty() {
        s.push_str(&format!(" ({})", oom.error_type));
    }
    if let Some(stats) = &oom.stats {
        s.push_str(&format!(
            ": {} allocated, {} reserved",
            bytes(stats.allocated_bytes),
            bytes(stats.reserved_bytes)
        ));
    }
    s
}

fn kernel_kill_summary(k: &pb::KernelOomKill) -> String {
    let scope = match k.constraint.as_str() {
        "CONSTRAINT_MEMCG" => format!("the memory cgroup {} at its limit", k.oom_memcg),
        "CONSTRAINT_NONE" => "the whole machine out of memory".to_string(),
        "CONSTRAINT_CPUSET" => format!(
            "NUMA node(s) {} of cpuset {} out of memory",
            k.mems_allowed, k.cpuset
        ),
        "CONSTRAINT_MEMORY_POLICY" => {
            format!(
                "NUMA node(s) {} of its memory policy out of memory",
                k.nodemask
            )
        }
        other => other.to_string(),
    };
    if k.counted_only {
        return format!(
            "{} {scope} (the kernel's record of it was not read)",
            correlate::COUNTED_KILL_SUMMARY
        );
    }
    format!(
        "the kernel's OOM killer took pid {} ({}): {scope}; anon-rss {}",
        k.pid,
        k.task,
        bytes(k.anon_rss_bytes)
    )
}

/// "child pid 7 killed by signal 9 (SIGKILL) after 1.2 s", or for another
/// process of the tree "member pid 8 (VLLM::Worker) of the instance ...".
fn exit_summary(exit: &pb::ChildExit) -> String {
    let how = match (exit.signal, exit.exit_code) {
        (Some(sig), _) => format!("killed by signal {sig} ({})", signal_name(sig)),
        (None, Some(code)) => format!("exited with code {code}"),
        (None, None) => "ended (no status)".to_string(),
    };
    let who = match (exit.member, exit.title.is_empty()) {
        (false, _) => format!("child pid {}", exit.pid),
        (true, true) => format!("member pid {} of the instance", exit.pid),
        (true, false) => format!("member pid {} ({}) of the instance", exit.pid, exit.title),
    };
    format!(
        "{who} {how}{} after {:.1} s",
        if exit.core_dumped {
            " (core dumped)"
        } else {
            ""
        },
        exit.runtime_ns as f64 / 1e9
    )
}

/// The exit came within the start-up window of the child's start.
fn started_just_now(exit: &pb::ChildExit) -> bool {
    exit.runtime_ns > 0 && exit.runtime_ns <= STARTUP_WINDOW_NS as u64
}

/// The last stderr line that speaks of running out of memory.
fn oom_line(stderr_tail: &str) -> Option<&str> {
    stderr_tail
        .lines()
        .rev()
        .find(|l| is_oom_text(l))
        .map(str::trim)
}

/// A bare ENOSPC ("No space left on device", no path) while /dev/shm was
/// full at the exit's readings: a write to /dev/shm that found no room.
fn shm_enospc_line(exit: &pb::ChildExit) -> Option<String> {
    let (used, total) = [&exit.before, &exit.after]
        .into_iter()
        .flatten()
        .filter_map(|c| c.system.as_ref())
        .map(|s| (s.shm_used_bytes, s.shm_total_bytes))
        .max_by_key(|&(u, _)| u)?;
    enospc_on_full_shm(&exit.stderr_tail, used, total).map(|m| m.line)
}

/// Checks the fleet-level patterns for the service (agent name) of
/// `agent_id` after something happened to it at `now_ns`, and records a
/// crash loop or a restart storm once per window. The evidence lines go into
/// the incident's summary, which is all an incident row carries.
pub fn check_fleet(
    store: &mut Store,
    agent_id: &str,
    policy: &FleetPolicy,
    now_ns: i64,
) -> Result<Vec<pb::Incident>> {
    let Some(name) = store
        .hello(agent_id)?
        .map(|h| h.name)
        .filter(|n| !n.is_empty())
    else {
        return Ok(Vec::new());
    };
    let mut recorded = Vec::new();
    let loop_since = now_ns.saturating_sub(nanos(policy.crash_loop_window));
    if !store.has_incident_of_name(&name, IncidentKind::CrashLoop.as_str(), loop_since)? {
        let deaths = store.deaths_of(&name, loop_since)?;
        if let Some(f) = fleet::crash_loop(&name, &deaths, policy) {
            recorded.extend(record_finding(
                store,
                agent_id,
                &name,
                IncidentKind::CrashLoop,
                f,
            )?);
        }
    }
    let storm_since = now_ns
        .saturating_sub(nanos(policy.storm_window).saturating_add(nanos(policy.burst_window)));
    if !store.has_incident_of_name(&name, IncidentKind::RestartStorm.as_str(), storm_since)? {
        let starts = store.starts_of(&name, storm_since)?;
        if starts.len() >= policy.storm_instances {
            let from = starts[0]
                .time_ns
                .saturating_sub(nanos(policy.baseline_window));
            let requests = store.request_starts_of(&name, from, now_ns.saturating_add(1))?;
            if let Some(f) = fleet::restart_storm(&name, &starts, &requests, policy) {
                recorded.extend(record_finding(
                    store,
                    agent_id,
                    &name,
                    IncidentKind::RestartStorm,
                    f,
                )?);
            }
        }
    }
    Ok(recorded)
}

fn record_finding(
    store: &mut Store,
    agent_id: &str,
    name: &str,
    kind: IncidentKind,
    f: fleet::Finding,
) -> Result<Option<pb::Incident>> {
    let incident = pb::Incident {
        agent_id: agent_id.to_string(),
        agent_name: name.to_string(),
        kind: kind.to_string(),
        time_ns: f.time_ns,
        summary: format!("{}: {}", f.summary, f.evidence.join("; ")),
        seq: 0,
        ..Default::default()
    };
    file(store, &incident)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit_event(seq: u64, exit: pb::ChildExit) -> pb::AgentMessage {
        pb::AgentMessage {
            seq,
            body: Some(Body::Event(pb::Event {
                time_ns: 42,
                kind: Some(EventKind::ChildExit(exit)),
            })),
        }
    }

    #[test]
    fn exits_are_classified() {
        let killed = detect(&exit_event(
            3,
            pb::ChildExit {
                signal: Some(9),
                ..Default::default()
            },
        ))
        .unwrap();
        assert_eq!(
            (killed.kind.as_str(), killed.seq, killed.time_ns),
            (IncidentKind::Signal.as_str(), 3, 42)
        );
        assert!(
            killed.summary.contains("signal 9 (SIGKILL)"),
            "{}",
            killed.summary
        );

        let oom_text = detect(&exit_event(
            4,
            pb::ChildExit {
                exit_code: Some(1),
                stderr_tail: "loading\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB\n".into(),
                ..Default::default()
            },
        ))
        .unwrap();
        assert_eq!(oom_text.kind, IncidentKind::ExitOomText);
        assert!(
            oom_text.summary.contains("Tried to allocate 96.00 MiB"),
            "{}",
            oom_text.summary
        );

        // A plain failed exit long after its start is no incident; within
        // the start-up window it is a failed start, quoting its error line.
        let plain_failure = pb::ChildExit {
            exit_code: Some(1),
            stderr_tail: "Traceback (most recent call last):\n  File \"s.py\", line 1\nValueError: bad zoom room\nbye\n".into(),
            runtime_ns: 31_000_000_000,
            ..Default::default()
        };
        assert!(detect(&exit_event(5, plain_failure.clone())).is_none());
        let failed_start = detect(&exit_event(
            5,
            pb::ChildExit {
                runtime_ns: 2_500_000_000,
                ..plain_failure
            },
        ))
        .unwrap();
        assert_eq!(failed_start.kind, IncidentKind::FailedStart);
        assert!(
            failed_start.summary.ends_with(
                "exited with code 1 after 2.5 s, while starting; stderr: ValueError: bad zoom room"
            ),
            "{}",
            failed_start.summary
        );
        assert!(detect(&exit_event(
            6,
            pb::ChildExit {
                exit_code: Some(0),
                ..Default::default()
            }
        ))
        .is_none());

        let looped = pb::ChildExit {
            signal: Some(9),
            crash_loop: true,
            attempt: 3,
            ..Default::default()
        };
        let inc = detect(&exit_event(7, looped)).unwrap();
        assert_eq!(inc.kind, IncidentKind::CrashLoop);
        assert!(
            inc.summary.contains("attempt 3") && inc.summary.contains("signal 9"),
            "{}",
            inc.summary
        );
    }

    fn kill_event(k: pb::KernelOomKill) -> pb::AgentMessage {
        pb::AgentMessage {
            seq: 9,
            body: Some(Body::Event(pb::Event {
                time_ns: 42,
                kind: Some(EventKind::KernelOomKill(k)),
            })),
        }
    }

    #[test]
    fn a_numa_bound_kill_names_its_nodes_and_group_members_raise_none() {
        let numa = detect(&kill_event(pb::KernelOomKill {
            pid: 5120,
            task: "VLLM::Worker".into(),
            constraint: "CONSTRAINT_CPUSET".into(),
            cpuset: "numa0".into(),
            mems_allowed: "0".into(),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(numa.kind, IncidentKind::KernelOomKill);
        assert!(
            numa.summary
                .contains("NUMA node(s) 0 of cpuset numa0 out of memory"),
            "{}",
            numa.summary
        );
        let member = pb::KernelOomKill {
            pid: 312,
            constraint: "CONSTRAINT_MEMCG".into(),
            oom_group: "/kubepods.slice/pod".into(),
            ..Default::default()
        };
        assert!(detect(&kill_event(member.clone())).is_none());
        let victim = pb::KernelOomKill {
            oom_group: String::new(),
            ..member
        };
        assert!(detect(&kill_event(victim)).is_some());
    }

    #[test]
    fn duplicate_event_records_one_incident() {
        let mut store = Store::open_in_memory().unwrap();
        let hello = pb::Hello {
            agent_id: "a".into(),
            name: "svc".into(),
            ..Default::default()
        };
        store.upsert_agent(&hello, 1).unwrap();
        let oom = pb::AgentMessage {
            seq: 1,
            body: Some(Body::Event(pb::Event {
                time_ns: 10,
                kind: Some(EventKind::Oom(pb::Oom {
                    requested_bytes: 96 << 20,
                    ..Default::default()
                })),
            })),
        };
        store.insert_batch("a", std::slice::from_ref(&oom)).unwrap();
        let first = record(&mut store, "a", std::slice::from_ref(&oom)).unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].id, "inc-000001");
        assert_eq!(first[0].agent_name, "svc");
        assert!(
            first[0].summary.contains("96.0 MiB"),
            "{}",
            first[0].summary
        );
        assert!(record(&mut store, "a", &[oom]).unwrap().is_empty());
        assert_eq!(store.incidents(None).unwrap().len(), 1);
    }
}
