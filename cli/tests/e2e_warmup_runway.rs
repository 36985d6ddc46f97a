//! A leak hunt's polls through a real collector: an agent streams its
//! between-request readings over gRPC in pieces, reconnecting as an agent
//! does, and `oomscope diagnose --agent NAME --json` is read after each. A
//! 300 MB warm-up over 50 requests then flat gets no runway at any poll; a
//! leak served in two bursts around an idle hour gets its runway at the
//! rate while serving.

mod common;

use common::*;
use oomscope_proto::v1 as pb;
use oomscope_testkit::readings::{host_reading, page_jitter as jitter};
use serde_json::Value;

const T0: i64 = 1_793_700_000_000_000_000;
const SEC: i64 = 1_000_000_000;
const MIB: u64 = 1 << 20;
/// A 23.5 GiB host.
const MEM_TOTAL: u64 = 25_232_932_864;
const BASE_RSS: u64 = 500 * MIB;

fn hello(name: &str) -> pb::Hello {
    pb::Hello {
        agent_id: format!("{name}-1"),
        name: name.into(),
        host: "cpu-01".into(),
        pid: 4242,
        role: "api_server".into(),
        runtime: "python".into(),
        start_time_ns: T0,
        ..Default::default()
    }
}

fn reading(seq: u64, time_ns: i64, done: u64, rss: u64, phase: &str) -> pb::AgentMessage {
    let sample = host_reading(time_ns, 4242, rss, MEM_TOTAL, phase, done);
    pb::AgentMessage {
        seq,
        body: Some(pb::agent_message::Body::Sample(sample)),
    }
}

fn causes(d: &Value) -> Vec<&Value> {
    d["causes"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default()
}

fn growth(d: &Value) -> Vec<&Value> {
    causes(d)
        .into_iter()
        .filter(|c| ["leak", "host_growth", "slow_growth"].contains(&c["kind"].as_str().unwrap()))
        .collect()
}

fn has_runway(d: &Value) -> bool {
    let starts = |l: &Value| l.as_str().is_some_and(|l| l.starts_with("runway: "));
    d["evidence"]
        .as_array()
        .is_some_and(|e| e.iter().any(starts))
        || causes(d).iter().any(|c| {
            !c["metrics"]["seconds_to_limit"].is_null()
                || !c["metrics"]["requests_to_limit"].is_null()
                || c["evidence"]
                    .as_array()
                    .is_some_and(|e| e.iter().any(starts))
        })
}

#[test]
fn a_warm_up_has_no_runway_at_any_poll_and_a_leak_between_idle_bursts_runs_at_the_serving_rate() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));

    // 6 MB a request over the first 50 requests at 36 a second, then flat;
    // polled at 20, 60 and 150 requests.
    let at = |i: u64| T0 + SEC + (i as f64 * 1e9 / 36.0) as i64;
    let rss = |i: u64| BASE_RSS + 6_000_000 * i.min(50) + jitter(i);
    let mut sent = 0;
    for poll in [20u64, 60, 150] {
        let messages = (sent + 1..=poll)
            .map(|i| reading(i, at(i), i, rss(i), "after_request"))
            .collect();
        stream(&col.url, hello("warm"), messages);
        sent = poll;
        let d = col.json(&["diagnose", "--agent", "warm"]);
        assert!(!has_runway(&d), "request {poll}: {d:#}");
        let found = growth(&d);
        if poll == 20 {
            assert_eq!(found.len(), 1, "{d:#}");
            let c = found[0];
            assert_eq!(c["kind"], "host_growth");
            assert_eq!(c["metrics"]["possible_warmup"], 1.0, "{c:#}");
            let per_request = c["metrics"]["bytes_per_request"].as_f64().unwrap();
            assert!((per_request - 6e6).abs() < 0.01 * 6e6, "{per_request}");
            assert!(
                c["evidence"][0]
                    .as_str()
                    .unwrap()
                    .starts_with("possible warm-up"),
                "{c:#}"
            );
        }
        if poll == 150 {
            assert!(found.is_empty(), "after the plateau: {d:#}");
        }
    }

    // 550 kB a request: 100 requests at 36/s, an hour idle (a periodic
    // reading every 10 s), 100 more at 36/s.
    let gap = 1e9 / 36.0;
    let leak = |i: u64| BASE_RSS + 550_000 * i + jitter(i);
    let mut messages = Vec::new();
    let mut seq = 0;
    let mut push = |m: &mut Vec<pb::AgentMessage>, t: i64, done: u64, rss: u64, phase: &str| {
        seq += 1;
        m.push(reading(seq, t, done, rss, phase));
    };
    for i in 1..=100u64 {
        push(
            &mut messages,
            T0 + (i as f64 * gap) as i64,
            i,
            leak(i),
            "after_request",
        );
    }
    let idle_from = T0 + (100.0 * gap) as i64;
    for k in 1..=360i64 {
        push(
            &mut messages,
            idle_from + k * 10 * SEC,
            100,
            leak(100),
            "periodic",
        );
    }
    let back = idle_from + 3_600 * SEC;
    for i in 101..=200u64 {
        let t = back + ((i - 100) as f64 * gap) as i64;
        push(&mut messages, t, i, leak(i), "after_request");
    }
    stream(&col.url, hello("bursts"), messages);
    let d = col.json(&["diagnose", "--agent", "bursts"]);
    let found = growth(&d);
    assert_eq!(found.len(), 1, "{d:#}");
    let c = found[0];
    assert_eq!(c["kind"], "host_growth");
    let rate = c["metrics"]["requests_per_s"].as_f64().unwrap();
    assert!((rate - 36.0).abs() < 0.01, "{rate}");
    let left = c["metrics"]["requests_to_limit"].as_f64().unwrap();
    let secs = c["metrics"]["seconds_to_limit"].as_f64().unwrap();
    assert!(
        (secs - left / 36.0).abs() < 1e-3 * secs,
        "{secs} for {left}"
    );
    let first = d["evidence"][0].as_str().unwrap();
    assert!(
        first.starts_with(
            "runway: at 36 requests/s while serving, the 23.5 GiB of MemTotal is gone in about"
        ),
        "{d:#}"
    );
    assert!(
        evidence_text(&d).contains("199 requests completed over 5.5 s of serving; 60 minutes idle"),
        "{d:#}"
    );
}
