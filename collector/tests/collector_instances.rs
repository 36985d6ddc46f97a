//! Multi-process servers as one instance, over real gRPC and a real SQLite
//! file: membership, name resolution, correlated incidents, stops that are
//! not incidents, and mass disconnects.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use oomscope_collector::pb;
use oomscope_collector::pb::event::Kind;
use support::*;

const GRACE: Duration = Duration::from_millis(300);
const T0: i64 = 1_700_000_000_000_000_000;

fn now() -> i64 {
    oomscope_collector::store::now_ns()
}

fn kernel_kill(seq: u64, time_ns: i64, pid: u32) -> pb::AgentMessage {
    event(
        seq,
        time_ns,
        Kind::KernelOomKill(pb::KernelOomKill {
            pid,
            task: "VLLM::Worker".into(),
            constraint: "CONSTRAINT_MEMCG".into(),
            oom_memcg: "/test/limit".into(),
            anon_rss_bytes: 2_000 * MIB,
            ..Default::default()
        }),
    )
}

async fn all_incidents(run: &Running) -> Vec<pb::Incident> {
    incidents(run, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_means_its_newest_instance_with_every_process_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let old = run.agent(supervisor("sup-old", "svc")).await;
    old.send(sample(1, now())).await;
    let sup = run.agent(supervisor("sup-new", "svc")).await;
    sup.send(sample(1, now())).await;
    let api = run
        .agent(member("api", "svc", "sup-new", 200, "api_server"))
        .await;
    api.send(sample(1, now())).await;
    let mut worker = run
        .agent(member("worker-0", "svc", "sup-new", 201, "worker"))
        .await;
    worker.send(sample(2, now())).await;
    // The parent on record before its helper says Hello, as a helper starts
    // after its parent: a Hello is stored as the stream is read, and once
    // the helper's came first and joined the name's oldest instance.
    worker.acks_covering(&BTreeSet::from([2]), |_| {}).await;
    // A helper that names no instance joins through its parent's agent.
    let helper = run
        .agent(pb::Hello {
            parent_pid: 201,
            ..hello("compile-helper", "svc")
        })
        .await;
    helper.send(sample(3, now())).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let agents = run
        .query()
        .await
        .list_agents(pb::ListAgentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .agents;
    let instance_of = |id: &str| {
        agents
            .iter()
            .find(|a| a.hello.as_ref().unwrap().agent_id == id)
            .map(|a| a.instance.clone())
            .unwrap()
    };
    assert_eq!(instance_of("sup-old"), "sup-old");
    for id in ["sup-new", "api", "worker-0", "compile-helper"] {
        assert_eq!(instance_of(id), "sup-new", "{id}");
    }

    // The name is the newest instance, not the newest process (the helper).
    let t = timeline(&run, "svc").await;
    let members: Vec<&str> = t
        .members
        .iter()
        .map(|m| m.hello.as_ref().unwrap().agent_id.as_str())
        .collect();
    assert_eq!(members.len(), 4, "{members:?}");
    // Every process here sent one allocator reading: the newest such
    // process speaks for the instance, and leads the members.
    assert_eq!(t.hello.as_ref().unwrap().agent_id, "compile-helper");
    assert_eq!(members[0], "compile-helper");
    assert!(members.contains(&"sup-new") && members.contains(&"worker-0"));
    // An agent id is that one process, with no members.
    let w = timeline(&run, "worker-0").await;
    assert_eq!(w.hello.unwrap().agent_id, "worker-0");
    assert!(w.members.is_empty());
    assert_eq!(rss(&w.samples[0]), 2 * MIB);
    drop((old, sup, api, worker, helper));
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_kill_of_a_worker_is_one_incident_with_the_lost_worker_and_the_exit() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let t = now();
    let mut sup = run.agent(supervisor("sup", "ref")).await;
    sup.send(child_start(1, t, 200)).await;
    sup.acks_covering(&[1].into(), |_| {}).await;
    let mut worker = run
        .agent(member("worker-0", "ref", "sup", 201, "worker"))
        .await;
    worker.send(sample(1, t + 1)).await;
    worker.acks_covering(&[1].into(), |_| {}).await;
    // The kernel kills the worker: its stream breaks, the supervisor reads
    // the kernel's record, and the server exits 1 a moment later.
    worker.close();
    drop(worker);
    sup.send(kernel_kill(2, t + 2_000_000, 201)).await;
    sup.send(child_exit(
        3,
        t + 900_000_000,
        pb::ChildExit {
            pid: 200,
            exit_code: Some(1),
            stderr_tail: "Worker proc VllmWorker-0 died unexpectedly (exit code: -9)\n".into(),
            ..Default::default()
        },
    ))
    .await;
    sup.acks_covering(&[2, 3].into(), |_| {}).await;
    // Past the lost grace: the worker's agent_lost joins the kernel kill.
    tokio::time::sleep(GRACE * 4).await;
    let incs = all_incidents(&run).await;
    assert_eq!(incs.len(), 1, "{incs:#?}");
    assert_eq!(incs[0].kind, "kernel_oom_kill");
    assert!(
        incs[0].summary.contains("pid 201 (VLLM::Worker)"),
        "{}",
        incs[0].summary
    );
    // The name's latest incident, and the one with no name, are that one.
    for agent in ["ref", ""] {
        let d = run
            .query()
            .await
            .diagnose(pb::DiagnoseRequest {
                agent: agent.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            d.incident.as_deref(),
            Some(incs[0].id.as_str()),
            "{agent:?}"
        );
    }
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_is_no_incident_and_its_workers_ended_rather_than_lost() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let t = now();
    let mut sup = run.agent(supervisor("sup", "ref")).await;
    sup.send(child_start(1, t, 200)).await;
    sup.acks_covering(&[1].into(), |_| {}).await;
    let mut workers = Vec::new();
    for i in 0..2u32 {
        let mut w = run
            .agent(member(&format!("w{i}"), "ref", "sup", 201 + i, "worker"))
            .await;
        w.send(sample(1, t + 1)).await;
        w.acks_covering(&[1].into(), |_| {}).await;
        workers.push(w);
    }
    // SIGTERM: the supervisor records that it passes it on; the workers go
    // first (no Goodbye), and are recorded lost only after the grace, when
    // the stop is long on record; then the child ends by the signal.
    sup.send(event(
        2,
        now(),
        Kind::StopForwarded(pb::StopForwarded { signal: 15 }),
    ))
    .await;
    sup.acks_covering(&[2].into(), |_| {}).await;
    for mut w in workers {
        w.close();
    }
    tokio::time::sleep(GRACE * 2).await;
    sup.send(child_exit(
        3,
        now(),
        pb::ChildExit {
            pid: 200,
            signal: Some(15),
            stop_signal: Some(15),
            ..Default::default()
        },
    ))
    .await;
    sup.send(goodbye(4)).await;
    sup.acks_covering(&[3, 4].into(), |_| {}).await;
    tokio::time::sleep(GRACE * 2).await;
    assert_eq!(
        all_incidents(&run).await,
        vec![],
        "{:#?}",
        incident_rows(&run)
    );
    for w in ["w0", "w1"] {
        assert_eq!(
            agent_summary(&run, w).await.state,
            "ended",
            "{w}: {:#?}",
            incident_rows(&run)
        );
    }
    run.stop().await;
}

/// #28: `kill -9` of a worker; the server then exits 0. The death is one
/// incident (the supervisor's record of the member's end leads, the
/// worker's lost stream joins it as a part) and stays after the exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_member_stays_one_incident_when_the_server_then_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let t = now();
    let mut sup = run.agent(supervisor("sup", "ref")).await;
    sup.send(child_start(1, t, 200)).await;
    sup.acks_covering(&[1].into(), |_| {}).await;
    let mut w = run.agent(member("w0", "ref", "sup", 201, "worker")).await;
    w.send(sample(1, t + 1)).await;
    w.acks_covering(&[1].into(), |_| {}).await;
    w.close();
    sup.send(child_exit(
        2,
        now(),
        pb::ChildExit {
            pid: 201,
            signal: Some(9),
            member: true,
            title: "Worker".into(),
            status_from: "proc_events".into(),
            ..Default::default()
        },
    ))
    .await;
    sup.acks_covering(&[2].into(), |_| {}).await;
    tokio::time::sleep(GRACE * 2).await;
    sup.send(child_exit(
        3,
        now(),
        pb::ChildExit {
            pid: 200,
            exit_code: Some(0),
            ..Default::default()
        },
    ))
    .await;
    sup.send(goodbye(4)).await;
    sup.acks_covering(&[3, 4].into(), |_| {}).await;
    tokio::time::sleep(GRACE * 2).await;
    let incs = all_incidents(&run).await;
    assert_eq!(incs.len(), 1, "{:#?}", incident_rows(&run));
    assert_eq!(incs[0].kind, "member_died");
    assert!(
        incs[0].summary.contains("member pid 201 (Worker)"),
        "{}",
        incs[0].summary
    );
    // (Its domain needs the supervisor's counters, which this stream has
    // not: e2e_members checks it with a real `oomscope run`.)
    let parts: Vec<&str> = incs[0].parts.iter().map(|p| p.kind.as_str()).collect();
    assert_eq!(parts, ["agent_lost"], "the worker's lost stream is a part");
    assert_eq!(agent_summary(&run, "w0").await.state, "lost");
    // The part answers with its root's verdict, and says so.
    let d = run
        .query()
        .await
        .diagnose(pb::DiagnoseRequest {
            incident: incs[0].parts[0].id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.incident.as_deref(), Some(incs[0].id.as_str()));
    assert!(
        d.evidence[0].contains("is part of incident"),
        "{:?}",
        d.evidence
    );
    run.stop().await;
}

/// vLLM refusing a KV reservation at start: its engine exits 1, then the
/// API server exits 1 printing why. The text says more than the code: the
/// server's exit with its out-of-memory text leads, the engine's is a part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_failed_exit_is_a_part_of_the_servers_out_of_memory_text() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let t = now();
    let mut sup = run.agent(supervisor("sup", "kv")).await;
    sup.send(child_start(1, t, 300)).await;
    sup.send(child_exit(
        2,
        t + 1_000_000,
        pb::ChildExit {
            pid: 301,
            exit_code: Some(1),
            member: true,
            title: "VLLM::EngineCor".into(),
            status_from: "proc_events".into(),
            ..Default::default()
        },
    ))
    .await;
    sup.send(child_exit(
        3,
        t + 500_000_000,
        pb::ChildExit {
            pid: 300,
            exit_code: Some(1),
            stderr_tail: "ValueError: Available memory on node 0 (1.0 GiB) is less than requested memory for kv (40.0 GiB)\n".into(),
            ..Default::default()
        },
    ))
    .await;
    sup.acks_covering(&[1, 2, 3].into(), |_| {}).await;
    tokio::time::sleep(GRACE).await;
    let incs = all_incidents(&run).await;
    assert_eq!(incs.len(), 1, "{:#?}", incident_rows(&run));
    assert_eq!(incs[0].kind, "exit_oom_text", "{:#?}", incs);
    let parts: Vec<&str> = incs[0].parts.iter().map(|p| p.kind.as_str()).collect();
    assert_eq!(parts, ["member_failed"]);
    run.stop().await;
}

/// A multi-process GPU server: its worker (an agent of its own) runs out
/// of device memory and exits 1 (the supervisor's `member_failed`). One
/// failure, one incident, led by the OOM with the allocator's state,
/// whichever stream the collector reads first; and a worker's failed exit
/// with no OOM before it stays an incident of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_device_oom_and_its_failed_exit_are_one_incident() {
    for oom_stored_first in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let run = start(&dir.path().join("c.db"), GRACE).await;
        let t = now();
        let mut sup = run.agent(supervisor("sup", "gpu")).await;
        sup.send(child_start(1, t, 400)).await;
        sup.acks_covering(&[1].into(), |_| {}).await;
        let mut worker = run
            .agent(member("gpu-worker-0", "gpu", "sup", 401, "worker"))
            .await;
        let failed_exit = worker_failed(2, t + 1_500_000_000);
        if oom_stored_first {
            worker.send(oom(1, t + 1_000_000_000)).await;
            worker.acks_covering(&[1].into(), |_| {}).await;
            sup.send(failed_exit).await;
            sup.acks_covering(&[2].into(), |_| {}).await;
        } else {
            sup.send(failed_exit).await;
            sup.acks_covering(&[2].into(), |_| {}).await;
            worker.send(oom(1, t + 1_000_000_000)).await;
            worker.acks_covering(&[1].into(), |_| {}).await;
        }
        sup.send(goodbye(3)).await;
        sup.acks_covering(&[3].into(), |_| {}).await;
        let incs = all_incidents(&run).await;
        assert_eq!(
            incs.len(),
            1,
            "oom stored first: {oom_stored_first}: {:#?}",
            incident_rows(&run)
        );
        assert_eq!(incs[0].kind, "oom", "{:#?}", incs);
        assert_eq!(incs[0].agent_id, "gpu-worker-0");
        let parts: Vec<&str> = incs[0].parts.iter().map(|p| p.kind.as_str()).collect();
        assert_eq!(parts, ["member_failed"], "{:#?}", incs);
        worker.close();
        run.stop().await;
    }
    // No OOM: the worker's failed exit is its own incident.
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let t = now();
    let mut sup = run.agent(supervisor("sup", "gpu")).await;
    sup.send(child_start(1, t, 400)).await;
    sup.send(child_exit(
        2,
        t + 1_000_000,
        pb::ChildExit {
            pid: 401,
            exit_code: Some(1),
            member: true,
            ..Default::default()
        },
    ))
    .await;
    sup.acks_covering(&[1, 2].into(), |_| {}).await;
    let incs = all_incidents(&run).await;
    let kinds: Vec<&str> = incs.iter().map(|i| i.kind.as_str()).collect();
    assert_eq!(kinds, ["member_failed"], "{:#?}", incident_rows(&run));
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_agents_lost_at_once_are_one_incident() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let mut agents = Vec::new();
    for i in 0..50 {
        let mut a = run.agent(hello(&format!("a{i}"), &format!("svc{i}"))).await;
        a.send(sample(1, now())).await;
        a.acks_covering(&[1].into(), |_| {}).await;
        agents.push(a);
    }
    for a in &mut agents {
        a.close();
    }
    drop(agents);
    let settled = eventually(Duration::from_secs(10), || async {
        let incs = all_incidents(&run).await;
        let one = incs.len() == 1 && incs[0].summary.starts_with("50 agents");
        one.then_some(incs)
    })
    .await;
    let incs = settled.unwrap_or_else(|| panic!("{:#?}", incident_rows(&run)));
    assert_eq!(incs[0].kind, "mass_disconnect");
    run.stop().await;
}

/// Every incident row, merged ones included, for a failure message.
fn incident_rows(run: &Running) -> Vec<String> {
    let conn = rusqlite::Connection::open(&run.db).unwrap();
    let mut stmt = conn
        .prepare("SELECT id, kind, coalesce(merged_into, ''), summary FROM incidents")
        .unwrap();
    stmt.query_map([], |r| {
        Ok(format!(
            "{} {} {} {}",
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, String>(3)?
        ))
    })
    .unwrap()
    .map(|r| r.unwrap())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_crash_loop_is_one_incident() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let mut sup = run.agent(supervisor("sup", "looper")).await;
    let mut seq = 0;
    for attempt in 0..4u32 {
        seq += 1;
        sup.send(child_start(seq, T0 + seq as i64, 300 + attempt))
            .await;
        seq += 1;
        sup.send(child_exit(
            seq,
            T0 + seq as i64,
            pb::ChildExit {
                pid: 300 + attempt,
                signal: Some(9),
                attempt,
                crash_loop: attempt == 3,
                ..Default::default()
            },
        ))
        .await;
    }
    sup.acks_covering(&(1..=seq).collect(), |_| {}).await;
    let incs = all_incidents(&run).await;
    let loops = incs.iter().filter(|i| i.kind == "crash_loop").count();
    assert_eq!(loops, 1, "{incs:#?}");
    run.stop().await;
}
