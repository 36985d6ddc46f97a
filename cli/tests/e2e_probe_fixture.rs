//! The failing-workload fixture against the real Python reference server in
//! a memory cgroup of `oomscope run --memory-limit`: the probe's concurrency
//! ramp overruns the cgroup with KV and logits, `--fixture-out` writes the
//! step that failed, and `probe --fixture` (the regression check) fails
//! against the unfixed server and passes against the fixed one.
//!
//! Sizes (measured on CPU torch, the server's defaults): the server idles at
//! about 370 MiB in its cgroup and each in-flight 1000-token request adds
//! about 135 MiB (its prefill logits, 1000 x 32000 float32, and its KV), so
//! 8 at once need about 1.45 GiB and 3 at once about 0.8 GiB. The limit sits
//! between them.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Between 3 and 8 requests of [`PROMPT_TOKENS`] in flight (see above).
const LIMIT: &str = "1100M";
const PROMPT_TOKENS: u64 = 1000;
const CONCURRENCY: usize = 8;

/// The reference server under `oomscope run --memory-limit`, until dropped.
struct Server(Child);

impl Server {
    fn start(col: &Collector, port: u16, flags: &str) -> Server {
        let server = repo().join("runtimes/pytorch-server/server.py");
        let child = oomscope()
            .args(run_args(&col.url, "fixture-ref"))
            .args(["--memory-limit", LIMIT, "--", &python()])
            .arg(server)
            .args(
                format!("--port {port} --max-queue 64 --restore-seconds 0 {flags}")
                    .split_whitespace(),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        await_health(port);
        Server(child)
    }

    /// Waits (at most 30 s) for the supervisor to end: its server was killed.
    fn ended(&mut self) -> bool {
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if self.0.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM to the supervisor this test started; it passes it on to the server.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn replay(port: u16, fixture: &Path) -> (i32, serde_json::Value) {
    probe(&[
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v1"),
        "--fixture",
        fixture.to_str().unwrap(),
        "--request-timeout",
        "120s",
        "--quiet",
    ])
}

#[test]
fn a_kv_overrun_becomes_a_fixture_that_fails_unfixed_and_passes_fixed() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let fixture = tmp.path().join("fixture.json");

    // 1. The ramp overruns the cgroup; the failing step becomes the fixture.
    let port = free_port();
    let mut srv = Server::start(&col, port, "");
    let (code, r) = probe(&[
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v1"),
        "--suite",
        "concurrency",
        "--typical-context",
        &PROMPT_TOKENS.to_string(),
        "--max-concurrency",
        &CONCURRENCY.to_string(),
        "--request-timeout",
        "120s",
        "--quiet",
        "--fixture-out",
        fixture.to_str().unwrap(),
    ]);
    assert_ne!(code, 0, "{r:#}");
    let conc = suite(&r, "concurrency");
    let failed = conc["steps"].as_array().unwrap().last().unwrap();
    assert_eq!(failed["concurrency"], CONCURRENCY, "{conc:#}");
    assert!(srv.ended(), "the cgroup's OOM killed the server");
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    assert_eq!(f["schema"], "oomscope.fixture/v1");
    assert_eq!(f["concurrency"], CONCURRENCY);
    assert_eq!(f["repeats"], 1);
    let reqs = f["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), CONCURRENCY);
    assert!(
        reqs.iter()
            .all(|q| q["prompt_tokens"] == PROMPT_TOKENS && q["output_tokens"] == 16),
        "{f:#}"
    );
    // Sizes only: no prompt text in the fixture.
    assert!(!std::fs::read_to_string(&fixture)
        .unwrap()
        .contains("prompt\""));
    drop(srv);

    // 2. The regression check fails against the same, unfixed launch...
    let port = free_port();
    let mut srv = Server::start(&col, port, "");
    let (code, r) = replay(port, &fixture);
    assert_ne!(code, 0, "the failure came back: {r:#}");
    let fx = suite(&r, "fixture");
    assert_eq!(fx["status"], "fail", "{fx:#}");
    let wave = &fx["steps"][0];
    assert_eq!(wave["calls"], CONCURRENCY, "{fx:#}");
    assert!(wave["ok"].as_u64().unwrap() < CONCURRENCY as u64, "{fx:#}");
    assert!(srv.ended(), "the server was killed again");
    drop(srv);

    // 3. ...and passes against the fixed one: 3 active at most, the rest queue.
    let port = free_port();
    let _srv = Server::start(&col, port, "--max-active 3");
    let (code, r) = replay(port, &fixture);
    let fx = suite(&r, "fixture");
    assert_eq!((code, fx["status"].as_str()), (0, Some("pass")), "{r:#}");
    let wave = &fx["steps"][0];
    assert_eq!(wave["ok"], CONCURRENCY, "{fx:#}");
    assert_eq!(wave["prompt_tokens"], PROMPT_TOKENS, "{fx:#}");
}
