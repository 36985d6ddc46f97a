//! Two collectors on one PostgreSQL (a throwaway cluster of the test's own),
//! over real gRPC on loopback: queries from either see the whole fleet; an
//! event resent to the other collector raises no second incident; a stream
//! that broke on one collector and resumed on the other within the grace is
//! no lost agent, while one that never comes back is lost once; timelines
//! and diagnoses read what either collector stored; parts of one failure
//! that reach different collectors are one incident.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use oomscope_collector::ingest::Collector;
use oomscope_collector::store::{now_ns, Backend, PgStore, Store};
use oomscope_testkit::postgres::PgCluster;
use support::*;

/// Short, so the test waits little past it.
const GRACE: Duration = Duration::from_secs(2);

async fn collector_on(pg: &PgCluster, dir: &tempfile::TempDir) -> Running {
    let shared = PgStore::connect(pg.url(), 4).expect("connect to the test's PostgreSQL");
    let collector =
        Collector::new(Store::open_in_memory().unwrap(), GRACE).with_shared_store(Arc::new(shared));
    serving(dir.path(), collector).await
}

fn listed(agents: &[oomscope_collector::pb::AgentSummary]) -> BTreeSet<String> {
    agents
        .iter()
        .map(|a| a.hello.as_ref().unwrap().agent_id.clone())
        .collect()
}

async fn list(run: &Running) -> Vec<oomscope_collector::pb::AgentSummary> {
    run.query()
        .await
        .list_agents(oomscope_collector::pb::ListAgentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .agents
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_collectors_share_agents_incidents_and_lost_checks() {
    let pg = PgCluster::start().expect("a PostgreSQL cluster for the test");
    let dir = tempfile::tempdir().unwrap();
    let a = collector_on(&pg, &dir).await;
    let b = collector_on(&pg, &dir).await;
    let t0 = now_ns();
    let seqs = |r: std::ops::RangeInclusive<u64>| r.collect::<BTreeSet<u64>>();

    // mover streams to A, then (its ack of the OOM lost) to B, within the grace.
    let mut mover = a.agent(hello("mover", "svc")).await;
    mover.send(sample(1, t0)).await;
    mover.send(oom(2, t0 + 1_000)).await;
    mover.acks_covering(&seqs(1..=2), |_| {}).await;
    // stays streams to B all along; quitter to A, and never comes back.
    let mut stays = b.agent(hello("stays", "other")).await;
    stays.send(sample(1, t0)).await;
    stays.acks_covering(&seqs(1..=1), |_| {}).await;
    let mut quitter = a.agent(hello("quitter", "gone")).await;
    quitter.send(sample(1, t0)).await;
    quitter.acks_covering(&seqs(1..=1), |_| {}).await;

    let want: BTreeSet<String> = ["mover", "stays", "quitter"].map(String::from).into();
    assert_eq!(listed(&list(&a).await), want, "A sees B's agent too");
    assert_eq!(listed(&list(&b).await), want, "B sees A's agents too");

    // Both streams to A break without a Goodbye; mover comes back on B.
    mover.close();
    drop(mover);
    quitter.close();
    drop(quitter);
    let mut moved = b.agent(hello("mover", "svc")).await;
    moved.send(oom(2, t0 + 1_000)).await;
    moved.send(sample(3, t0 + 2_000)).await;
    moved.acks_covering(&seqs(2..=3), |_| {}).await;

    // The OOM once, from either collector, numbered by the shared store.
    for run in [&a, &b] {
        let incs = incidents(run, "mover").await;
        let seen: Vec<(&str, u64)> = incs.iter().map(|i| (i.kind.as_str(), i.seq)).collect();
        assert_eq!(seen, [("oom", 2)], "{incs:?}");
    }
    // quitter is lost once A's grace passes; mover is not.
    let lost = eventually(GRACE * 5, || async {
        let incs = incidents(&b, "").await;
        incs.iter().any(|i| i.kind == "agent_lost").then_some(incs)
    })
    .await
    .expect("quitter recorded as lost");
    let lost: Vec<&str> = lost
        .iter()
        .filter(|i| i.kind == "agent_lost")
        .map(|i| i.agent_id.as_str())
        .collect();
    assert_eq!(lost, ["quitter"]);
    // Timelines and diagnoses from either collector read what every
    // collector stored: A holds mover's seqs 1-2 itself, B quitter's none.
    let seqs_of = |t: oomscope_collector::pb::TimelineResponse| -> Vec<u64> {
        t.samples.iter().map(|s| s.seq).collect()
    };
    assert_eq!(seqs_of(timeline(&a, "mover").await), [1, 3]);
    assert_eq!(seqs_of(timeline(&b, "quitter").await), [1]);
    let oom_id = incidents(&b, "mover").await[0].id.clone();
    let lost_id = incidents(&a, "quitter").await[0].id.clone();
    for run in [&a, &b] {
        let diagnose = |incident: String| async move {
            run.query()
                .await
                .diagnose(oomscope_collector::pb::DiagnoseRequest {
                    incident,
                    ..Default::default()
                })
                .await
                .expect("a diagnosis")
                .into_inner()
        };
        let d = diagnose(oom_id.clone()).await;
        assert_eq!(d.incident.as_deref(), Some(oom_id.as_str()), "{d:?}");
        assert_eq!(d.domain.as_deref(), Some("gpu_vram"), "{d:?}");
        let d = diagnose(lost_id.clone()).await;
        assert_eq!(d.incident.as_deref(), Some(lost_id.as_str()), "{d:?}");
    }
    // mover's check ran beside quitter's (same grace, same break).
    let shared = PgStore::connect(pg.url(), 1).unwrap();
    assert_eq!(shared.state("quitter").unwrap().as_deref(), Some("lost"));
    assert_eq!(shared.state("mover").unwrap().as_deref(), Some("connected"));
    assert_eq!(shared.message_count("mover").unwrap(), 3, "each seq once");
    let summary = list(&a).await;
    let mover = summary
        .iter()
        .find(|s| s.hello.as_ref().unwrap().agent_id == "mover")
        .unwrap();
    assert_eq!((mover.samples, mover.events, mover.last_seq), (2, 1, 3));
    drop((stays, moved));
    a.stop().await;
    b.stop().await;
}

/// The collector's own store keeps only its working window of the streams
/// it serves (its memory stays bounded); the shared store keeps everything,
/// and queries read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_own_store_keeps_its_working_window_and_queries_read_the_shared_one() {
    let pg = PgCluster::start().expect("a PostgreSQL cluster for the test");
    let dir = tempfile::tempdir().unwrap();
    let run = collector_on(&pg, &dir).await;
    let now = now_ns();
    let two_hours = 2 * 3600 * 1_000_000_000;
    let mut agent = run.agent(hello("agent-1", "svc")).await;
    agent.send(sample(1, now - two_hours)).await;
    agent.send(sample(2, now)).await;
    agent.acks_covering(&[1, 2].into(), |_| {}).await;
    run.collector.keep_own_for(Duration::from_secs(3600));
    let own = eventually(Duration::from_secs(10), || async {
        let n = run
            .collector
            .with_store(|s| s.message_count("agent-1"))
            .await
            .unwrap();
        (n == 1).then_some(n)
    })
    .await;
    assert_eq!(own, Some(1), "the two-hour-old sample left the own store");
    let shared = PgStore::connect(pg.url(), 1).unwrap();
    assert_eq!(shared.message_count("agent-1").unwrap(), 2);
    let seqs: Vec<u64> = timeline(&run, "agent-1")
        .await
        .samples
        .iter()
        .map(|s| s.seq)
        .collect();
    assert_eq!(seqs, [1, 2]);
    drop(agent);
    run.stop().await;
}

/// One failure seen in parts by two collectors (a GPU worker's OOM streams to
/// one, its supervisor's record of the worker's failed exit to the other, in
/// either order) is one incident in the shared store, led by the OOM with
/// the exit as its part: correlation runs in the store, not in either
/// collector's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_seen_by_two_collectors_is_one_incident() {
    for oom_first in [true, false] {
        let pg = PgCluster::start().expect("a PostgreSQL cluster for the test");
        let dir = tempfile::tempdir().unwrap();
        let a = collector_on(&pg, &dir).await;
        let b = collector_on(&pg, &dir).await;
        let t = now_ns();
        let one = |s: u64| BTreeSet::from([s]);
        let mut sup = b.agent(supervisor("sup", "gpu")).await;
        sup.send(child_start(1, t, 400)).await;
        sup.acks_covering(&one(1), |_| {}).await;
        let mut worker = a
            .agent(member("gpu-worker-0", "gpu", "sup", 401, "worker"))
            .await;
        worker.send(sample(1, t + 1_000_000)).await;
        worker.acks_covering(&one(1), |_| {}).await;
        let failed_exit = worker_failed(2, t + 1_500_000_000);
        if oom_first {
            worker.send(oom(2, t + 1_000_000_000)).await;
            worker.acks_covering(&one(2), |_| {}).await;
            sup.send(failed_exit).await;
            sup.acks_covering(&one(2), |_| {}).await;
        } else {
            sup.send(failed_exit).await;
            sup.acks_covering(&one(2), |_| {}).await;
            worker.send(oom(2, t + 1_000_000_000)).await;
            worker.acks_covering(&one(2), |_| {}).await;
        }
        for run in [&a, &b] {
            let incs = incidents(run, "").await;
            let got: Vec<String> = incs
                .iter()
                .map(|i| {
                    let parts: Vec<String> = i
                        .parts
                        .iter()
                        .map(|p| format!("{} of {}", p.kind, p.agent_id))
                        .collect();
                    format!("{} of {} [{}]", i.kind, i.agent_id, parts.join(", "))
                })
                .collect();
            assert_eq!(
                got,
                ["oom of gpu-worker-0 [member_failed of sup]"],
                "oom first: {oom_first}"
            );
        }
        drop((sup, worker));
        a.stop().await;
        b.stop().await;
    }
}

/// Batches of many agents at once go into shared group transactions (fewer
/// commits than batches), and each comes back with its own outcome: its
/// seqs stored and counted once, a resend with other content refused in
/// its own batch only.
#[test]
fn batches_of_many_agents_share_group_commits_with_their_own_outcomes() {
    const AGENTS: usize = 16;
    let (_pg, store, t0) = agents_a0_to(AGENTS);
    let batch = |from: u64| {
        (from..from + 50)
            .map(|s| sample(s, t0 + s as i64))
            .collect::<Vec<_>>()
    };
    // a0's seq 10 is stored first; the group below resends it changed.
    store.insert_batch("a0", &batch(10)[..1]).unwrap();
    let start = Arc::new(std::sync::Barrier::new(AGENTS));
    let threads: Vec<_> = (0..AGENTS)
        .map(|a| {
            let (store, start) = (store.clone(), start.clone());
            let mut msgs = batch(1);
            if a == 0 {
                msgs[9] = sample(10, t0 + 999);
            }
            std::thread::spawn(move || {
                start.wait();
                store.insert_batch(&format!("a{a}"), &msgs).unwrap()
            })
        })
        .collect();
    let outcomes: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (a, out) in outcomes.iter().enumerate() {
        let want: Vec<u64> = (1..=50).filter(|&s| a != 0 || s != 10).collect();
        assert_eq!(out.stored, want, "a{a}");
        assert_eq!(out.fresh, want, "a{a}");
        let refused: &[u64] = if a == 0 { &[10] } else { &[] };
        assert_eq!(out.conflicting, refused, "a{a}");
        assert_eq!(store.message_count(&format!("a{a}")).unwrap(), 50, "a{a}");
    }
    let counted: Vec<(u64, u64)> = store
        .list_agents()
        .unwrap()
        .iter()
        .map(|a| (a.samples, a.last_seq))
        .collect();
    assert_eq!(counted, vec![(50, 50); AGENTS]);
    let (groups, batches) = store.group_counts();
    assert_eq!(batches, AGENTS as u64 + 1);
    assert!(groups < batches, "{groups} groups for {batches} batches");
}

/// A history longer than a query's window: the snapshot holds the newest
/// messages and older samples spread in time, and the drop statements of
/// the older samples it left out, so a thinned timeline still states every
/// drop (as the file store's, which thins the whole history).
#[test]
fn a_long_historys_snapshot_keeps_the_drop_statements_it_thins() {
    let pg = PgCluster::start().expect("a PostgreSQL cluster for the test");
    let store = PgStore::connect(pg.url(), 2).unwrap();
    let t0 = now_ns();
    store.record_hello(&hello("a1", "svc"), t0).unwrap();
    store
        .insert_batch("a1", &samples_stating_drops(t0))
        .unwrap();
    // The newest 40 (seqs 61..=100) and 10 of the 60 before: the samples
    // stating drops (10, 30, 51) may all be left out.
    let view = store
        .snapshot("a1", 40, 10)
        .unwrap()
        .expect("a known agent");
    let t = view.timeline("a1", 0, 0, 5).unwrap();
    assert_eq!(t.samples.len(), 5);
    assert_eq!(t.samples.first().map(|p| p.seq), Some(1), "the oldest kept");
    let (got, want) = folded_drops(&t.samples);
    assert_eq!(got, want);
    assert_eq!(got.iter().map(|d| d.1).sum::<u64>(), 11);
    // Without the older history: only what the window holds.
    let newest = store.snapshot("a1", 40, 0).unwrap().unwrap();
    let t = newest.timeline("a1", 0, 0, 5).unwrap();
    assert_eq!(t.samples.first().map(|p| p.seq), Some(61));
    assert!(folded_drops(&t.samples).0.is_empty());
}

/// A batch the database refuses (an agent id PostgreSQL cannot hold as
/// text) fails alone: the batches that shared its group are stored and
/// answered as if it had not been there.
#[test]
fn a_refused_batch_costs_the_rest_of_its_group_nothing() {
    const AGENTS: usize = 8;
    /// Bursts: the bad batch shares a group with good ones in most.
    const ROUNDS: u64 = 3;
    let (_pg, store, t0) = agents_a0_to(AGENTS);
    for round in 0..ROUNDS {
        let seqs = round * 20 + 1..=round * 20 + 20;
        let msgs: Vec<_> = seqs.clone().map(|s| sample(s, t0 + s as i64)).collect();
        let start = Arc::new(std::sync::Barrier::new(AGENTS + 1));
        let threads: Vec<_> = (0..=AGENTS)
            .map(|a| {
                let (store, start, msgs) = (store.clone(), start.clone(), msgs.clone());
                // The last one: a NUL byte, which no PostgreSQL text holds.
                let id = match a {
                    AGENTS => "bad\0agent".to_string(),
                    a => format!("a{a}"),
                };
                std::thread::spawn(move || {
                    start.wait();
                    store.insert_batch(&id, &msgs)
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let (bad, good) = results.split_last().unwrap();
        assert!(bad.is_err(), "{bad:?}");
        for (a, r) in good.iter().enumerate() {
            let out = r
                .as_ref()
                .unwrap_or_else(|e| panic!("round {round}, a{a}: {e:#}"));
            assert_eq!(out.stored, seqs.clone().collect::<Vec<u64>>(), "a{a}");
        }
    }
    for a in 0..AGENTS {
        let n = store.message_count(&format!("a{a}")).unwrap();
        assert_eq!(n, ROUNDS * 20, "a{a}");
    }
    let (_, batches) = store.group_counts();
    assert_eq!(
        batches,
        ROUNDS * AGENTS as u64,
        "each good batch counted once"
    );
}

/// A cluster of the test's own and a store on it where agents a0.. (`n`
/// of them) said Hello at the returned time.
fn agents_a0_to(n: usize) -> (PgCluster, Arc<PgStore>, i64) {
    let pg = PgCluster::start().expect("a PostgreSQL cluster for the test");
    let store = Arc::new(PgStore::connect(pg.url(), 4).unwrap());
    let t0 = now_ns();
    for a in 0..n {
        store
            .record_hello(&hello(&format!("a{a}"), "svc"), t0)
            .unwrap();
    }
    (pg, store, t0)
}
