//! A dead agent's spool is delivered by another agent on the same host:
//! the collector gets the evidence the dead process could not send, under
//! the dead agent's own id, and records how it ended.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use oomscope_agent_core::pb;
use oomscope_agent_core::recovery::{self, Pass};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::spool::{Origin, Spool, DEFAULT_SPOOL_MAX_BYTES};
use pb::agent_message::Body;

fn agent<'a>(agents: &'a serde_json::Value, id: &str) -> Option<&'a serde_json::Value> {
    agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["hello"]["agent_id"] == id)
}

fn reading(step: u64) -> pb::Sample {
    pb::Sample {
        time_ns: oomscope_agent_core::now_ns(),
        step,
        ..Default::default()
    }
}

fn sample(seq: u64) -> pb::AgentMessage {
    pb::AgentMessage {
        seq,
        body: Some(Body::Sample(reading(seq))),
    }
}

/// A spool as a dead process leaves it: `seqs` appended, `acked` of them acked.
fn orphan(root: &Path, id: &str, collector: Option<&str>, seqs: u64, acked: u64) {
    let mut spool = Spool::open(root, id, DEFAULT_SPOOL_MAX_BYTES).unwrap();
    if let Some(url) = collector {
        let hello = pb::Hello {
            agent_id: id.into(),
            name: id.into(),
            pid: 1,
            ..Default::default()
        };
        spool
            .set_origin(&Origin {
                collector_url: url.into(),
                hello,
            })
            .unwrap();
    }
    for seq in 1..=seqs {
        spool.append(&sample(seq)).unwrap();
    }
    spool.ack(acked).unwrap();
}

#[test]
fn a_sigkilled_agents_spool_is_delivered_by_the_next_agent() {
    let tmp = tempdir();
    let spool = tmp.path().join("spool");
    let spool_arg = spool.to_string_lossy().into_owned();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");

    // No collector yet: the victim spools everything, then is SIGKILLed.
    let mut victim = oomscope()
        .args(["run", "--collector", &url, "--name", "victim"])
        .args([
            "--interval",
            "50ms",
            "--spool",
            &spool_arg,
            "--",
            "sleep",
            "3",
        ])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    victim.kill().unwrap();
    victim.wait().unwrap();

    let ids = Spool::recover(&spool);
    assert_eq!(ids.len(), 1, "one spool left behind: {ids:?}");
    let victim_id = ids[0].clone();
    let left = {
        let mut s = Spool::open(&spool, &victim_id, DEFAULT_SPOOL_MAX_BYTES).unwrap();
        s.pending().unwrap()
    };
    assert!(left.len() >= 10, "1.2 s at 50 ms: {} messages", left.len());
    assert!(
        left.iter()
            .all(|m| !matches!(m.body, Some(Body::Goodbye(_)))),
        "a SIGKILLed supervisor says no Goodbye"
    );

    let col = Collector::start_on(&tmp.path().join("db"), port);
    let rescuer = run(
        &col.url,
        "rescuer",
        &["--spool", &spool_arg],
        &["sleep", "3"],
    );
    assert!(
        rescuer.status.success(),
        "{}",
        String::from_utf8_lossy(&rescuer.stderr)
    );

    let agents = col.json(&["agents"]);
    let v = agent(&agents, &victim_id).unwrap_or_else(|| panic!("victim unknown: {agents:#}"));
    assert_eq!(v["hello"]["name"], "victim");
    assert_eq!(
        v["samples"].as_u64().unwrap() + v["events"].as_u64().unwrap(),
        left.len() as u64,
        "every spooled message arrived once: {v}"
    );
    assert_eq!(v["last_seq"], left.last().unwrap().seq);
    assert_eq!(v["state"], "lost", "{v}");

    let incs = col.incidents_of("victim", 1, Duration::from_secs(5));
    assert_eq!(incs.len(), 1, "{incs:#?}");
    assert_eq!(incs[0]["kind"], "agent_lost");
    let summary = incs[0]["summary"].as_str().unwrap();
    assert!(summary.contains("delivered"), "{summary}");

    assert_settled(&spool, &victim_id, left.last().unwrap().seq);
}

/// Delivered: nothing pending, no segment left on disk, and the seq
/// high-water mark kept, so the same id would go on above it.
fn assert_settled(root: &Path, id: &str, last_seq: u64) {
    let s = Spool::open(root, id, DEFAULT_SPOOL_MAX_BYTES).unwrap();
    assert!(s.is_settled(), "{id}: everything acked");
    assert_eq!(s.stats().segments, 0, "{id}: acked segments are deleted");
    assert_eq!(s.next_seq(), last_seq + 1, "{id}");
}

#[test]
fn one_pass_delivers_the_dead_and_leaves_the_rest() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let root = tmp.path().join("spool");
    orphan(&root, "settled", Some(&col.url), 3, 3);
    orphan(&root, "elsewhere", Some("http://127.0.0.1:1"), 2, 0);
    orphan(&root, "anonymous", None, 2, 0);
    orphan(&root, "dead", Some(&col.url), 4, 1);
    orphan(&root, "alive", Some(&col.url), 2, 0);
    let _held = Spool::open(&root, "alive", DEFAULT_SPOOL_MAX_BYTES).unwrap();
    // A clean exit whose Goodbye never reached the collector.
    orphan(&root, "exited", Some(&col.url), 2, 0);
    {
        let mut s = Spool::open(&root, "exited", DEFAULT_SPOOL_MAX_BYTES).unwrap();
        let goodbye = pb::AgentMessage {
            seq: 3,
            body: Some(Body::Goodbye(pb::Goodbye {
                reason: "exit".into(),
                exit_code: 0,
            })),
        };
        s.append(&goodbye).unwrap();
    }

    let cfg = ReporterConfig::new(col.url.clone());
    let pass = recovery::recover(&cfg, &root, "me", &|| false);
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    assert_eq!(
        Pass {
            delivered: sorted(pass.delivered),
            settled: sorted(pass.settled),
            left: sorted(pass.left),
        },
        Pass {
            delivered: vec!["dead".into(), "exited".into()],
            settled: vec!["settled".into()],
            left: vec!["alive".into(), "anonymous".into(), "elsewhere".into()],
        }
    );
    assert_settled(&root, "dead", 4);
    assert_settled(&root, "exited", 3);
    for (id, pending) in [("anonymous", 2), ("elsewhere", 2)] {
        let mut s = Spool::open(&root, id, DEFAULT_SPOOL_MAX_BYTES).unwrap();
        assert_eq!(
            s.pending().unwrap().len(),
            pending,
            "{id} is left as it was"
        );
    }

    let agents = col.json(&["agents"]);
    assert!(
        agent(&agents, "settled").is_none(),
        "nothing was sent for it"
    );
    assert!(agent(&agents, "elsewhere").is_none());
    let dead = agent(&agents, "dead").unwrap();
    assert_eq!(dead["samples"], 3, "seqs 2..=4, above its ack floor");
    assert_eq!(dead["state"], "lost");
    let exited = agent(&agents, "exited").unwrap();
    assert_eq!(exited["samples"], 2);
    assert_eq!(exited["state"], "disconnected", "its Goodbye arrived");
    assert!(col.incidents_of("exited", 1, Duration::ZERO).is_empty());
    assert_eq!(col.incidents_of("dead", 1, Duration::from_secs(5)).len(), 1);
}

#[test]
fn an_agent_already_lost_gets_its_late_evidence_and_no_second_incident() {
    let tmp = tempdir();
    let db = tmp.path().join("db");
    let mut col = Collector::start(&db);
    let port = col.port;
    let root = tmp.path().join("spool");
    let mut cfg = ReporterConfig::new(col.url.clone());
    cfg.spool_dir = Some(root.clone());
    cfg.backoff_max = Duration::from_millis(200);
    let hello = pb::Hello {
        agent_id: "late".into(),
        name: "late".into(),
        ..Default::default()
    };
    let reporter = Reporter::start(cfg.clone(), hello);
    for step in 1..=5 {
        reporter.send_sample(reading(step));
    }
    assert!(
        reporter.flush(Duration::from_secs(10)),
        "{:?}",
        reporter.stats()
    );

    // The collector goes down; the agent keeps sampling into its spool, then
    // dies without a Goodbye (dropping the reporter sends none).
    col.kill();
    for step in 6..=12 {
        reporter.send_sample(reading(step));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while reporter.stats().spooled < 12 {
        assert!(Instant::now() < deadline, "{:?}", reporter.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(reporter);

    // Back up, the collector gives the agent its grace and records it lost.
    let col = Collector::start_on(&db, port);
    let incs = col.incidents_of("late", 1, Duration::from_secs(10));
    assert_eq!(incs.len(), 1, "{incs:#?}");
    let before = agent(&col.json(&["agents"]), "late").unwrap()["samples"].clone();
    assert_eq!(before, 5);

    let pass = recovery::recover(&cfg, &root, "me", &|| false);
    assert_eq!(pass.delivered, vec!["late".to_string()], "{pass:?}");
    let agents = col.json(&["agents"]);
    let late = agent(&agents, "late").unwrap();
    assert_eq!(late["samples"], 12, "the 7 samples from the outage arrived");
    assert_eq!(late["state"], "lost");
    let incs = col.incidents_of("late", 2, Duration::from_secs(2));
    assert_eq!(incs.len(), 1, "still one agent_lost: {incs:#?}");
}
