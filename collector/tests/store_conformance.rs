//! One conformance suite, run on both store backends: the embedded SQLite
//! file and a PostgreSQL cluster of the test's own (testkit/src/postgres.rs;
//! a test fails, not skips, when it cannot start). Ingest, dedup, incidents
//! and queries go over real gRPC on loopback; token binding, state and
//! retention through the store interface itself.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use oomscope_collector::ingest::Collector;
use oomscope_collector::pb;
use oomscope_collector::pb::collector_message::Body as Reply;
use oomscope_collector::store::{now_ns, Backend, PgStore, Store};
use oomscope_testkit::postgres::PgCluster;
use support::*;

const NS_PER_DAY: i64 = 86_400 * 1_000_000_000;

/// A store of either engine, with what keeps it alive.
struct Engine {
    _dir: tempfile::TempDir,
    pg: Option<PgCluster>,
    /// The store the collector writes.
    collector: Collector,
    /// A second handle on the same store, for the test's own reads.
    check: Arc<dyn Backend>,
}

impl Engine {
    fn sqlite() -> Engine {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("c.db");
        let collector = Collector::new(Store::open(&db).unwrap(), Duration::from_secs(5));
        let check: Arc<dyn Backend> = Arc::new(parking_lot::Mutex::new(Store::open(&db).unwrap()));
        Engine {
            _dir: dir,
            pg: None,
            collector,
            check,
        }
    }

    fn postgres() -> Engine {
        let pg = PgCluster::start().expect("a PostgreSQL cluster for the test");
        let shared = PgStore::connect(pg.url(), 4).expect("connect to the test's PostgreSQL");
        let collector = Collector::new(Store::open_in_memory().unwrap(), Duration::from_secs(5))
            .with_shared_store(Arc::new(shared));
        let check: Arc<dyn Backend> = Arc::new(PgStore::connect(pg.url(), 2).unwrap());
        Engine {
            _dir: tempfile::tempdir().unwrap(),
            pg: Some(pg),
            collector,
            check,
        }
    }

    async fn serve(&self) -> Running {
        serving(self._dir.path(), self.collector.clone()).await
    }
}

/// Runs one async check on each engine.
macro_rules! on_both_engines {
    ($($check:ident),* $(,)?) => {$(
        mod $check {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$check(super::Engine::sqlite()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$check(super::Engine::postgres()).await
            }
        }
    )*};
}

on_both_engines!(
    ingest_is_acked_once_stored_and_listed,
    an_equal_resend_is_a_duplicate_and_a_different_one_is_refused,
    an_event_resent_on_a_new_stream_raises_one_incident,
    a_goodbye_is_listed_with_its_state,
    agent_ids_stay_with_their_first_token,
    retention_removes_old_messages_and_incidents_and_keeps_young_ones,
    agents_and_incidents_are_filtered_by_the_store,
    an_instance_is_queried_whole_with_its_merged_incident,
    a_thinned_timeline_folds_every_drop_statement,
);

/// Collector clock now: test messages carry today's times, so PostgreSQL
/// stores them in today's partition.
fn t0() -> i64 {
    now_ns() - 60_000_000_000
}

fn seqs(range: std::ops::RangeInclusive<u64>) -> BTreeSet<u64> {
    range.collect()
}

async fn ingest_is_acked_once_stored_and_listed(engine: Engine) {
    let run = engine.serve().await;
    let t0 = t0();
    let mut agent = run.agent(hello("agent-1", "llama-server")).await;
    for seq in 1..=20u64 {
        agent.send(sample(seq, t0 + seq as i64 * 1_000_000)).await;
    }
    agent.send(oom(21, t0 + 21_000_000)).await;
    let check = engine.check.clone();
    agent
        .acks_covering(&seqs(1..=21), |ack| {
            // When an ack arrives, another connection already counts it.
            let stored = check.message_count("agent-1").unwrap();
            assert!(stored >= ack.to_seq, "acked {ack:?} with {stored} stored");
        })
        .await;
    assert_eq!(engine.check.message_count("agent-1").unwrap(), 21);
    let a = agent_summary(&run, "agent-1").await;
    assert_eq!(a.hello.as_ref().unwrap().name, "llama-server");
    assert_eq!(a.hello.as_ref().unwrap().pid, 4242);
    assert_eq!((a.samples, a.events, a.last_seq), (20, 1, 21));
    assert_eq!(a.state, "connected");
    let incs = incidents(&run, "agent-1").await;
    assert_eq!(incs.len(), 1, "{incs:?}");
    assert_eq!(
        (incs[0].kind.as_str(), incs[0].seq, incs[0].time_ns),
        ("oom", 21, t0 + 21_000_000)
    );
    assert_eq!(incs[0].agent_name, "llama-server");
    assert!(incs[0].id.starts_with("inc-"), "{}", incs[0].id);
    // By name too.
    assert_eq!(incidents(&run, "llama-server").await, incs);
    let tl = timeline(&run, "llama-server").await;
    let got: Vec<(u64, u64)> = tl.samples.iter().map(|s| (s.seq, rss(s))).collect();
    let want: Vec<(u64, u64)> = (1..=20).map(|seq| (seq, seq * MIB)).collect();
    assert_eq!(got, want);
    let d = run
        .query()
        .await
        .diagnose(pb::DiagnoseRequest {
            incident: incs[0].id.clone(),
            ..Default::default()
        })
        .await
        .expect("Diagnose")
        .into_inner();
    assert_eq!(d.incident.as_deref(), Some(incs[0].id.as_str()));
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"), "{d:?}");
    run.stop().await;
}

async fn an_equal_resend_is_a_duplicate_and_a_different_one_is_refused(engine: Engine) {
    let run = engine.serve().await;
    let t0 = t0();
    let at = |seq: u64| t0 + seq as i64 * 1_000_000;
    let mut agent = run.agent(hello("agent-1", "svc")).await;
    for seq in 1..=5u64 {
        agent.send(sample(seq, at(seq))).await;
    }
    agent.acks_covering(&seqs(1..=5), |_| {}).await;
    agent.close();
    drop(agent);
    // A reconnect resends 3..=5 as they were (their acks were lost) and a
    // different message at seq 4.
    let mut again = run.agent(hello("agent-1", "svc")).await;
    for seq in 3..=5u64 {
        again.send(sample(seq, at(seq))).await;
    }
    again.acks_covering(&seqs(3..=5), |_| {}).await;
    let mut other = sample(4, at(4));
    other.seq = 4;
    if let Some(pb::agent_message::Body::Sample(s)) = &mut other.body {
        s.process.as_mut().unwrap().vm_rss_bytes = 999 * MIB;
    }
    again.send(other).await;
    match again.next().await {
        Ok(Some(pb::CollectorMessage {
            body: Some(Reply::Reject(r)),
        })) => {
            assert_eq!(r.seq, 4);
            assert!(r.reason.contains("other content"), "{}", r.reason);
        }
        other => panic!("expected a refusal of seq 4, got {other:?}"),
    }
    assert_eq!(engine.check.message_count("agent-1").unwrap(), 5);
    let a = agent_summary(&run, "agent-1").await;
    assert_eq!((a.samples, a.last_seq), (5, 5), "each seq counted once");
    assert_eq!(run.collector.conflicting_resends(), 1);
    run.stop().await;
}

async fn an_event_resent_on_a_new_stream_raises_one_incident(engine: Engine) {
    let run = engine.serve().await;
    let t0 = t0();
    let mut agent = run.agent(hello("agent-1", "svc")).await;
    agent.send(sample(1, t0)).await;
    agent.send(oom(2, t0 + 1_000_000)).await;
    agent.acks_covering(&seqs(1..=2), |_| {}).await;
    agent.close();
    drop(agent);
    let mut again = run.agent(hello("agent-1", "svc")).await;
    again.send(oom(2, t0 + 1_000_000)).await;
    again.send(sample(3, t0 + 2_000_000)).await;
    again.acks_covering(&seqs(2..=3), |_| {}).await;
    let incs = incidents(&run, "agent-1").await;
    let at: Vec<(&str, u64)> = incs.iter().map(|i| (i.kind.as_str(), i.seq)).collect();
    assert_eq!(at, [("oom", 2)], "one incident for the event: {incs:?}");
    let stored = engine.check.incidents(Some("agent-1")).unwrap();
    assert_eq!(stored, incs);
    run.stop().await;
}

async fn a_goodbye_is_listed_with_its_state(engine: Engine) {
    let run = engine.serve().await;
    let t0 = t0();
    let mut agent = run.agent(hello("agent-1", "svc")).await;
    agent.send(sample(1, t0)).await;
    agent.send(goodbye(2)).await;
    agent.acks_covering(&seqs(1..=2), |_| {}).await;
    let listed = eventually(Duration::from_secs(5), || async {
        let a = agent_summary(&run, "agent-1").await;
        (a.state == "disconnected").then_some(a)
    })
    .await
    .expect("the agent is listed as disconnected after its Goodbye");
    assert_eq!(
        listed.goodbye.as_ref().map(|g| g.reason.as_str()),
        Some("exit")
    );
    assert_eq!(
        engine.check.state("agent-1").unwrap().as_deref(),
        Some("disconnected")
    );
    run.stop().await;
}

async fn agent_ids_stay_with_their_first_token(engine: Engine) {
    let store = &engine.check;
    assert_eq!(store.bind_token("agent-1", "alice").unwrap(), "alice");
    assert_eq!(store.bind_token("agent-1", "bob").unwrap(), "alice");
    assert_eq!(store.bind_token("agent-2", "bob").unwrap(), "bob");
    assert_eq!(store.state("agent-1").unwrap(), None);
    assert!(
        store.set_state("agent-1", "lost", 1).is_err(),
        "an unknown agent"
    );
}

async fn retention_removes_old_messages_and_incidents_and_keeps_young_ones(engine: Engine) {
    let store = &engine.check;
    let now = now_ns();
    let old = now - 3 * NS_PER_DAY;
    store.record_hello(&hello("agent-1", "svc"), now).unwrap();
    let batch: Vec<pb::AgentMessage> = (1..=4u64)
        .map(|seq| sample(seq, old + seq as i64))
        .chain((5..=8u64).map(|seq| sample(seq, now - 1_000 + seq as i64)))
        .collect();
    let out = store.insert_batch("agent-1", &batch).unwrap();
    assert_eq!(out.fresh, (1..=8).collect::<Vec<_>>());
    let incident = |seq: u64, time_ns: i64| pb::Incident {
        agent_id: "agent-1".into(),
        agent_name: "svc".into(),
        kind: "oom".into(),
        time_ns,
        domain: "gpu_vram".into(),
        summary: "test".into(),
        seq,
        ..Default::default()
    };
    store.insert_incident(&incident(2, old)).unwrap().unwrap();
    store.insert_incident(&incident(6, now)).unwrap().unwrap();
    let gone = store.prune_before(now - NS_PER_DAY).unwrap();
    assert!(gone >= 5, "4 messages and an incident at least: {gone}");
    assert_eq!(store.message_count("agent-1").unwrap(), 4);
    let left: Vec<u64> = store
        .incidents(Some("agent-1"))
        .unwrap()
        .iter()
        .map(|i| i.seq)
        .collect();
    assert_eq!(left, [6]);
    // Pruned seqs may be stored again; the young ones are still duplicates.
    let out = store.insert_batch("agent-1", &batch[2..6]).unwrap();
    assert_eq!(out.fresh, [3, 4]);
    assert_eq!(out.stored, [3, 4, 5, 6]);
    if let Some(pg) = &engine.pg {
        // PostgreSQL dropped the old day's partition rather than its rows.
        let pg = PgStore::connect(pg.url(), 1).unwrap();
        let days = pg.partition_days().unwrap();
        assert!(days.contains(&(now / NS_PER_DAY)), "{days:?}");
        assert!(
            days.contains(&(old / NS_PER_DAY)),
            "the re-stored old seqs made their day again: {days:?}"
        );
        pg.prune_before(now - NS_PER_DAY).unwrap();
        let days = pg.partition_days().unwrap();
        assert!(!days.contains(&(old / NS_PER_DAY)), "{days:?}");
    }
}

/// `--since`, `--host`, `--domain` and `--cause` travel in the request and
/// the store filters: each filter leaves out what it should, alone and
/// together, on agents and on incidents.
async fn agents_and_incidents_are_filtered_by_the_store(engine: Engine) {
    const HOUR: i64 = 3_600_000_000_000;
    let run = engine.serve().await;
    let now = now_ns();
    let on = |id: &str, host: &str| pb::Hello {
        host: host.into(),
        ..hello(id, id)
    };
    let store = &engine.check;
    store
        .record_hello(&on("old-a", "h1"), now - 3 * HOUR)
        .unwrap();
    store
        .record_hello(&on("new-b", "h2"), now - 60_000_000_000)
        .unwrap();
    store
        .record_hello(&on("new-c", "h1"), now - 60_000_000_000)
        .unwrap();
    for (agent, kind, domain, time_ns) in [
        ("old-a", "oom", "gpu_vram", now - 3 * HOUR),
        ("new-b", "signal", "host_rss", now - 60_000_000_000),
        ("new-c", "oom", "gpu_vram", now - 60_000_000_000),
    ] {
        let inc = pb::Incident {
            agent_id: agent.into(),
            agent_name: agent.into(),
            kind: kind.into(),
            domain: domain.into(),
            time_ns,
            seq: 1,
            summary: format!("{kind} of {agent}"),
            ..Default::default()
        };
        assert!(store.insert_incident(&inc).unwrap().is_some());
    }
    let q = run.query().await;
    let agents = |req: pb::ListAgentsRequest| {
        let mut q = q.clone();
        async move {
            let listed = q.list_agents(req).await.unwrap().into_inner().agents;
            listed
                .into_iter()
                .map(|a| a.hello.unwrap().agent_id)
                .collect::<Vec<_>>()
        }
    };
    let since = now - HOUR;
    assert_eq!(
        agents(pb::ListAgentsRequest::default()).await,
        ["old-a", "new-b", "new-c"]
    );
    let by_since = pb::ListAgentsRequest {
        since_ns: since,
        ..Default::default()
    };
    assert_eq!(agents(by_since).await, ["new-b", "new-c"]);
    let by_host = pb::ListAgentsRequest {
        host: "h1".into(),
        ..Default::default()
    };
    assert_eq!(agents(by_host).await, ["old-a", "new-c"]);
    let both = pb::ListAgentsRequest {
        since_ns: since,
        host: "h1".into(),
    };
    assert_eq!(agents(both).await, ["new-c"]);

    let incidents = |req: pb::IncidentsRequest| {
        let mut q = q.clone();
        async move {
            let found = q.incidents(req).await.unwrap().into_inner().incidents;
            found.into_iter().map(|i| i.agent_id).collect::<Vec<_>>()
        }
    };
    let all = incidents(pb::IncidentsRequest::default()).await;
    assert_eq!(all, ["old-a", "new-b", "new-c"]);
    let req = |f: fn(&mut pb::IncidentsRequest)| {
        let mut r = pb::IncidentsRequest::default();
        f(&mut r);
        r
    };
    let since_req = pb::IncidentsRequest {
        since_ns: since,
        ..Default::default()
    };
    assert_eq!(incidents(since_req).await, ["new-b", "new-c"]);
    assert_eq!(
        incidents(req(|r| r.domain = "gpu_vram".into())).await,
        ["old-a", "new-c"]
    );
    assert_eq!(
        incidents(req(|r| r.cause = "signal".into())).await,
        ["new-b"]
    );
    assert_eq!(
        incidents(req(|r| r.host = "h1".into())).await,
        ["old-a", "new-c"]
    );
    let together = pb::IncidentsRequest {
        since_ns: since,
        cause: "oom".into(),
        host: "h1".into(),
        ..Default::default()
    };
    assert_eq!(incidents(together).await, ["new-c"]);
    let nothing = pb::IncidentsRequest {
        agent: "old-a".into(),
        since_ns: since,
        ..Default::default()
    };
    assert!(incidents(nothing).await.is_empty());
    run.stop().await;
}

/// A supervisor, its child's agent (a GPU worker) and a helper that names no
/// instance (it joins through its parent's pid): one instance on both
/// engines. The worker's device OOM and the supervisor's record of its
/// failed exit are one incident with the exit as its part; a name, the
/// instance id and the part's id all answer with that instance.
async fn an_instance_is_queried_whole_with_its_merged_incident(engine: Engine) {
    let run = engine.serve().await;
    let t = t0();
    let mut sup = run.agent(supervisor("sup", "gpu")).await;
    sup.send(child_start(1, t, 400)).await;
    sup.acks_covering(&seqs(1..=1), |_| {}).await;
    let mut worker = run
        .agent(member("gpu-worker-0", "gpu", "sup", 401, "worker"))
        .await;
    for seq in 1..=5u64 {
        worker.send(sample(seq, t + seq as i64 * 1_000_000)).await;
    }
    worker.send(oom(6, t + 1_000_000_000)).await;
    worker.acks_covering(&seqs(1..=6), |_| {}).await;
    let mut helper = run
        .agent(pb::Hello {
            parent_pid: 401,
            ..hello("compile-helper", "gpu-helper")
        })
        .await;
    helper.send(goodbye(1)).await;
    helper.acks_covering(&seqs(1..=1), |_| {}).await;
    sup.send(worker_failed(2, t + 1_500_000_000)).await;
    sup.acks_covering(&seqs(2..=2), |_| {}).await;

    let agents = all_agents(&run).await;
    let instances: Vec<(String, String)> = agents
        .iter()
        .map(|a| {
            (
                a.hello.as_ref().unwrap().agent_id.clone(),
                a.instance.clone(),
            )
        })
        .collect();
    assert_eq!(
        instances,
        [
            ("sup", "sup"),
            ("gpu-worker-0", "sup"),
            ("compile-helper", "sup")
        ]
        .map(|(a, i)| (a.to_string(), i.to_string())),
    );

    // One incident, led by the OOM, the failed exit its part.
    let all = incidents(&run, "").await;
    assert_eq!(all.len(), 1, "{all:#?}");
    let inc = &all[0];
    assert_eq!(
        (
            inc.kind.as_str(),
            inc.agent_id.as_str(),
            inc.seq,
            inc.domain.as_str()
        ),
        ("oom", "gpu-worker-0", 6, "gpu_vram")
    );
    let parts: Vec<(&str, &str, u64)> = inc
        .parts
        .iter()
        .map(|p| (p.kind.as_str(), p.agent_id.as_str(), p.seq))
        .collect();
    assert_eq!(parts, [("member_failed", "sup", 2)], "{inc:#?}");
    // The name, the instance id and the worker's id name the same.
    assert_eq!(incidents(&run, "gpu").await, all);
    assert_eq!(incidents(&run, "sup").await, all);
    assert_eq!(incidents(&run, "gpu-worker-0").await, all);

    // The name's timeline: the worker's samples (it has the allocator's
    // view), every member, and the supervisor's record of the exit.
    let tl = timeline(&run, "gpu").await;
    assert_eq!(tl.hello.as_ref().unwrap().agent_id, "gpu-worker-0");
    let got: Vec<(u64, u64)> = tl.samples.iter().map(|s| (s.seq, rss(s))).collect();
    assert_eq!(got, (1..=5).map(|seq| (seq, seq * MIB)).collect::<Vec<_>>());
    let members: BTreeSet<String> = tl
        .members
        .iter()
        .map(|m| m.hello.as_ref().unwrap().agent_id.clone())
        .collect();
    assert_eq!(
        members,
        ["sup", "gpu-worker-0", "compile-helper"]
            .map(String::from)
            .into()
    );
    let events: Vec<(String, u64)> = tl
        .events
        .iter()
        .map(|e| (e.agent_id.clone(), e.seq))
        .collect();
    assert!(events.contains(&("sup".to_string(), 2)), "{events:?}");
    // The worker's own, untagged: it is the timeline's agent.
    assert!(events.contains(&(String::new(), 6)), "{events:?}");

    // A diagnosis by name is the instance's latest incident; by the part's
    // id, its leader's.
    let diagnose = |agent: &str, incident: &str| pb::DiagnoseRequest {
        agent: agent.into(),
        incident: incident.into(),
        ..Default::default()
    };
    let mut q = run.query().await;
    let by_name = q.diagnose(diagnose("gpu", "")).await.unwrap().into_inner();
    assert_eq!(by_name.incident.as_deref(), Some(inc.id.as_str()));
    assert_eq!(by_name.domain.as_deref(), Some("gpu_vram"), "{by_name:?}");
    let by_part = q
        .diagnose(diagnose("", &inc.parts[0].id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_part.incident.as_deref(), Some(inc.id.as_str()));
    let mut by_part = by_part;
    let said = by_part.evidence.remove(0);
    assert!(
        said.contains(&format!("is part of incident {}", inc.id)),
        "{said}"
    );
    assert_eq!(by_part, by_name, "the leader's verdict");
    drop((sup, worker, helper));
    run.stop().await;
}

/// Samples stating drops (an agent's memory bound during an outage): a
/// timeline thinned to 5 points puts each statement on the first kept point
/// at or after it, none lost, none twice; unthinned, each stays on its own.
async fn a_thinned_timeline_folds_every_drop_statement(engine: Engine) {
    let run = engine.serve().await;
    let mut agent = run.agent(hello("agent-1", "svc")).await;
    for m in samples_stating_drops(t0()) {
        agent.send(m).await;
    }
    agent.acks_covering(&seqs(1..=100), |_| {}).await;
    let thinned = run
        .query()
        .await
        .timeline(pb::TimelineRequest {
            agent: "agent-1".into(),
            max_points: 5,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(thinned.samples.len(), 5);
    let (got, want) = folded_drops(&thinned.samples);
    assert_eq!(got, want);
    assert_eq!(got.iter().map(|d| d.1).sum::<u64>(), 11);
    let whole = timeline(&run, "agent-1").await;
    let own: Vec<u64> = whole
        .samples
        .iter()
        .filter(|p| p.sample.as_ref().unwrap().dropped_before.is_some())
        .map(|p| p.seq)
        .collect();
    assert_eq!(own, [10, 30, 51]);
    drop(agent);
    run.stop().await;
}
