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
        "generator_cpu_us_per_sample",
    ] {
        assert!(figures.get(field).is_some(), "{field} missing: {figures}");
    }
    // Unpaced, no sample has a time it was due.
    assert!(figures["p99_send_late_ms"].is_null(), "{figures}");
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
fn untimed(s: pb::Sample) -> pb::Sample {
    pb::Sample {
        time_ns: 0,
        ..as_sent(s)
    }
}

/// A stored sample as its sender gave it: less the backlog the reporter
/// stamps on the samples it takes (`Sample.backlog`).
fn as_sent(mut s: pb::Sample) -> pb::Sample {
    s.backlog = None;
    s
}

/// One agent's whole timeline, or `max_points` whole samples picked
/// evenly across it (each then rebuilt from its keyframe alone).
fn stored_samples(url: &str, agent: &str, max_points: u32) -> Vec<(u64, pb::Sample)> {
    with_channel(url, |ch| async move {
        pb::query_service_client::QueryServiceClient::new(ch)
            .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
            .timeline(pb::TimelineRequest {
                agent: agent.into(),
                max_points,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
    })
    .samples
    .into_iter()
    .map(|t| (t.seq, untimed(t.sample.unwrap())))
    .collect()
}

/// The store keeps each capture's counters as changes in chains of
/// `KEYFRAME_INTERVAL` (schema v5, collector/src/store/counters.rs); every
/// read gives back the complete values, field by field as the capture has
/// them: the whole timeline, samples picked mid-chain, and both again after
/// the collector restarts (its writer then holds no chain).
#[test]
fn every_capture_replayed_with_changes_stores_the_same_values() {
    use oomscope_collector::store::KEYFRAME_INTERVAL;
    let tmp = tempdir();
    let db = tmp.path().join("db");
    let mut col = Collector::start(&db);
    let mut sent_as_changes = 0;
    let mut expected_of = Vec::new();
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
        expected_of.push((name, expected));
    }
    assert!(
        sent_as_changes > 100,
        "the captures went out as changes only {sent_as_changes} times"
    );
    let longest = expected_of.iter().map(|(_, e)| e.len()).max().unwrap();
    assert!(
        longest > KEYFRAME_INTERVAL as usize,
        "no capture crosses keyframes ({longest} samples)"
    );
    let check = |col: &Collector, when: &str| {
        for (name, expected) in &expected_of {
            let stored = stored_samples(&col.url, name, 0);
            assert_eq!(stored.len(), expected.len(), "{name} {when}");
            for (i, ((_, got), want)) in stored.iter().zip(expected).enumerate() {
                assert!(
                    got.allocator.iter().all(|a| a.raw_changes.is_none()),
                    "{name} sample {i} {when}: returned with changes"
                );
                assert_eq!(got, want, "{name} sample {i} {when}");
            }
            // A few picked across the history: each rebuilt on its own.
            let by_seq: std::collections::HashMap<u64, &pb::Sample> =
                stored.iter().map(|(seq, s)| (*seq, s)).collect();
            let picked = stored_samples(&col.url, name, 7);
            assert!(picked.len() >= 2.min(expected.len()), "{name} {when}");
            for (seq, got) in &picked {
                assert_eq!(
                    Some(&got),
                    by_seq.get(seq),
                    "{name} seq {seq} picked {when}"
                );
            }
        }
    };
    check(&col, "as stored");
    col.kill();
    let col = Collector::start_on(&db, col.port);
    check(&col, "after a restart");

    // Stored as chains of changes, each sample under 1 KB on average.
    let conn = rusqlite::Connection::open(&db).unwrap();
    let (samples, changed, chains, bytes): (i64, i64, i64, i64) = conn
        .query_row(
            "SELECT count(*), count(whole_len), count(DISTINCT agent_id || '/' || key_seq),
                    sum(length(body)) FROM messages WHERE kind = 'sample' AND agent_id IN
                    (SELECT agent_id FROM agents WHERE name LIKE 'delta-%')",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert!(
        changed > samples / 2,
        "{changed} of {samples} stored as changes"
    );
    assert!(
        chains >= samples / KEYFRAME_INTERVAL as i64,
        "{chains} chains for {samples} samples: longer than {KEYFRAME_INTERVAL}"
    );
    assert!(
        bytes / samples < 1024,
        "{} B a stored sample",
        bytes / samples
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
    assert!(
        stored.iter().all(|s| s.backlog.is_some()),
        "the reporter states its backlog on each sample"
    );
    let stored: Vec<pb::Sample> = stored.into_iter().map(as_sent).collect();
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
