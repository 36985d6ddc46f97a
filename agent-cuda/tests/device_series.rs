//! A candle program's own device memory, without a pool: NVML's figure for
//! this process, read by the agent with each boundary message (never on a
//! request's thread) and in each periodic sample, is a series the analysis
//! reads per request. Device memory that grows with requests is a `leak`
//! with its bytes per request; flat device memory, or another process's
//! growth, is none. The real agent against a real `oomscope collector`
//! process (loopback, temp SQLite db); NVML is scripted (CI has no GPU), as
//! an H200 reports it: the GPU's uuid, this process's pid and another's.
//!
//! Needs the `oomscope` binary (`cargo build -p oomscope-cli`), or `OOMSCOPE_BIN`.

#[path = "../../agent-core/tests/support/fake_nvml.rs"]
mod fake_nvml;

use std::time::{Duration, Instant};

use fake_nvml::{FakeDevice, FakeNvml};
use oomscope_agent_cuda::agent::{GpuReader, DEFAULT_SHUTDOWN_WAIT};
use oomscope_agent_cuda::{Agent, AgentConfig};
use oomscope_testkit::cli::{own_collector, query_json};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// An H200's memory as NVML gives it (143,771 MiB).
const H200_TOTAL: u64 = 143_771 * MIB;
const H200: &str = "GPU-5c2d8e5b-3f0a-4b7e-9a51-0c1d2e3f4a5b";
/// What the program holds before its first request: weights, the CUDA
/// context, cuBLAS's workspace.
const LOADED: u64 = 3 * GIB;
/// Another server's memory on the same GPU (pid 1: in our /proc, not ours).
const OTHER_PID: u32 = 1;
const OTHER: u64 = 40 * GIB;
/// What each leaking request keeps on the device: the 2 MiB.
const LEAK: u64 = 2 * MIB;
const REQUESTS: u64 = 150;
/// One forward pass: the requests span 1.5 s, past one periodic sample.
const FORWARD: Duration = Duration::from_millis(10);

/// One agent per process: the tests that start one take turns.
static ONE_AGENT: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn h200(own: u64, other: u64) -> FakeDevice {
    let mut d = FakeDevice::gpu(H200, H200_TOTAL, own + other)
        .with_processes(&[(std::process::id(), Some(own)), (OTHER_PID, Some(other))]);
    d.name = "NVIDIA H200".into();
    d
}

/// What the run did, and the collector's diagnosis of it.
struct Run {
    diagnosis: Value,
    /// NVML process-list calls in all, and on the requests' thread.
    process_calls: usize,
    request_thread_calls: usize,
    took: Duration,
}

/// `REQUESTS` requests; after request `i` this process holds `own(i)` on
/// the GPU and the other process `other(i)`.
fn run(name: &str, own: impl Fn(u64) -> u64, other: impl Fn(u64) -> u64) -> Run {
    let _turn = ONE_AGENT.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let collector = own_collector(&dir.path().join("oomscope.db"));
    let nvml = FakeNvml::new(vec![h200(own(0), other(0))]);
    let mut cfg = AgentConfig::new(name);
    cfg.collector_url = Some(collector.url.clone());
    let api = nvml.clone();
    let agent = Agent::start_with_nvml(cfg, move || GpuReader::with_api(Box::new(api))).unwrap();
    let set = |i: u64| {
        nvml.set_processes(
            H200,
            &[
                (std::process::id(), Some(own(i))),
                (OTHER_PID, Some(other(i))),
            ],
        )
    };
    let started = Instant::now();
    for i in 1..=REQUESTS {
        let mut r = agent.request(i, 32);
        std::thread::sleep(FORWARD);
        // What the request left on the device when it ended.
        set(i);
        r.set_output_tokens(16);
    }
    let took = started.elapsed();
    assert!(
        agent.shutdown("done", 0, DEFAULT_SHUTDOWN_WAIT),
        "all acked"
    );
    let me = std::thread::current().id();
    Run {
        diagnosis: query_json(&collector.url, &["diagnose", "--agent", name]),
        process_calls: nvml.calls("compute_processes_v3"),
        request_thread_calls: nvml.calls_on("compute_processes_v3", me),
        took,
    }
}

fn causes(d: &Value) -> Vec<&Value> {
    d["causes"]
        .as_array()
        .map_or(Vec::new(), |c| c.iter().collect())
}

fn no_growth_verdict(d: &Value) {
    for c in causes(d) {
        assert!(
            !["leak", "kv_growth", "host_growth", "slow_growth"]
                .contains(&c["kind"].as_str().unwrap_or("")),
            "a growth verdict without growth: {d:#}"
        );
    }
}

#[test]
fn a_candle_programs_own_device_leak_is_found_per_request_from_nvml() {
    let r = run("nvml-leak", |i| LOADED + LEAK * i, |_| OTHER);
    let d = &r.diagnosis;
    let c = causes(d)
        .into_iter()
        .find(|c| c["kind"] == "leak")
        .unwrap_or_else(|| panic!("no leak after {REQUESTS} requests: {d:#}"));
    let per_request = c["metrics"]["bytes_per_request"].as_f64().unwrap();
    eprintln!(
        "{REQUESTS} requests in {:?}: {per_request:.0} B/request; {} NVML process-list calls",
        r.took, r.process_calls
    );
    assert!(
        (per_request - LEAK as f64).abs() < 0.10 * LEAK as f64,
        "bytes_per_request {per_request} against {LEAK} kept per request: {c:#}"
    );
    let evidence = c["evidence"].to_string();
    assert!(
        evidence.contains("this process's device memory (NVML)"),
        "{c:#}"
    );
    // The runway is against the H200's total, from this process's figure.
    let used = c["metrics"]["device_used_bytes"].as_f64().unwrap();
    assert!(
        used >= (LOADED + LEAK * (REQUESTS - 10)) as f64
            && used <= (LOADED + LEAK * REQUESTS) as f64,
        "device_used_bytes {used}: {c:#}"
    );
    // A Rust program's words: nothing of PyTorch's.
    let text = d.to_string();
    for foreign in ["PYTORCH_CUDA_ALLOC_CONF", "tracemalloc", "torch."] {
        assert!(!text.contains(foreign), "{foreign}: {d:#}");
    }
    // NVML was read on the agent's thread, at most once per boundary
    // message (20 a second) and periodic sample: never per request.
    assert_eq!(r.request_thread_calls, 0, "NVML on a request's thread");
    let bound = (r.took.as_secs_f64() * 20.0).ceil() as usize + 4;
    assert!(
        r.process_calls <= bound && r.process_calls < REQUESTS as usize,
        "{} process-list calls for {REQUESTS} requests in {:?}",
        r.process_calls,
        r.took
    );
}

#[test]
fn flat_device_memory_or_another_process_growing_is_no_leak() {
    // This process flat (a KV block that comes and goes reads as jitter);
    // the other server on the GPU leaking 8 MiB a request.
    let r = run(
        "nvml-flat",
        |i| LOADED + (i % 3) * MIB,
        |i| OTHER + 8 * MIB * i,
    );
    no_growth_verdict(&r.diagnosis);
    assert_eq!(r.request_thread_calls, 0, "NVML on a request's thread");
}
