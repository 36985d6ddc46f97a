//! The agent with no device, as a CPU-only Rust program uses it: requests
//! marked by a guard, a host leak found from the readings at each
//! request's end at the default interval, no GPU in its Hello; and a
//! collector that is not there costs a bounded shutdown, nothing more.
//! Against a real `oomscope collector` process (loopback, temp SQLite db).
//!
//! Needs the `oomscope` binary (`cargo build -p oomscope-cli`), or `OOMSCOPE_BIN`.

use std::time::{Duration, Instant};

use oomscope_agent_cuda::agent::{DEFAULT_SAMPLE_INTERVAL, DEFAULT_SHUTDOWN_WAIT};
use oomscope_agent_cuda::{Agent, AgentConfig, Simulated, StartError, Tag, TrackingPool};
use oomscope_testkit::cli::{own_collector, query_json};
use oomscope_testkit::CollectorProcess;

const MIB: usize = 1 << 20;
/// What each request leaks: the 2 MiB, found within 150 requests.
const LEAK: usize = 2 * MIB;
const REQUESTS: u64 = 150;

/// This test's own collector, over a temp db (kept while the dir lives).
fn collector() -> (tempfile::TempDir, CollectorProcess) {
    let dir = tempfile::tempdir().unwrap();
    let collector = own_collector(&dir.path().join("oomscope.db"));
    (dir, collector)
}

/// `bytes` of host memory, every page touched (resident, not just mapped).
fn resident(bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    for page in v.chunks_mut(4096) {
        page[0] = 1;
    }
    v
}

/// One agent per process (a second is refused), and RSS is the process's
/// (two leaking tests at once would each read both leaks): the tests that
/// start one take turns.
static ONE_AGENT: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AGENT.lock().unwrap_or_else(|e| e.into_inner())
}

fn config(name: &str, url: &str) -> AgentConfig {
    let mut cfg = AgentConfig::new(name);
    cfg.collector_url = Some(url.into());
    assert_eq!(cfg.sample_interval, DEFAULT_SAMPLE_INTERVAL);
    cfg
}

#[test]
fn a_host_only_agent_reports_no_gpu_and_finds_a_leak_by_its_requests() {
    let _turn = turn();
    let (_dir, collector) = collector();
    let agent = Agent::start(config("host-leak", &collector.url)).unwrap();
    {
        let _load = agent.phase("load");
        std::hint::black_box(resident(8 * MIB));
    }
    let mut leaked = Vec::new();
    let started = Instant::now();
    for i in 0..REQUESTS {
        let mut r = agent.request(i, 16);
        // Some work that comes and goes, and what stays.
        let scratch = resident(MIB);
        std::thread::sleep(Duration::from_millis(2));
        drop(scratch);
        leaked.push(resident(LEAK));
        r.set_output_tokens(8);
    }
    let took = started.elapsed();
    assert!(
        agent.shutdown("done", 0, DEFAULT_SHUTDOWN_WAIT),
        "all acked"
    );
    eprintln!("{REQUESTS} requests in {took:?}");

    let agents = query_json(&collector.url, &["agents"]);
    let a = agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["hello"]["name"] == "host-leak")
        .unwrap_or_else(|| panic!("no agent host-leak: {agents:#}"));
    assert_eq!(a["hello"]["runtime"], "rust", "{a:#}");
    let gpus = a["hello"]["gpus"].as_array().map_or(0, Vec::len);
    assert_eq!(gpus, 0, "no GPU reported: {a:#}");
    assert!(
        a["hello"]["allocator_settings"].is_null(),
        "no allocator: {a:#}"
    );

    let d = query_json(&collector.url, &["diagnose", "--agent", "host-leak"]);
    let causes = d["causes"].as_array().unwrap();
    let c = causes
        .iter()
        .find(|c| ["host_growth", "leak"].contains(&c["kind"].as_str().unwrap()))
        .unwrap_or_else(|| panic!("no host_growth or leak after {REQUESTS} requests: {d:#}"));
    let per_request = c["metrics"]["bytes_per_request"].as_f64().unwrap();
    assert!(
        (per_request - LEAK as f64).abs() < 0.10 * LEAK as f64,
        "bytes_per_request {per_request} against {LEAK} kept per request: {c:#}"
    );
    eprintln!("{}: {per_request:.0} B/request", c["kind"]);
    // The fixes in Rust's words: no Python tool, no allocator without a device.
    let text = d.to_string();
    assert!(text.contains("heaptrack"), "{d:#}");
    for foreign in [
        "PYTORCH_CUDA_ALLOC_CONF",
        "tracemalloc",
        "torch.",
        "empty_cache",
    ] {
        assert!(
            !text.contains(foreign),
            "{foreign} for a Rust process without a device: {d:#}"
        );
    }
    drop(leaked);
}

#[test]
fn a_host_leak_beside_a_pool_says_the_device_stayed_flat() {
    let _turn = turn();
    let (_dir, collector) = collector();
    let pool = TrackingPool::new(Simulated::new(1 << 30));
    let agent = Agent::start_with_pool(config("host-leak-pool", &collector.url), &pool).unwrap();
    let mut leaked = Vec::new();
    for i in 0..REQUESTS {
        let _r = agent.request(i, 16);
        // KV that comes and goes on the device; what stays is on the host.
        let kv = pool.alloc::<u8>(4 * MIB, Tag::KvCache).unwrap();
        leaked.push(resident(LEAK));
        drop(kv);
    }
    assert!(agent.shutdown("done", 0, DEFAULT_SHUTDOWN_WAIT));
    let d = query_json(&collector.url, &["diagnose", "--agent", "host-leak-pool"]);
    let c = d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == "host_growth")
        .unwrap_or_else(|| panic!("no host_growth: {d:#}"));
    let per_request = c["metrics"]["bytes_per_request"].as_f64().unwrap();
    assert!(
        (per_request - LEAK as f64).abs() < 0.10 * LEAK as f64,
        "{c:#}"
    );
    let evidence = c["evidence"].to_string();
    // Every reading had the pool's counters: the evidence says so.
    assert!(
        evidence.contains("device live bytes between requests stayed flat"),
        "{c:#}"
    );
    assert!(!evidence.contains("no device allocator readings"), "{c:#}");
    drop(leaked);
}

#[test]
fn a_bad_collector_url_is_an_error_at_start() {
    for bad in ["localhost:4317", "127.0.0.1:4317", "http://"] {
        let mut cfg = AgentConfig::new("bad-url");
        cfg.collector_url = Some(bad.into());
        let e = Agent::start(cfg)
            .err()
            .unwrap_or_else(|| panic!("{bad} accepted"));
        assert!(matches!(e, StartError::CollectorUrl(_)), "{bad}: {e}");
    }
}

#[test]
fn without_a_collector_requests_go_on_and_shutdown_returns_within_its_wait() {
    let _turn = turn();
    // A port nothing listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let spool = tempfile::tempdir().unwrap();
    let mut cfg = config("no-collector", &url);
    cfg.spool_dir = Some(spool.path().to_path_buf());
    let agent = Agent::start(cfg).unwrap();
    let t = Instant::now();
    for i in 0..50 {
        let _r = agent.request(i, 4);
    }
    let requests = t.elapsed();
    assert!(
        requests < Duration::from_secs(1),
        "requests never wait on the network: {requests:?}"
    );
    let wait = Duration::from_millis(500);
    let t = Instant::now();
    assert!(!agent.shutdown("done", 0, wait), "nothing can be acked");
    let took = t.elapsed();
    eprintln!("shutdown without a collector took {took:?} (wait {wait:?})");
    assert!(
        took < wait + Duration::from_millis(300),
        "shutdown took {took:?}"
    );
    // What was not acked waits in the spool for the next start.
    let spooled: u64 = walk(spool.path());
    assert!(spooled > 0, "nothing spooled in {:?}", spool.path());
}

fn walk(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(&e.path())
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

#[test]
fn a_second_agent_in_the_process_is_refused_naming_the_first() {
    let _turn = turn();
    // Nothing listens here: the agents queue, and the test waits on nothing.
    let url = "http://127.0.0.1:9";
    let first = Agent::start(config("first-server", url)).unwrap();
    let e = Agent::start(config("second-server", url))
        .err()
        .expect("a second agent while the first runs");
    assert!(
        matches!(&e, StartError::AlreadyRunning(first) if first == "first-server"),
        "{e:?}"
    );
    assert!(e.to_string().contains("\"first-server\""), "{e}");
    // A clone is the same agent, not a second one; its requests count.
    let shared = first.clone();
    drop(shared.request(1, 4));
    assert_eq!(first.context().requests_done, 1);
    first.shutdown("done", 0, Duration::from_millis(10));
    // Once the first has shut down, another may start.
    let next = Agent::start(config("second-server", url)).unwrap();
    next.shutdown("done", 0, Duration::from_millis(10));
}
