//! The Rust agent's request path through agent-core's boundary ring, against
//! a real `oomscope collector` process (loopback, temp SQLite db): requests
//! as fast as one thread can make them cost at most 20 boundary messages a
//! second, every request end still reaches the timeline as a point with its
//! two request events, and the leak verdict still reads bytes per request.
//!
//! Needs the `oomscope` binary next to this test's target directory
//! (`cargo build -p oomscope-cli`), or `OOMSCOPE_BIN`.

use std::time::{Duration, Instant};

use oomscope_agent_cuda::{pb, AgentConfig, CudaAgent, Simulated, Tag, TrackingPool};
use oomscope_testkit::cli::{own_collector, query_json};
use oomscope_testkit::CollectorProcess;
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// Requests driven as fast as one thread goes: far past one message's
/// 200, and within what one timeline reply holds whole.
const FAST: u64 = 2000;
/// Then requests over 1 ms apart (at most 50 a message): kept whole.
const PACED: u64 = 200;
const REQUESTS: u64 = FAST + PACED;
/// What the leaking pool keeps per request (one block each).
const LEAK: u64 = MIB;

/// One agent per process: the tests that start one take turns.
static ONE_AGENT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's own collector, over a temp db (kept while the dir lives).
fn collector() -> (tempfile::TempDir, CollectorProcess) {
    let dir = tempfile::tempdir().unwrap();
    let collector = own_collector(&dir.path().join("oomscope.db"));
    (dir, collector)
}

#[test]
fn requests_at_any_rate_cost_at_most_20_messages_a_second_and_each_end_is_a_point() {
    let _turn = ONE_AGENT.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, collector) = collector();
    let pool = TrackingPool::new(Simulated::new(64 << 30));
    let mut cfg = AgentConfig::new("ring");
    cfg.collector_url = Some(collector.url.clone());
    let started = Instant::now();
    let agent = CudaAgent::start_with_pool(cfg, &pool).unwrap();
    let reporter = agent.reporter().clone();

    // As fast as one thread goes, then paced: a begin, a block kept (the
    // leak), a decode-step sample, the context a server sets, an end.
    let mut kept = Vec::new();
    let mut driven = Duration::ZERO;
    for i in 1..=REQUESTS {
        if i > FAST {
            if driven.is_zero() {
                driven = started.elapsed();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let id = i.to_string();
        agent.request_boundary(pb::RequestBoundary {
            request_id: id.clone(),
            start: true,
            prompt_tokens: 8,
            ..Default::default()
        });
        kept.push(pool.alloc::<u8>(LEAK as usize, Tag::Request(i)).unwrap());
        agent.set_context(|c| {
            c.phase = "decode".into();
            c.request_id = id.clone();
        });
        agent.sample();
        agent.set_context(|c| {
            c.phase = "after_request".into();
            c.requests_done = i;
        });
        agent.request_boundary(pb::RequestBoundary {
            request_id: id,
            start: false,
            prompt_tokens: 8,
            output_tokens: 4,
            ..Default::default()
        });
    }
    // Let a few more boundary slots and periodic ticks pass, then flush.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        agent.shutdown("done", 0, Duration::from_secs(20)),
        "all acked"
    );
    let lifetime = started.elapsed().as_secs_f64();
    let acked = reporter.stats().acked as f64;
    // 20 boundary messages a second, one more for the last, the periodic
    // samples (1 s), the Hello and the Goodbye.
    let bound = 21.0 * lifetime.ceil() + (lifetime.ceil() + 1.0) + 2.0;
    eprintln!(
        "{FAST} requests in {driven:?} ({:.0}/s), {PACED} paced; {acked} messages acked in {lifetime:.2} s (bound {bound})",
        FAST as f64 / driven.as_secs_f64()
    );
    assert!(acked <= bound, "{acked} messages acked, bound {bound}");

    // Every end is in the timeline: kept whole (a point and its two
    // request events), or, past a message's 200, counted as thinned on
    // the message that carried it (the ring keeps the extremes). The
    // timeline expands the newest batches into points and events within
    // its reply budget; older ones it shows as sent, readings whole.
    let t = query_json(&collector.url, &["timeline", "ring", "--max-points", "0"]);
    let samples = t["samples"].as_array().unwrap();
    let raw: Vec<&Value> = samples
        .iter()
        .filter_map(|s| s["sample"]["requests"]["readings"].as_array())
        .flatten()
        .collect();
    let id = |b: &Value| -> u64 { b["request_id"].as_str().unwrap().parse().unwrap() };
    let boundaries = |start: bool| -> Vec<u64> {
        let mut ids: Vec<u64> = t["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| &e["event"]["request"])
            .chain(raw.iter().map(|r| &r["boundary"]))
            .filter(|b| b["start"].as_bool() == Some(start))
            .map(id)
            .collect();
        ids.sort();
        ids
    };
    let thinned: u64 = samples
        .iter()
        .filter_map(|s| s["sample"]["requests"]["thinned_requests"].as_u64())
        .sum();
    // Points: the samples at a request end, and the ends a batch not
    // expanded carries with their context (its newest is the batch itself).
    let mut points: Vec<u64> = samples
        .iter()
        .map(|s| &s["sample"]["context"])
        .chain(raw.iter().map(|r| &r["context"]))
        .filter(|c| c["phase"] == "after_request")
        .map(|c| c["requests_done"].as_u64().unwrap())
        .collect();
    points.sort();
    // A periodic sample after the last end repeats its context.
    points.dedup();
    let (begins, ends) = (boundaries(true), boundaries(false));
    eprintln!(
        "{} ends whole ({} in batches not expanded), {thinned} thinned, {} end points",
        ends.len(),
        raw.iter()
            .filter(|r| r["boundary"]["start"] == false)
            .count(),
        points.len(),
    );
    assert_eq!(
        ends.len() as u64 + thinned,
        REQUESTS,
        "ends whole + thinned"
    );
    // (A periodic sample between two requests repeats a context too.)
    assert!(
        ends.iter().all(|e| points.binary_search(e).is_ok()),
        "each end kept whole is a point, at its request"
    );
    // The first paced ones may share the burst's last message (thinned
    // with it); the later half, over 100 ms after the burst, is whole.
    let later: Vec<u64> = (REQUESTS - PACED / 2 + 1..=REQUESTS).collect();
    assert!(ends.ends_with(&later), "paced requests are kept whole");
    // A begin went whole in an earlier message than its end, which a later
    // one may have thinned: begins are a superset of the ends, each once.
    assert!(
        ends.iter().all(|e| begins.binary_search(e).is_ok()),
        "each end kept whole has its begin"
    );
    assert!(begins.windows(2).all(|w| w[0] < w[1]), "each begin once");
    assert!(ends.contains(&REQUESTS), "the newest end is always kept");

    // The leak verdict: one block per request, read from the ends' points.
    let d = query_json(&collector.url, &["diagnose", "--agent", "ring"]);
    let leak = d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == "leak")
        .unwrap_or_else(|| panic!("no leak cause in {d:#}"));
    let per_request = leak["metrics"]["bytes_per_request"].as_f64().unwrap();
    assert!(
        (per_request - LEAK as f64).abs() < 0.02 * LEAK as f64,
        "bytes_per_request {per_request} against {LEAK} kept per request"
    );
    drop(kept);
}

#[test]
fn an_oom_goes_at_once_after_the_requests_the_ring_held() {
    let _turn = ONE_AGENT.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, collector) = collector();
    let pool = TrackingPool::new(Simulated::new(256 * MIB));
    let mut cfg = AgentConfig::new("ring-oom");
    cfg.collector_url = Some(collector.url.clone());
    let agent = CudaAgent::start_with_pool(cfg, &pool).unwrap();
    let mut kept = Vec::new();
    for i in 1..=5u64 {
        agent.request_boundary(pb::RequestBoundary {
            request_id: i.to_string(),
            start: true,
            ..Default::default()
        });
        kept.push(pool.alloc::<u8>(MIB as usize, Tag::Request(i)).unwrap());
        agent.request_boundary(pb::RequestBoundary {
            request_id: i.to_string(),
            ..Default::default()
        });
    }
    // Well within the ring's spacing of the last end: the OOM hook sends
    // what waits, then the OOM, and waits for its ack.
    assert!(pool
        .alloc::<u8>(512 * MIB as usize, Tag::Activation)
        .is_err());
    // No shutdown, no wait: the OOM and the requests before it are stored.
    let t = query_json(
        &collector.url,
        &["timeline", "ring-oom", "--max-points", "0"],
    );
    let events = t["events"].as_array().unwrap();
    let oom = events
        .iter()
        .find(|e| !e["event"]["oom"].is_null())
        .unwrap_or_else(|| panic!("no OOM event in {t:#}"));
    let oom_seq = oom["seq"].as_u64().unwrap();
    let mut ends: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| e["event"]["request"]["start"] == false)
        .map(|e| {
            let id = e["event"]["request"]["request_id"].as_str().unwrap();
            (id.parse().unwrap(), e["seq"].as_u64().unwrap())
        })
        .collect();
    ends.sort();
    assert_eq!(
        ends.iter().map(|e| e.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5],
        "every end before the OOM is stored"
    );
    assert!(
        ends.iter().all(|&(_, seq)| seq < oom_seq),
        "the ends went ahead of the OOM (seq {oom_seq}): {ends:?}"
    );
    drop(kept);
    // The next test's agent may start.
    agent.shutdown("done", 0, Duration::from_millis(100));
}
