//! `oomscope fixture INCIDENT` from a replayed KV-concurrency capture: the
//! fixture holds the capture's concurrency at the failure and its tokens.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn a_kv_concurrency_incident_becomes_its_concurrency_and_tokens() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let capture = fixture("kv_concurrency_oom.json");
    replay(&col, &capture, "fx-kvc");
    let incs = col.incidents_of("fx-kvc", 1, Duration::from_secs(10));
    let id = incs[0]["id"].as_str().unwrap();
    // What the capture itself says it failed at (its notes, written when recorded).
    let cap: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&capture).unwrap()).unwrap();
    let at = &cap["notes"]["failed_at"];
    let (seqs, tokens) = (
        at["active_sequences"].as_u64().unwrap(),
        at["active_tokens"].as_u64().unwrap(),
    );
    let out = tmp.path().join("fixture.json");
    let run = oomscope()
        .args(["fixture", id, "--collector", &col.url, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{run:?}");
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(f["schema"], "oomscope.fixture/v1");
    assert_eq!(f["concurrency"], seqs, "{f:#}");
    assert_eq!(f["repeats"], 1, "{f:#}");
    let reqs = f["requests"].as_array().unwrap();
    assert_eq!(reqs.len() as u64, seqs, "{f:#}");
    let total: u64 = reqs
        .iter()
        .map(|q| q["prompt_tokens"].as_u64().unwrap() + q["output_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(total, tokens, "{f:#}");
    // An incident that is not there is an error, and no file.
    let missing = tmp.path().join("none.json");
    let run = oomscope()
        .args(["fixture", "inc-999999", "--collector", &col.url, "--out"])
        .arg(&missing)
        .output()
        .unwrap();
    assert!(!run.status.success());
    assert!(!missing.exists());
}

/// A server that fails while starting (its model path is wrong) reproduces
/// at launch: its fixture says why (`at_start`) and carries the default
/// load a fixed launch must serve (`oomscope_probe::fixture::startup_load`).
#[test]
fn a_failure_while_starting_becomes_a_fixture_that_reproduces_at_launch() {
    use oomscope_probe::fixture::{STARTUP_PROMPT_TOKENS, STARTUP_REQUESTS};
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let server = "import os\nif not os.path.exists('/nonexistent/model'):\n    raise ValueError('Model path does not exist: /nonexistent/model')\n";
    let out = run(&col.url, "fx-start", &[], &["python3", "-c", server]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let incs = col.incidents_of("fx-start", 1, Duration::from_secs(10));
    let id = incs[0]["id"].as_str().unwrap();
    let path = tmp.path().join("fixture.json");
    let run = oomscope()
        .args(["fixture", id, "--collector", &col.url, "--out"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(run.status.success(), "{run:?}");
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(f["schema"], "oomscope.fixture/v1");
    assert!(
        f["at_start"]
            .as_str()
            .unwrap()
            .contains("ValueError: Model path does not exist"),
        "{f:#}"
    );
    assert_eq!(f["concurrency"], STARTUP_REQUESTS, "{f:#}");
    let reqs = f["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), STARTUP_REQUESTS);
    assert!(reqs
        .iter()
        .all(|q| q["prompt_tokens"] == STARTUP_PROMPT_TOKENS));
    // It is a fixture `probe --fixture` and retest read.
    let text = std::fs::read_to_string(&path).unwrap();
    let read = oomscope_probe::fixture::Fixture::parse(&text).unwrap();
    assert!(read.at_start.is_some());
}
