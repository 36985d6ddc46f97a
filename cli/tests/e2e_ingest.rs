//! Ingest at load and on the wire (#15): `oomscope bench ingest` against a
//! real collector stores every sample exactly once; allocator counters sent as
//! changes come back complete, field by field, for every shipped capture; and
//! a reconnect starts its stream with complete counters.

mod common;

use std::time::Duration;

use common::*;
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_proto::delta;
use oomscope_proto::v1 as pb;
use oomscope_replay::capture;
use pb::agent_message::Body;

#[test]
fn bench_ingest_stores_every_sample_once_and_reports_every_field() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // Only the test's own collector, never one from the environment.
    let out = std::process::Command::new(bin())
        .env_remove("OOMSCOPE_COLLECTOR")
        .args(["bench", "ingest", "--collector", &col.url])
        .args(["--agents", "2", "--samples", "2000", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let figures: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "acked_samples_per_s",
        "p50_ack_ms",
        "p99_ack_ms",
        "collector_cpu_us_per_sample",
        "agents",
        "samples",
    ] {
        assert!(figures.get(field).is_some(), "{field} missing: {figures}");
    }
    assert_eq!(figures["agents"], 2);
    assert_eq!(figures["samples"], 2000);
    assert!(figures["acked_samples_per_s"].as_f64().unwrap() > 0.0);
    let (p50, p99) = (
        figures["p50_ack_ms"].as_f64().unwrap(),
        figures["p99_ack_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < p50 && p50 <= p99, "{figures}");
    // The collector is a process on this host: its CPU is known.
    assert!(
        figures["collector_cpu_us_per_sample"].as_f64().is_some(),
        "{figures}"
    );

    let agents = col.json(&["agents"]);
    let bench: Vec<&serde_json::Value> = agents
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["hello"]["name"] == "bench-ingest")
        .collect();
    assert_eq!(bench.len(), 2, "{agents}");
    for a in bench {
        // Seqs 1..=2000 stored once each, then the Goodbye at 2001.
        assert_eq!(a["samples"], 2000, "{a}");
        assert_eq!(a["last_seq"], 2001, "{a}");
        assert_eq!(a["state"], "disconnected", "{a}");
    }
}

/// A stored sample as the capture has it: the collector keeps the agent's
/// clock, the replay rebases it, so times are left out.
fn untimed(mut s: pb::Sample) -> pb::Sample {
    s.time_ns = 0;
    s
}

#[test]
fn every_capture_replayed_with_changes_stores_the_same_values() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let mut sent_as_changes = 0;
    for path in torch_h200::paths() {
        let cap = capture::load(&path, 0).unwrap();
        let expected: Vec<pb::Sample> = cap.samples().cloned().map(untimed).collect();
        // What the reporter's encoder does with this stream.
        let mut enc = delta::Encoder::new();
        for m in cap.messages() {
            if let Some(Body::Sample(s)) = enc.encode(m).body {
                sent_as_changes += s
                    .allocator
                    .iter()
                    .filter(|a| a.raw_changes.is_some())
                    .count();
            }
        }
        let name = format!("delta-{}", cap.scenario);
        replay(&col, &path, &name);
        let stored: Vec<pb::Sample> = timeline(&col.url, &name)
            .samples
            .into_iter()
            .map(|t| untimed(t.sample.unwrap()))
            .collect();
        assert_eq!(stored.len(), expected.len(), "{}", cap.scenario);
        for (i, (got, want)) in stored.iter().zip(&expected).enumerate() {
            assert!(
                got.allocator.iter().all(|a| a.raw_changes.is_none()),
                "{} sample {i}: stored with changes",
                cap.scenario
            );
            assert_eq!(got, want, "{} sample {i}", cap.scenario);
        }
    }
    assert!(
        sent_as_changes > 100,
        "the captures went out as changes only {sent_as_changes} times"
    );
}

/// `n` of one capture's samples with allocator counters (again from the
/// start when it has fewer), a millisecond apart.
fn samples_of(scenario: &str, n: usize) -> Vec<pb::Sample> {
    let cap = capture::load(&fixture(scenario), 0).unwrap();
    let source: Vec<&pb::Sample> = cap.samples().filter(|s| !s.allocator.is_empty()).collect();
    (0..n)
        .map(|i| pb::Sample {
            time_ns: 1_000_000_000 + i as i64 * 1_000_000,
            ..source[i % source.len()].clone()
        })
        .collect()
}

#[test]
fn a_sample_after_a_reconnect_is_complete() {
    let tmp = tempdir();
    let db = tmp.path().join("db");
    let mut col = Collector::start(&db);
    let port = col.port;
    let samples = samples_of("hf_varied_no_leak.json.gz", 20);
    let reporter = Reporter::start(
        ReporterConfig {
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_millis(200),
            ..ReporterConfig::new(&col.url)
        },
        pb::Hello {
            agent_id: format!("reconnect-{}", std::process::id()),
            name: "reconnect".into(),
            ..Default::default()
        },
    );
    for s in &samples[..10] {
        assert!(reporter.send_sample(s.clone()));
    }
    assert!(reporter.flush(Duration::from_secs(30)), "first half acked");
    // A new collector process: a new stream, which knows no earlier sample.
    col.kill();
    let col = Collector::start_on(&db, port);
    for s in &samples[10..] {
        assert!(reporter.send_sample(s.clone()));
    }
    assert!(reporter.flush(Duration::from_secs(30)), "second half acked");
    let stats = reporter.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!(stats.rejected, 0, "{stats:?}");
    let stored: Vec<pb::Sample> = timeline(&col.url, "reconnect")
        .samples
        .into_iter()
        .map(|t| t.sample.unwrap())
        .collect();
    assert_eq!(stored, samples);
}

#[test]
fn the_collector_rejects_changes_that_open_a_stream() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let samples = samples_of("hf_varied_no_leak.json.gz", 2);
    // An encoder that carried on from an earlier stream: its second sample
    // is changes against a sample this stream never had.
    let mut enc = delta::Encoder::new();
    let message = |seq: u64, s: &pb::Sample| pb::AgentMessage {
        seq,
        body: Some(Body::Sample(s.clone())),
    };
    enc.encode(message(1, &samples[0]));
    let orphan = enc.encode(message(1, &samples[1]));
    assert!(matches!(&orphan.body, Some(Body::Sample(s)) if s.allocator[0].raw_changes.is_some()));
    let replies = send_raw(&col.url, "orphan", vec![orphan]);
    let reason = replies
        .iter()
        .find_map(|r| match &r.body {
            Some(pb::collector_message::Body::Reject(r)) => Some(r.reason.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no reject: {replies:?}"));
    assert!(reason.contains("must be complete"), "{reason}");
    assert!(timeline(&col.url, "orphan").samples.is_empty());
}

/// Opens a stream as agent `name`, sends its Hello and `messages`, and
/// returns the collector's replies until it has answered each message.
fn send_raw(url: &str, name: &str, messages: Vec<pb::AgentMessage>) -> Vec<pb::CollectorMessage> {
    use oomscope_testkit::agent_stream::{block_on, AgentStream};
    block_on(async {
        let hello = pb::Hello {
            agent_id: format!("{name}-{}", std::process::id()),
            name: name.into(),
            ..Default::default()
        };
        let n = messages.len();
        let mut agent = AgentStream::connect(url, hello, messages).await;
        let mut replies = Vec::new();
        while replies.len() < n {
            let next = tokio::time::timeout(Duration::from_secs(30), agent.replies.message()).await;
            match next.expect("the collector answers") {
                Ok(Some(r)) => replies.push(r),
                _ => break,
            }
        }
        replies
    })
}
