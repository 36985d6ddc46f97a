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

use oomscope_testkit::cli::{oomscope_bin, own_collector, query_json};
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

/// This test's own collector, over a temp db (kept while the dir lives).
fn collector() -> (tempfile::TempDir, CollectorProcess) {
    let dir = tempfile::tempdir().unwrap();
    let collector = own_collector(&dir.path().join("oomscope.db"));
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

/// Far past the cgroup's limit at 2 MiB a request: the kernel kills it.
const KILL_LIMIT: u64 = 300 << 20;

#[test]
fn a_leak_killed_by_the_kernel_under_oomscope_run_is_one_incident_in_rusts_words() {
    let (_dir, collector) = collector();
    let cg =
        oomscope_testkit::cgroups::TestCgroup::create(None, "oomscope-candle", Some(KILL_LIMIT));
    let bin = oomscope_bin();
    let example = example_bin();
    let argv = [
        bin.to_str().unwrap(),
        "run",
        "--collector",
        &collector.url,
        "--name",
        "candle-kill",
        "--",
        example.to_str().unwrap(),
        "--requests",
        "1000",
        "--leak-mib",
        "2",
    ];
    let out = cg.command(&argv).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(137),
        "killed by the kernel: {stderr}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let incidents = loop {
        let list = query_json(&collector.url, &["incidents"]);
        let list = list.as_array().unwrap().clone();
        if !list.is_empty() || std::time::Instant::now() > deadline {
            break list;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(incidents.len(), 1, "{incidents:#?}");
    let id = incidents[0]["id"].as_str().unwrap();
    let d = query_json(&collector.url, &["diagnose", id]);
    eprintln!("{d:#}");
    assert_eq!(d["trigger"], "repeated_requests", "{d:#}");
    let first = &d["causes"][0];
    assert!(
        ["leak", "host_growth"].contains(&first["kind"].as_str().unwrap()),
        "{d:#}"
    );
    let per_request = first["metrics"]["bytes_per_request"].as_f64().unwrap();
    assert!(
        (per_request - 2.0 * MIB).abs() < 0.10 * 2.0 * MIB,
        "bytes_per_request {per_request}: {first:#}"
    );
    let text = d.to_string();
    assert!(
        text.contains("anon-rss"),
        "the kernel's anon-rss quoted: {d:#}"
    );
    assert!(text.contains("heaptrack"), "a Rust remedy: {d:#}");
    for foreign in ["tracemalloc", "PYTORCH_CUDA_ALLOC_CONF", "torch."] {
        assert!(
            !text.contains(foreign),
            "{foreign} for a Rust process: {d:#}"
        );
    }
}
