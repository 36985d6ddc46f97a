//! The candle example (examples/candle-mlp: candle-core 0.11 on the CPU, a
//! random-weight MLP) built as a user builds it and run against this
//! test's own collector: a clean run is no incident and no growth; a
//! 2 MiB/request leak is found within 150 requests at the agent's default
//! interval, at its size.
//!
//! The example is its own workspace (candle stays out of the main build);
//! this test builds it with the cargo that runs the test, into
//! `<target>/candle-example` (once; about 5 minutes from nothing on 2
//! cores, seconds after). Needs the `oomscope` binary and crates.io (or a
//! filled cargo cache).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use oomscope_testkit::cli::{oomscope_bin, query_json};
use oomscope_testkit::CollectorProcess;
use serde_json::Value;

const MIB: f64 = (1 << 20) as f64;
/// Growth kinds: none may show in a clean run.
const GROWTH: [&str; 4] = ["leak", "host_growth", "slow_growth", "kv_growth"];

fn example_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/candle-mlp")
}

/// The example's binary, built once per test process.
fn example_bin() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
            .join("candle-example");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let manifest = example_dir().join("Cargo.toml");
        let status = Command::new(cargo)
            .args(["build", "--locked", "--manifest-path"])
            .arg(&manifest)
            .arg("--target-dir")
            .arg(&target)
            .status()
            .expect("cargo");
        assert!(status.success(), "building {}", manifest.display());
        target.join("debug/oomscope-candle-example")
    })
}

fn collector() -> (tempfile::TempDir, CollectorProcess) {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProcess::start(
        || {
            let mut c = Command::new(oomscope_bin());
            c.env_remove("OOMSCOPE_COLLECTOR");
            c
        },
        &dir.path().join("oomscope.db"),
        None,
    );
    (dir, collector)
}

/// Runs the example to its end against `url`.
fn run(url: &str, name: &str, args: &[&str]) {
    let out = Command::new(example_bin())
        .args(["--name", name])
        .args(args)
        .env("OOMSCOPE_COLLECTOR", url)
        .env_remove("OOMSCOPE_NAME")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{name}: {stderr}");
    assert!(out.status.success(), "{name} failed: {stderr}");
    assert!(stderr.contains("everything acked: true"), "{stderr}");
}

fn growth(d: &Value) -> Vec<&Value> {
    d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| GROWTH.contains(&c["kind"].as_str().unwrap_or("")))
        .collect()
}

#[test]
fn a_clean_run_of_500_requests_is_no_incident_and_no_growth() {
    let (_dir, collector) = collector();
    run(&collector.url, "candle-clean", &["--requests", "500"]);
    let incidents = query_json(&collector.url, &["incidents"]);
    assert_eq!(incidents.as_array().map_or(0, Vec::len), 0, "{incidents:#}");
    let d = query_json(&collector.url, &["diagnose", "--agent", "candle-clean"]);
    assert!(growth(&d).is_empty(), "growth in a clean run: {d:#}");
    // The agent saw the requests: the readings behind "no growth".
    let t = query_json(
        &collector.url,
        &["timeline", "candle-clean", "--max-points", "0"],
    );
    let done = t["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["sample"]["context"]["requests_done"].as_u64())
        .max();
    assert_eq!(done, Some(500), "{t:#}");
}

#[test]
fn a_2_mib_per_request_leak_is_found_within_150_requests() {
    let (_dir, collector) = collector();
    run(
        &collector.url,
        "candle-leak",
        &["--requests", "150", "--leak-mib", "2"],
    );
    let d = query_json(&collector.url, &["diagnose", "--agent", "candle-leak"]);
    let found = growth(&d);
    let c = found
        .iter()
        .find(|c| ["host_growth", "leak"].contains(&c["kind"].as_str().unwrap()))
        .unwrap_or_else(|| panic!("no host_growth or leak: {d:#}"));
    let per_request = c["metrics"]["bytes_per_request"].as_f64().unwrap();
    eprintln!("{}: {per_request:.0} B/request", c["kind"]);
    assert!(
        (per_request - 2.0 * MIB).abs() < 0.10 * 2.0 * MIB,
        "bytes_per_request {per_request} against 2 MiB kept per request: {c:#}"
    );
}
