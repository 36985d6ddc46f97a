//! The query verbs as a new user meets them, against a real collector:
//! `diagnose NAME` with an agent's name, and `timeline`'s text with a
//! serving runtime's context and a Python server's many gc collections.

mod common;

use std::process::Output;
use std::time::Duration;

use common::*;
use oomscope_proto::v1 as pb;

/// `oomscope ARGS... --collector URL`, its output whatever the status.
fn verb(col: &Collector, args: &[&str]) -> Output {
    oomscope()
        .args(args)
        .args(["--collector", &col.url])
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// What a diagnosis says, without the parts that may differ between two
/// asks of the same evidence.
fn verdict(d: &serde_json::Value) -> serde_json::Value {
    serde_json::json!([
        d["incident"],
        d["agent"],
        d["domain"],
        d["trigger"],
        d["causes"],
        d["fixes"]
    ])
}

#[test]
fn diagnose_takes_an_agent_where_no_incident_has_the_name() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // One agent that died of a device OOM (an incident), one that leaked without failing.
    replay(
        &col,
        &fixture("kv_concurrency_oom.json"),
        "kv_concurrency_oom",
    );
    replay(&col, &fixture("leak_retained.json"), "leak_retained");
    let incidents = col.incidents_of("kv_concurrency_oom", 1, Duration::from_secs(10));
    let id = incidents[0]["id"].as_str().unwrap().to_string();

    // An agent's name alone is `--agent NAME`: its timeline, or its latest incident.
    let by_flag = col.json(&["diagnose", "--agent", "leak_retained"]);
    assert_eq!(by_flag["causes"][0]["kind"], "leak", "{by_flag:#}");
    let by_name = col.json(&["diagnose", "leak_retained"]);
    assert_eq!(verdict(&by_name), verdict(&by_flag));
    let by_name = col.json(&["diagnose", "kv_concurrency_oom"]);
    assert_eq!(by_name["incident"], id.as_str(), "{by_name:#}");
    assert_eq!(by_name["domain"], "gpu_vram");
    // An agent's id too, and the text rendering.
    let agents = col.json(&["agents"]);
    let agent_id = agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["hello"]["name"] == "leak_retained")
        .expect("the replayed agent")["hello"]["agent_id"]
        .as_str()
        .unwrap()
        .to_string();
    let by_id = col.json(&["diagnose", &agent_id]);
    assert_eq!(verdict(&by_id), verdict(&by_flag));
    assert!(col.text(&["diagnose", "leak_retained"]).contains("leak"));
    // With --agent as well, the same agent is no conflict.
    let both = col.json(&["diagnose", "leak_retained", "--agent", "leak_retained"]);
    assert_eq!(verdict(&both), verdict(&by_flag));

    // An incident id is still an incident.
    let by_id = col.json(&["diagnose", &id]);
    assert_eq!(by_id["incident"], id.as_str());

    // An incident id that no incident has stays an error, never an agent's timeline.
    let out = verb(&col, &["diagnose", "inc-000099"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr(&out).contains("no incident \"inc-000099\"")
            && stderr(&out).contains("oomscope incidents"),
        "{}",
        stderr(&out)
    );
    // A name that is neither says both.
    let out = verb(&col, &["diagnose", "no-such-server"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr(&out).contains("no incident or agent \"no-such-server\""),
        "{}",
        stderr(&out)
    );
    // Two different agents named at once is a question, not a guess.
    let out = verb(
        &col,
        &["diagnose", "leak_retained", "--agent", "kv_concurrency_oom"],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr(&out).contains("\"leak_retained\"") && stderr(&out).contains("--agent"),
        "{}",
        stderr(&out)
    );
}

/// 2026-11-03T10:00:00Z, on a minute's start.
const T0: i64 = 1_793_700_000_000_000_000;
const SEC: i64 = 1_000_000_000;
const GIB: u64 = 1 << 30;

fn sample(seq: u64, time_ns: i64, context: Option<pb::RequestContext>) -> pb::AgentMessage {
    pb::AgentMessage {
        seq,
        body: Some(pb::agent_message::Body::Sample(pb::Sample {
            time_ns,
            process: Some(pb::ProcessMemory {
                pid: 4242,
                vm_rss_bytes: 2 * GIB,
                ..Default::default()
            }),
            context,
            ..Default::default()
        })),
    }
}

fn gc(seq: u64, time_ns: i64, generation: i32, collected: u64, ms: u64) -> pb::AgentMessage {
    pb::AgentMessage {
        seq,
        body: Some(pb::agent_message::Body::Event(pb::Event {
            time_ns,
            kind: Some(pb::event::Kind::Gc(pb::GcCollection {
                generation,
                collected,
                uncollectable: 0,
                duration_ns: ms * 1_000_000,
            })),
        })),
    }
}

fn hello(name: &str) -> pb::Hello {
    pb::Hello {
        agent_id: format!("{name}-1"),
        name: name.into(),
        host: "gpu-01".into(),
        pid: 4242,
        role: "api_server".into(),
        runtime: "pytorch".into(),
        ..Default::default()
    }
}

/// The text's header and its lines that start with a sample's time.
fn header_and_rows(text: &str) -> (String, Vec<String>) {
    let header = text
        .lines()
        .find(|l| l.starts_with("TIME"))
        .unwrap_or_else(|| panic!("no header in {text}"))
        .to_string();
    let rows = text
        .lines()
        .filter(|l| l.starts_with("2026-"))
        .map(str::to_string)
        .collect();
    (header, rows)
}

/// The cell of `row` under `column` of `header` (columns are right-aligned).
fn cell<'a>(header: &str, row: &'a str, column: &str) -> &'a str {
    let end = header
        .find(column)
        .unwrap_or_else(|| panic!("no {column} in {header}"))
        + column.len();
    let start = header[..end - column.len()].trim_end().len();
    row.get(start..end).unwrap_or_default().trim()
}

#[test]
fn timeline_text_shows_the_serving_context_and_folds_gc_collections() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));

    // vLLM's context: its pool full with requests waiting and preempted.
    let full = pb::RequestContext {
        active_sequences: 5,
        queued: 150,
        kv_cache_bytes: GIB,
        kv_cache_capacity_bytes: GIB,
        numbers: [
            ("kv_cache_usage".to_string(), 1.0),
            ("preemptions".to_string(), 7.0),
        ]
        .into(),
        ..Default::default()
    };
    let mut messages = vec![sample(1, T0, None), sample(2, T0 + SEC, Some(full))];
    // 40 collections in the first minute, after the second sample...
    let mut seq = 3;
    for i in 0..40u64 {
        let generation = if i % 10 == 9 { 2 } else { 0 };
        messages.push(gc(
            seq,
            T0 + 2 * SEC + i as i64 * SEC,
            generation,
            100 + i,
            1 + i % 7,
        ));
        seq += 1;
    }
    messages.push(sample(seq, T0 + 50 * SEC, None));
    // ...and one in the next.
    messages.push(gc(seq + 1, T0 + 65 * SEC, 1, 12, 3));
    stream(&col.url, hello("vllm-ctx"), messages);

    let text = col.text(&["timeline", "vllm-ctx"]);
    let (header, rows) = header_and_rows(&text);
    for column in ["KV USE", "KV CACHE", "ACTIVE", "QUEUED", "PREEMPT"] {
        assert!(header.contains(column), "{column}: {text}");
    }
    let samples: Vec<&String> = rows.iter().filter(|r| !r.contains(" * ")).collect();
    assert_eq!(samples.len(), 3, "{text}");
    let at = |row: &str, column: &str| cell(&header, row, column).to_string();
    assert_eq!(
        ["KV USE", "KV CACHE", "ACTIVE", "QUEUED", "PREEMPT"].map(|c| at(samples[1], c)),
        ["100.0%", "1.00 GiB", "5", "150", "7"],
        "{text}"
    );
    // A sample without a context has none to show.
    assert_eq!(
        ["KV USE", "KV CACHE", "ACTIVE", "QUEUED", "PREEMPT"].map(|c| at(samples[0], c)),
        ["-", "-", "-", "-", "-"],
        "{text}"
    );

    // One line for the minute's 40 collections, one for the next minute's one.
    let gcs: Vec<&String> = rows.iter().filter(|r| r.contains("* gc")).collect();
    assert_eq!(gcs.len(), 2, "{text}");
    let collected: u64 = (0..40).map(|i| 100 + i).sum();
    for part in [
        "gc x40 ",
        "gen0 36, gen2 4",
        &format!("collected {collected}"),
        "longest 7.00 ms",
        "to 10:00:41.000Z",
    ] {
        assert!(gcs[0].contains(part), "{part:?} in {}", gcs[0]);
    }
    assert!(gcs[1].contains("gc gen1 collected 12"), "{}", gcs[1]);
    // Each line in time order among the samples.
    let line_of = |needle: &str| text.lines().position(|l| l.contains(needle)).unwrap();
    assert!(
        line_of(&samples[1][..]) < line_of("gc x40")
            && line_of("gc x40") < line_of(&samples[2][..])
    );
    assert!(line_of(&samples[2][..]) < line_of("gc gen1"));

    // An agent whose samples carry no serving context keeps the plain columns.
    let phase_only = pb::RequestContext {
        phase: "load".into(),
        ..Default::default()
    };
    stream(
        &col.url,
        hello("plain"),
        vec![sample(1, T0, None), sample(2, T0 + SEC, Some(phase_only))],
    );
    let text = col.text(&["timeline", "plain"]);
    let (header, _) = header_and_rows(&text);
    assert!(
        !header.contains("KV") && !header.contains("QUEUED") && !header.contains("PREEMPT"),
        "{text}"
    );
}

/// `agents` and `incidents` filters: each keeps what matches and drops
/// what does not, on an incident and agent made by a real `run`.
#[test]
fn agents_and_incidents_filter_by_since_domain_cause_and_host() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let out = run(&col.url, "filtered", &[], &["sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(137), "{}", stderr(&out));
    let inc = col.incidents_of("filtered", 1, Duration::from_secs(10))[0].clone();
    let (domain, cause) = (
        inc["domain"].as_str().unwrap().to_string(),
        inc["kind"].as_str().unwrap().to_string(),
    );
    let agents = col.json(&["agents"]);
    let host = agents[0]["hello"]["host"].as_str().unwrap().to_string();
    assert!(!host.is_empty(), "{agents}");
    let count = |args: &[&str]| col.json(args).as_array().unwrap().len();

    assert_eq!(count(&["agents", "--host", &host]), 1);
    assert_eq!(count(&["agents", "--host", "no-such-host"]), 0);
    assert_eq!(count(&["agents", "--since", "1h"]), 1);
    assert_eq!(count(&["incidents", "--domain", &domain]), 1);
    assert_eq!(count(&["incidents", "--domain", "no_such_domain"]), 0);
    assert_eq!(count(&["incidents", "--cause", &cause]), 1);
    assert_eq!(count(&["incidents", "--cause", "no_such_cause"]), 0);
    assert_eq!(count(&["incidents", "--host", &host, "--since", "1h"]), 1);
    assert_eq!(count(&["incidents", "--host", "no-such-host"]), 0);
}
