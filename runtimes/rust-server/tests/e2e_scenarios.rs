//! The rust-server on the simulated device, driven over HTTP, reporting to a
//! real `oomscope collector` process (loopback, temp SQLite db); verdicts
//! read back with `oomscope incidents/diagnose --json`.
//!
//! Needs the `oomscope` binary next to this test's target directory
//! (`scripts/test` builds the whole workspace first), or `OOMSCOPE_BIN`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use oomscope_testkit::cli::{oomscope_bin, query_json};
use oomscope_testkit::CollectorProcess;

const MIB: u64 = 1 << 20;

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Collector {
    _process: CollectorProcess,
    url: String,
    _dir: tempfile::TempDir,
}

impl Collector {
    /// On a free port; another if that one was taken before the bind.
    fn start() -> Collector {
        let dir = tempfile::tempdir().unwrap();
        let process = CollectorProcess::start(
            || Command::new(oomscope_bin()),
            &dir.path().join("oomscope.db"),
            None,
        );
        Collector {
            url: process.url.clone(),
            _process: process,
            _dir: dir,
        }
    }

    fn json(&self, args: &[&str]) -> Value {
        query_json(&self.url, args)
    }

    fn incidents(&self, agent: &str, min: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let all = self.json(&["incidents", "--agent", agent]);
            let list = all.as_array().unwrap().clone();
            if list.len() >= min || Instant::now() > deadline {
                return list;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn diagnose_first(&self, agent: &str) -> Value {
        let incidents = self.incidents(agent, 1);
        assert!(!incidents.is_empty(), "no incident for {agent}");
        let id = incidents[0]["id"].as_str().unwrap().to_string();
        self.json(&["diagnose", &id])
    }
}

fn server_cmd(c: &Collector, name: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oomscope-rust-server"));
    cmd.args([
        "--device",
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--collector",
        &c.url,
        "--name",
        name,
        "--sample-interval-ms",
        "200",
    ])
    .args(args);
    cmd
}

struct Server {
    child: Proc,
    addr: String,
}

impl Server {
    fn start(c: &Collector, name: &str, args: &[&str]) -> Server {
        let mut child = server_cmd(c, name, args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start rust-server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Server {
            child: Proc(child),
            addr,
        }
    }

    fn request(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let status: u16 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    fn generate(&self, prompt: u64, max: u64) -> (u16, Value) {
        self.request(
            "POST",
            "/generate",
            &format!("{{\"prompt_tokens\":{prompt},\"max_tokens\":{max}}}"),
        )
    }

    /// SIGTERM: the server says goodbye and flushes.
    fn stop(mut self) {
        unsafe { libc_kill(self.child.0.id() as i32, 15) };
        let _ = self.child.0.wait();
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// `n` requests, the i-th sent `i * stagger` after the first.
fn concurrent(s: &Server, n: usize, stagger: Duration, prompt: u64, max: u64) -> Vec<(u16, Value)> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                scope.spawn(move || {
                    std::thread::sleep(stagger * i as u32);
                    s.generate(prompt, max)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn cause<'a>(d: &'a Value, kind: &str) -> &'a Value {
    d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} cause in {d:#}"))
}

fn metric(c: &Value, name: &str) -> f64 {
    c["metrics"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("no metric {name} in {c:#}"))
}

/// 256 MiB of weights on a 1 GiB device, 64 KiB of KV per token, 2048-token
/// sequences (128 MiB each, 400 ms long): one at a time is fine; arriving
/// every 40 ms, concurrency climbs past the six that fit.
#[test]
fn kv_concurrency_gets_kv_growth() {
    let c = Collector::start();
    // Steps long enough that the 16 sequences overlap even on a busy machine.
    let s = Server::start(
        &c,
        "rs-kv",
        &[
            "--capacity",
            "1073741824",
            "--model-bytes",
            "268435456",
            "--step-ms",
            "50",
        ],
    );
    let (code, one) = s.generate(256, 1792);
    assert_eq!(code, 200, "{one}");
    assert_eq!(one["kv_bytes"], 128 * MIB);
    let results = concurrent(&s, 12, Duration::from_millis(40), 256, 1792);
    let failed: Vec<&Value> = results
        .iter()
        .filter(|r| r.0 == 507)
        .map(|r| &r.1)
        .collect();
    assert!(
        !failed.is_empty(),
        "16 concurrent sequences should not fit: {results:?}"
    );
    assert!(failed[0]["error"]
        .as_str()
        .unwrap()
        .starts_with("CUDA out of memory. Tried to allocate 16.00 MiB"));
    s.stop();

    let d = c.diagnose_first("rs-kv");
    assert_eq!(d["domain"], "gpu_vram", "{d:#}");
    assert_eq!(d["trigger"], "concurrency_dependent", "{d:#}");
    assert_eq!(d["causes"][0]["kind"], "kv_growth", "{d:#}");
    let kv = cause(&d, "kv_growth");
    let bpt = metric(kv, "bytes_per_token");
    assert!(
        (bpt - 65536.0).abs() / 65536.0 < 0.02,
        "bytes_per_token {bpt}"
    );
    // 768 MiB is left for KV: it fails past 12 sequences' worth of tokens, and above one request's.
    let at = metric(kv, "failed_at_active_tokens");
    assert!(
        at > 1024.0 && at <= 768.0 * 1024.0 * 1024.0 / 65536.0,
        "failed_at_active_tokens {at}"
    );
}

/// The same load under --max-active 4 (the suggested fix): no OOM.
#[test]
fn max_active_caps_kv_and_avoids_the_oom() {
    let c = Collector::start();
    let s = Server::start(
        &c,
        "rs-kv-capped",
        &[
            "--capacity",
            "1073741824",
            "--model-bytes",
            "268435456",
            "--max-active",
            "4",
        ],
    );
    let results = concurrent(&s, 16, Duration::ZERO, 256, 768);
    assert!(results.iter().all(|r| r.0 == 200), "{results:?}");
    let (_, stats) = s.request("GET", "/stats", "");
    assert_eq!(stats["num_ooms"], 0);
    assert_eq!(
        stats["allocated_bytes"],
        256 * MIB,
        "KV freed after the requests, weights stay"
    );
    assert_eq!(stats["requests_done"], 16);
    s.stop();
    assert!(c.incidents("rs-kv-capped", 0).is_empty());
}

/// 2 GiB of weights on a 1 GiB device: the load fails at its fifth 256 MiB layer.
#[test]
fn weights_too_large_gets_its_verdict() {
    let c = Collector::start();
    let out = server_cmd(
        &c,
        "rs-weights",
        &["--capacity", "1073741824", "--model-bytes", "2147483648"],
    )
    .output()
    .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("CUDA out of memory. Tried to allocate 256.00 MiB"));
    let d = c.diagnose_first("rs-weights");
    assert_eq!(d["domain"], "gpu_vram", "{d:#}");
    assert_eq!(d["trigger"], "immediate", "{d:#}");
    assert_eq!(d["causes"][0]["kind"], "weights_too_large", "{d:#}");
    let w = cause(&d, "weights_too_large");
    assert_eq!(metric(w, "loaded_bytes"), (1u64 << 30) as f64);
    assert_eq!(metric(w, "limit_bytes"), (1u64 << 30) as f64);
}

/// Interleaved kept/freed prefix-cache entries, then a 24 MiB workspace:
/// the memory is reserved but in holes.
#[test]
fn fragmentation_gets_its_verdict() {
    let c = Collector::start();
    let s = Server::start(
        &c,
        "rs-frag",
        &[
            "--capacity",
            "268435456",
            "--model-bytes",
            "33554432",
            "--fragment",
        ],
    );
    let (code, body) = s.generate(256, 256);
    assert_eq!(code, 507, "{body}");
    assert_eq!(body["requested_bytes"], 24 * MIB);
    let (_, snap) = s.request("GET", "/snapshot", "");
    s.stop();
    let d = c.diagnose_first("rs-frag");
    assert_eq!(d["domain"], "gpu_vram", "{d:#}");
    assert_eq!(d["causes"][0]["kind"], "fragmentation", "{d:#}");
    let f = cause(&d, "fragmentation");
    let request = metric(f, "request_bytes");
    assert_eq!(request, (24 * MIB) as f64);
    assert!(metric(f, "reserved_unallocated_bytes") >= request, "{f:#}");
    let largest = metric(f, "largest_free_block_bytes");
    assert!(largest < request);
    // The server's own view after the failed request freed its KV page:
    // the whole device is still reserved, and still in holes too small.
    assert_eq!(snap["reserved_bytes"].as_u64().unwrap(), 256 * MIB);
    assert!(
        snap["largest_free_block_bytes"].as_f64().unwrap() < request,
        "{snap}"
    );
}
