//! The tests never reach a collector or a spool they did not make. Whoever
//! runs them may have `OOMSCOPE_COLLECTOR` pointing at their own collector
//! (or `OOMSCOPE_SPOOL` at their own spool): the harness (`common::oomscope`,
//! `common::isolate`) removes oomscope's variables from every process it
//! launches, and each gets its test's own collector on its command line.

mod common;

use std::time::Duration;

use common::*;

/// What the guard below runs in a child test process whose environment
/// points at a trap: the harness's common launches, each with its own
/// collector or none.
#[test]
#[ignore = "the guard test runs it, with a trap collector in its environment"]
fn launches_of_the_harness() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // `oomscope run` (its child inherits what the supervisor passes on).
    let out = run(&col.url, "iso-run", &[], &["sh", "-c", "exit 0"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A probe naming an agent but no collector: it must stream to none.
    let out = oomscope()
        .args([
            "probe",
            "--json",
            "--quiet",
            "--suite",
            "smoke",
            "--agent",
            "iso-probe",
        ])
        .args([
            "--endpoint",
            &format!("http://127.0.0.1:{}/v1", free_port()),
        ])
        .args(["--request-timeout", "2s"])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), None, "the probe ended");
    // A probe that launches its server under `oomscope run`, as the restart
    // suite's tests do, with the test's collector.
    let port = free_port();
    let (_, report) = probe(&[
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v1"),
        "--collector",
        &col.url,
        "--suite",
        "restart",
        "--ready-path",
        "/",
        "--request-timeout",
        "2s",
        "--launch",
        "--",
        "python3",
        "-m",
        "http.server",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
    ]);
    assert_eq!(report["schema"], "oomscope.probe/v1", "{report:#}");
    let names: Vec<String> = col
        .json(&["agents"])
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["hello"]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(
        names.iter().any(|n| n == "iso-run") && names.iter().any(|n| n == "python3"),
        "the test's own collector got its runs: {names:?}"
    );
}

/// `OOMSCOPE_COLLECTOR` set to a live collector and `OOMSCOPE_SPOOL` to a
/// directory, as in the environment of a user of oomscope: while the
/// harness's launches run, the trap receives nothing and no spool appears.
#[test]
fn tests_never_reach_the_collector_or_spool_in_their_environment() {
    let tmp = tempdir();
    let trap = Collector::start(&tmp.path().join("trap.db"));
    let spool = tmp.path().join("users-spool");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "launches_of_the_harness", "--ignored"])
        .env("OOMSCOPE_COLLECTOR", &trap.url)
        .env("OOMSCOPE_SPOOL", &spool)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && said.contains("1 passed"), "{said}");
    // Give a stray stream time to land before looking.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(trap.json(&["agents"]), serde_json::json!([]), "{said}");
    assert!(!spool.exists(), "a launched process used the user's spool");
}
