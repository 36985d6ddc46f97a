//! One failure, one incident, for the Rust agent: 8 threads whose KV
//! caches outgrow the simulated device together get 8 OOMs, one incident,
//! whose diagnosis is KV growth; under `oomscope run`, the exit with the
//! OOM text that follows them is the same incident still. The capacity it
//! states is below what failed. Against real `oomscope` processes.
//!
//! The `oomscope run` case runs this test binary itself as the child (the
//! `child_workload` test, which does nothing unless told by its variable).

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use oomscope_agent_cuda::{Agent, AgentConfig, Simulated, Tag, TrackingPool};
use oomscope_testkit::cli::{oomscope_bin, own_collector, query_json};
use oomscope_testkit::CollectorProcess;
use serde_json::Value;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
/// The simulated device: room for 1024 tokens of KV at 64 KiB a token.
const CAPACITY: u64 = 64 * MIB;
const BYTES_PER_TOKEN: u64 = 64 * KIB;
/// Tokens per KV block (1 MiB).
const BLOCK_TOKENS: u64 = 16;
const THREADS: u64 = 8;
/// Each thread's sequence: 8 × 256 tokens need twice the device.
const SEQUENCE_TOKENS: u64 = 256;
/// Set in the child `oomscope run` starts.
const CHILD_ENV: &str = "OOMSCOPE_TEST_ONE_FAILURE_CHILD";

/// This test's own collector, over a temp db (kept while the dir lives).
fn collector() -> (tempfile::TempDir, CollectorProcess) {
    let dir = tempfile::tempdir().unwrap();
    let collector = own_collector(&dir.path().join("oomscope.db"));
    (dir, collector)
}

/// What the server tracks and tells the agent: active sequences, tokens, KV.
#[derive(Default)]
struct Active {
    sequences: AtomicU64,
    tokens: AtomicU64,
}

/// Sequences that fit one at a time, then `THREADS` at once that do not:
/// each thread grows its KV block by block until the device refuses, holds
/// what it has until every thread has failed, then lets go. Returns the
/// OOM errors' texts.
fn workload(agent: &Agent, pool: &TrackingPool<Simulated>) -> Vec<String> {
    let active = Arc::new(Active::default());
    let sequence = |id: u64, barrier: Option<&Barrier>| -> Option<String> {
        let mut request = agent.request(id, SEQUENCE_TOKENS);
        active.sequences.fetch_add(1, Relaxed);
        let mut kv = Vec::new();
        let mut error = None;
        for _ in 0..SEQUENCE_TOKENS / BLOCK_TOKENS {
            match pool.alloc::<u8>((BLOCK_TOKENS * BYTES_PER_TOKEN) as usize, Tag::KvCache) {
                Ok(block) => kv.push(block),
                Err(e) => {
                    error = Some(e.to_string());
                    break;
                }
            }
            let tokens = active.tokens.fetch_add(BLOCK_TOKENS, Relaxed) + BLOCK_TOKENS;
            agent.set_context(|c| {
                c.phase = "decode".into();
                c.active_tokens = tokens;
                c.active_sequences = active.sequences.load(Relaxed);
                c.kv_cache_bytes = tokens * BYTES_PER_TOKEN;
            });
            agent.sample();
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(e) = &error {
            request.fail(e);
        }
        if let Some(b) = barrier {
            b.wait();
        }
        let held = kv.len() as u64 * BLOCK_TOKENS;
        drop(kv);
        let tokens = active.tokens.fetch_sub(held, Relaxed) - held;
        let sequences = active.sequences.fetch_sub(1, Relaxed) - 1;
        agent.set_context(|c| {
            c.phase = "after_request".into();
            c.active_tokens = tokens;
            c.active_sequences = sequences;
            c.kv_cache_bytes = tokens * BYTES_PER_TOKEN;
        });
        error
    };
    for id in 0..4 {
        assert_eq!(sequence(id, None), None, "one at a time fits");
    }
    let barrier = Barrier::new(THREADS as usize);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (sequence, barrier) = (&sequence, &barrier);
                s.spawn(move || sequence(100 + t, Some(barrier)))
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect()
    })
}

fn start(name: &str, url: Option<&str>) -> (Agent, TrackingPool<Simulated>) {
    let pool = TrackingPool::new(Simulated::new(CAPACITY));
    let mut cfg = AgentConfig::new(name);
    cfg.collector_url = url.map(str::to_string);
    cfg.sample_interval = Duration::from_millis(200);
    (Agent::start_with_pool(cfg, &pool).unwrap(), pool)
}

/// The incidents of `name`, once none has arrived for a while: a merge
/// that did not happen shows as a second one.
fn settled_incidents(url: &str, name: &str) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last: Option<(usize, Instant)> = None;
    loop {
        let list = query_json(url, &["incidents", "--agent", name]);
        let n = list.as_array().unwrap().len();
        match last {
            Some((m, since)) if m == n && n > 0 && since.elapsed() > Duration::from_secs(2) => {
                return list.as_array().unwrap().clone()
            }
            Some((m, _)) if m == n => {}
            _ => last = Some((n, Instant::now())),
        }
        assert!(
            Instant::now() < deadline,
            "incidents never settled: {list:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn metric(c: &Value, name: &str) -> f64 {
    c["metrics"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("no metric {name} in {c:#}"))
}

/// The verdict of the one incident: KV growth at 64 KiB a token, capacity
/// below what failed, the allocator's readings said to be there.
fn check_verdict(d: &Value) {
    let causes = d["causes"].as_array().unwrap();
    let kv = causes
        .iter()
        .find(|c| c["kind"] == "kv_growth")
        .unwrap_or_else(|| panic!("no kv_growth: {d:#}"));
    let bpt = metric(kv, "bytes_per_token");
    assert!(
        (bpt - BYTES_PER_TOKEN as f64).abs() < 0.05 * BYTES_PER_TOKEN as f64,
        "bytes_per_token {bpt}: {kv:#}"
    );
    let text = d.to_string();
    assert!(!text.contains("no device allocator readings"), "{d:#}");
    assert!(
        !text.contains("Capture the allocator state"),
        "the agent captured it: {d:#}"
    );
    let failed_at = metric(kv, "failed_at_active_tokens");
    assert!(failed_at <= (CAPACITY / BYTES_PER_TOKEN) as f64, "{kv:#}");
    if let Some(safe) = d["capacity"]["safe_active_tokens"].as_f64() {
        assert!(
            safe < failed_at,
            "safe {safe} tokens, failed at {failed_at}: {d:#}"
        );
    }
    if let Some(safe) = d["capacity"]["safe_sequences"].as_f64() {
        let failed_seqs = d["capacity"]["failed_at_sequences"]
            .as_f64()
            .unwrap_or(THREADS as f64);
        assert!(
            safe < failed_seqs,
            "safe {safe} sequences, failed at {failed_seqs}: {d:#}"
        );
    }
}

#[test]
fn eight_threads_past_the_device_together_are_one_incident_of_kv_growth() {
    let (_dir, collector) = collector();
    let (agent, pool) = start("kv-threads", Some(&collector.url));
    let errors = workload(&agent, &pool);
    assert!(errors.len() >= 2, "several threads failed: {errors:?}");
    assert!(
        errors.iter().all(|e| e.starts_with("CUDA out of memory")),
        "{errors:?}"
    );
    assert!(agent.shutdown("done", 0, Duration::from_secs(10)));
    let incidents = settled_incidents(&collector.url, "kv-threads");
    assert_eq!(incidents.len(), 1, "{} OOMs: {incidents:#?}", errors.len());
    let id = incidents[0]["id"].as_str().unwrap();
    let d = query_json(&collector.url, &["diagnose", id]);
    eprintln!("{d:#}");
    assert_eq!(d["domain"], "gpu_vram", "{d:#}");
    check_verdict(&d);
    let by_agent = query_json(&collector.url, &["diagnose", "--agent", "kv-threads"]);
    check_verdict(&by_agent);
}

/// The child `oomscope run` starts: the workload, then the exit a server
/// makes on an OOM, with its text on stderr.
#[test]
fn child_workload() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let (agent, pool) = start("ignored: OOMSCOPE_NAME wins", None);
    let errors = workload(&agent, &pool);
    agent.shutdown("oom", 1, Duration::from_secs(5));
    eprintln!("{}", errors.first().map_or("no OOM", String::as_str));
    std::process::exit(1);
}

#[test]
fn under_oomscope_run_the_exit_after_the_ooms_is_the_same_incident() {
    let (_dir, collector) = collector();
    let me = std::env::current_exe().unwrap();
    let out = Command::new(oomscope_bin())
        .args([
            "run",
            "--collector",
            &collector.url,
            "--name",
            "kv-run",
            "--",
        ])
        .arg(&me)
        .args([
            "--exact",
            "child_workload",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, "1")
        .env_remove("OOMSCOPE_COLLECTOR")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("CUDA out of memory"), "{stderr}");
    let incidents = settled_incidents(&collector.url, "kv-run");
    assert_eq!(incidents.len(), 1, "{incidents:#?}");
    let id = incidents[0]["id"].as_str().unwrap();
    let d = query_json(&collector.url, &["diagnose", id]);
    eprintln!("{d:#}");
    check_verdict(&d);
}
