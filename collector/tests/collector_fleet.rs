//! Fleet patterns over real gRPC: a crash loop (one service's agents dying
//! again and again) and a restart storm (several instances of one service
//! starting together, then a burst of requests). Both fire on a scripted
//! storm and stay silent on a single restart, and on the processes of one
//! multi-process instance starting together.

#[path = "collector_support.rs"]
mod support;

use std::time::Duration;

use oomscope_collector::pb;
use support::*;

const GRACE: Duration = Duration::from_millis(200);

fn now() -> i64 {
    oomscope_agent_core::now_ns()
}

fn request(seq: u64, id: &str) -> pb::AgentMessage {
    event(
        seq,
        now(),
        pb::event::Kind::Request(pb::RequestBoundary {
            request_id: id.into(),
            start: true,
            ..Default::default()
        }),
    )
}

/// The storm's windows shrunk from minutes to seconds, so a test takes seconds.
fn storm_policy() -> oomscope_collector::fleet::FleetPolicy {
    oomscope_collector::fleet::FleetPolicy {
        storm_window: Duration::from_secs(1),
        burst_window: Duration::from_secs(5),
        baseline_window: Duration::from_secs(10),
        ..Default::default()
    }
}

/// `n` replicas of service `name`, one on each of `n` nodes: each its own
/// instance (agents of one name on one host join one instance).
async fn replicas(run: &Running, name: &str, n: usize) -> Vec<AgentStream> {
    let mut agents = Vec::new();
    for i in 0..n {
        let mut h = hello(&format!("{name}-{i}"), name);
        h.host = format!("node-{i}");
        agents.push(run.agent(h).await);
    }
    agents
}

async fn incidents_of(run: &Running, name: &str) -> Vec<pb::Incident> {
    let mut q = run.query().await;
    q.incidents(pb::IncidentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .incidents
        .into_iter()
        .filter(|i| i.agent_name == name)
        .collect()
}

/// An agent that says Hello, sends one sample (acked), then vanishes without a Goodbye.
async fn die(run: &Running, id: &str, name: &str) {
    let mut a = run.agent(hello(id, name)).await;
    a.send(sample(1, now())).await;
    a.acks_covering(&[1].into(), |_| {}).await;
    a.close();
    drop(a);
}

async fn wait_for(run: &Running, name: &str, kind: &str) -> Option<pb::Incident> {
    for _ in 0..50 {
        if let Some(i) = incidents_of(run, name)
            .await
            .into_iter()
            .find(|i| i.kind == kind)
        {
            return Some(i);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test]
async fn three_deaths_of_one_service_are_a_crash_loop() {
    let tmp = tempfile::tempdir().unwrap();
    let run = start(&tmp.path().join("db"), GRACE).await;
    for i in 0..3 {
        die(&run, &format!("svc-{i}"), "svc").await;
        tokio::time::sleep(GRACE * 3).await;
    }
    let inc = wait_for(&run, "svc", "crash_loop")
        .await
        .expect("a crash loop incident");
    assert!(inc.summary.contains("died 3 times"), "{}", inc.summary);
    assert!(
        inc.summary.contains("svc-0 ended: agent_lost")
            && inc.summary.contains("svc-2 ended: agent_lost"),
        "{}",
        inc.summary
    );
    let lost = incidents_of(&run, "svc")
        .await
        .iter()
        .filter(|i| i.kind == "agent_lost")
        .count();
    assert_eq!(lost, 3);
    // Recorded once per window, not once per further death.
    die(&run, "svc-3", "svc").await;
    tokio::time::sleep(GRACE * 3).await;
    let loops = incidents_of(&run, "svc")
        .await
        .iter()
        .filter(|i| i.kind == "crash_loop")
        .count();
    assert_eq!(loops, 1);
    run.stop().await;
}

#[tokio::test]
async fn a_single_restart_is_neither_a_loop_nor_a_storm() {
    let tmp = tempfile::tempdir().unwrap();
    let run = start(&tmp.path().join("db"), GRACE).await;
    die(&run, "one-0", "one").await;
    tokio::time::sleep(GRACE * 3).await;
    let a = run.agent(hello("one-1", "one")).await;
    for s in 1..=40 {
        a.send(request(s, &format!("r{s}"))).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let kinds: Vec<String> = incidents_of(&run, "one")
        .await
        .into_iter()
        .map(|i| i.kind)
        .collect();
    assert_eq!(kinds, vec!["agent_lost".to_string()], "only the one death");
    run.stop().await;
}

#[tokio::test]
async fn agents_restarting_together_then_a_burst_is_a_restart_storm() {
    let tmp = tempfile::tempdir().unwrap();
    let run = start_with(&tmp.path().join("db"), GRACE, storm_policy()).await;
    // Before the outage: one agent serving a trickle of 3 requests.
    let mut old = run.agent(hello("api-old", "api")).await;
    for s in 1..=3 {
        old.send(request(s, &format!("old{s}"))).await;
    }
    old.acks_covering(&[1, 2, 3].into(), |_| {}).await;
    old.close();
    drop(old);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The restart: four replicas at once, each flooded with retried requests.
    let mut agents = replicas(&run, "api", 4).await;
    for (i, a) in agents.iter_mut().enumerate() {
        for s in 1..=10 {
            a.send(request(s, &format!("retry-{i}-{s}"))).await;
        }
        a.acks_covering(&(1..=10).collect(), |_| {}).await;
    }
    let inc = wait_for(&run, "api", "restart_storm")
        .await
        .expect("a restart storm incident");
    assert!(
        inc.summary
            .contains("4 instances of service \"api\" started within"),
        "{}",
        inc.summary
    );
    assert!(
        inc.summary.contains("vs 3 in the 10 s before"),
        "the old agent's trickle is the baseline: {}",
        inc.summary
    );
    let burst: usize = inc
        .summary
        .split(" requests in the 5 s after")
        .next()
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((20..=40).contains(&burst), "{}", inc.summary);
    assert_eq!(
        incidents_of(&run, "api")
            .await
            .iter()
            .filter(|i| i.kind == "restart_storm")
            .count(),
        1,
        "recorded once"
    );
    run.stop().await;
}

#[tokio::test]
async fn simultaneous_starts_with_ordinary_traffic_are_no_storm() {
    let tmp = tempfile::tempdir().unwrap();
    let run = start(&tmp.path().join("db"), GRACE).await;
    let mut agents = Vec::new();
    for i in 0..4 {
        agents.push(run.agent(hello(&format!("calm-{i}"), "calm")).await);
    }
    // 8 requests: under the burst minimum of the default policy.
    for (i, a) in agents.iter_mut().enumerate() {
        for s in 1..=2 {
            a.send(request(s, &format!("r-{i}-{s}"))).await;
        }
        a.acks_covering(&[1, 2].into(), |_| {}).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(incidents_of(&run, "calm").await.is_empty());
    run.stop().await;
}

/// A vLLM under `oomscope run` is four processes with agents that start
/// within seconds (supervisor, API server, engine core, worker), and a test
/// or a client sends its first burst right after: one start, not a storm.
#[tokio::test]
async fn the_processes_of_one_instance_starting_together_are_no_storm() {
    let tmp = tempfile::tempdir().unwrap();
    let run = start_with(&tmp.path().join("db"), GRACE, storm_policy()).await;
    let mut agents = Vec::new();
    for (i, role) in ["supervisor", "api_server", "engine_core", "worker"]
        .into_iter()
        .enumerate()
    {
        let mut h = hello(&format!("vllm-{i}"), "vllm");
        h.role = role.into();
        h.pid = 5000 + i as u32;
        if i > 0 {
            h.instance = "vllm-0".into(); // as `oomscope run` passes it on
        }
        agents.push(run.agent(h).await);
    }
    let api = &mut agents[1];
    for s in 1..=40 {
        api.send(request(s, &format!("burst-{s}"))).await;
    }
    api.acks_covering(&(1..=40).collect(), |_| {}).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        incidents_of(&run, "vllm").await.is_empty(),
        "one instance's processes are one start"
    );
    // The same four as four separate instances (replicas) with the same
    // burst are a storm: the count is what differs.
    let mut replicas = replicas(&run, "replicas", 4).await;
    for s in 1..=40 {
        replicas[0].send(request(s, &format!("r-{s}"))).await;
    }
    replicas[0].acks_covering(&(1..=40).collect(), |_| {}).await;
    assert!(wait_for(&run, "replicas", "restart_storm").await.is_some());
    run.stop().await;
}
