//! `oomscope probe` against the real Python reference server (CPU torch, from
//! the venv that scripts/setup-python builds): each suite produces its report,
//! and each well-run behaviour, switched off, is caught.

mod common;

use std::path::PathBuf;
use std::process::{Child, Stdio};

use common::*;
use oomscope_probe::restart::GRADUAL_AT_MOST;
use serde_json::Value;

fn server_cmd(port: u16, flags: &str) -> Vec<String> {
    let mut v = vec![
        python(),
        repo()
            .join("runtimes/pytorch-server/server.py")
            .display()
            .to_string(),
    ];
    v.extend(
        format!("--port {port} --max-active 4 --max-queue 8 {flags}")
            .split_whitespace()
            .map(str::to_string),
    );
    v
}

/// The server under `oomscope run` reporting to `col` as `name`, until dropped.
struct Server(Child);

impl Server {
    fn start(col: &Collector, name: &str, port: u16, flags: &str) -> Server {
        let child = oomscope()
            .args([
                "run",
                "--collector",
                &col.url,
                "--name",
                name,
                "--interval",
                "100ms",
                "--",
            ])
            .args(server_cmd(port, flags))
            // The server's agent reports its load (active sequences) every
            // 100 ms, so the probe reads what it had in service at each step.
            .env("OOMSCOPE_INTERVAL_S", "0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        await_health(port);
        Server(child)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM to the supervisor this test started; it passes it on to the server.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

#[test]
fn a_wrong_endpoint_is_the_environment_not_capacity() {
    let _serial = serial();
    let (code, r) = probe(&[
        "--endpoint",
        &format!("http://127.0.0.1:{}/v1", free_port()),
    ]);
    assert_eq!(code, 3);
    assert_eq!(r["schema"], "oomscope.probe/v1");
    assert_eq!(r["verdict"], "environment");
    let smoke = suite(&r, "smoke");
    assert_eq!(smoke["verdict"], "environment");
    assert!(
        smoke["reason"]
            .as_str()
            .unwrap()
            .contains("nothing answers"),
        "{smoke:#}"
    );
    assert!(r["envelope"].is_null(), "no capacity claim");
    for s in ["long-context", "concurrency", "repeated", "overload"] {
        assert_eq!(suite(&r, s)["status"], "skipped");
    }
}

#[test]
fn every_suite_reports_against_the_reference_server() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let port = free_port();
    let _srv = Server::start(&col, "ref", port, "--restore-seconds 0");
    let ep = format!("http://127.0.0.1:{port}/v1");
    // A wrong prefix on a live server is the environment too.
    let (code, r) = probe(&[
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v2"),
        "--suite",
        "smoke",
    ]);
    assert_eq!(
        (code, r["verdict"].as_str()),
        (3, Some("environment")),
        "{r:#}"
    );

    let (code, r) = probe(&[
        "--endpoint",
        &ep,
        "--collector",
        &col.url,
        "--agent",
        "ref",
        "--max-context",
        "512",
        "--max-concurrency",
        "4",
        "--repeat",
        "20",
        "--burst",
        "48",
        "--overload-context",
        "512",
        // The 12 admitted requests finish in seconds; the SLO leaves room for a loaded CI machine.
        "--overload-timeout",
        "60s",
    ]);
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["verdict"], "ok");
    for s in [
        "smoke",
        "long-context",
        "concurrency",
        "concurrency-at-max-context",
        "repeated",
        "overload",
    ] {
        assert_eq!(suite(&r, s)["status"], "pass", "{s}: {:#}", suite(&r, s));
    }
    // Long context ramped 64..512 tokens (the reference server counts a word
    // as a token); each step carries the collector's memory reading.
    let steps = suite(&r, "long-context")["steps"].as_array().unwrap();
    for key in ["context_tokens", "prompt_tokens"] {
        assert_eq!(
            steps
                .iter()
                .map(|s| s[key].as_u64().unwrap())
                .collect::<Vec<_>>(),
            vec![64, 128, 256, 512],
            "{key}"
        );
    }
    // Every request had a prompt of its own.
    assert_eq!(
        r["prompts"]["sent"], r["prompts"]["distinct"],
        "{:#}",
        r["prompts"]
    );
    assert!(
        steps
            .iter()
            .all(|s| s["memory"]["rss_bytes"].as_u64().unwrap_or(0) > 50 << 20),
        "{steps:#?}"
    );
    let e = &r["envelope"];
    assert_eq!(e["max_context_at_concurrency_1"]["value"], 512);
    assert_eq!(
        e["max_context_at_concurrency_1"]["bounded_by"],
        "probe_limit"
    );
    // 4 sent at once, and the server's agent saw 4 in service.
    assert_eq!(e["max_concurrency_at_typical_context"]["value"], 4, "{e:#}");
    assert_eq!(e["max_concurrency_at_typical_context"]["offered"], 4);
    // At the max context found, 2 % below it (distinct prompts vary a little in tokens).
    let at_max = e["max_concurrency_at_max_context"]["context_tokens"]
        .as_u64()
        .unwrap();
    assert!((500..=512).contains(&at_max), "{e:#}");
    // Repeated: the collector's verdict over those 20 requests names no leak.
    let rep = suite(&r, "repeated");
    assert!(
        rep["findings"]["causes"]
            .as_array()
            .unwrap_or_else(|| panic!("no verdict over the repeated requests: {rep:#}"))
            .iter()
            .all(|c| c["kind"] != "leak"),
        "{rep:#}"
    );
    // Overload with admission caps: clean refusals, a bounded queue, and the server alive.
    let o = &suite(&r, "overload")["findings"];
    assert!(
        o["refused"].as_u64().unwrap() > 0 && o["timeouts"] == 0 && o["alive_after"] == true,
        "{o:#}"
    );
    assert!(
        o["ok"].as_u64().unwrap() + o["refused"].as_u64().unwrap() == 48,
        "{o:#}"
    );
}

#[test]
fn overload_without_admission_caps_is_caught() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let port = free_port();
    let _srv = Server::start(&col, "uncapped", port, "--no-admission-caps");
    let (code, r) = probe(&[
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v1"),
        "--suite",
        "overload",
        "--burst",
        "64",
        "--overload-context",
        "1024",
        "--overload-timeout",
        "5s",
    ]);
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["verdict"], "unsafe");
    let o = suite(&r, "overload");
    assert_eq!(o["status"], "fail");
    let f = &o["findings"];
    assert!(
        f["timeouts"].as_u64().unwrap() > 0 || f["oom"] == true,
        "an OOM or a timeout: {o:#}"
    );
    assert_eq!(f["refused"], 0, "nothing was refused cleanly: {o:#}");
}

fn restart_run(port: u16, flags: &str) -> Value {
    let launch = server_cmd(
        port,
        &format!("--load-seconds 1 --restore-seconds 8 {flags}"),
    );
    let endpoint = format!("http://127.0.0.1:{port}/v1");
    // The launched `oomscope run` reports here: without --collector it would
    // reach whatever collector serves the default address on this machine.
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // The server command follows `--`, word for word, as with `oomscope run`.
    let mut args = vec![
        "--endpoint",
        &endpoint,
        "--collector",
        &col.url,
        "--suite",
        "restart",
        "--launch",
        "--",
    ];
    args.extend(launch.iter().map(String::as_str));
    let (_, r) = probe(&args);
    suite(&r, "restart").clone()
}

#[test]
fn restart_passes_with_gating_restore_and_idempotency() {
    let _serial = serial();
    let s = restart_run(free_port(), "");
    assert_eq!(s["status"], "pass", "{s:#}");
    let f = &s["findings"];
    assert_eq!(f["admitted_before_ready"], 0);
    assert_eq!(f["duplicates"], 0);
    assert_eq!(f["idempotent_completed_before_kill"], 8);
    assert!(
        (f["restore_herd_admitted"].as_f64().unwrap())
            <= GRADUAL_AT_MOST * f["steady_herd_admitted"].as_f64().unwrap(),
        "{f:#}"
    );
}

#[test]
fn restart_without_gradual_restore_fails_with_the_reason() {
    let _serial = serial();
    let s = restart_run(free_port(), "--no-gradual-restore");
    assert_eq!(s["status"], "fail", "{s:#}");
    let verdict = s["verdict"].as_str().unwrap();
    assert!(verdict.contains("no gradual restore"), "{s:#}");
    let f = &s["findings"];
    assert!(
        f["restore_herd_admitted"].as_f64().unwrap()
            > GRADUAL_AT_MOST * f["steady_herd_admitted"].as_f64().unwrap(),
        "{f:#}"
    );
    assert_eq!(f["admitted_before_ready"], 0, "readiness still gates");
    assert_eq!(f["duplicates"], 0, "idempotency still on");
}

#[test]
fn restart_without_readiness_gating_fails_with_the_reason() {
    let _serial = serial();
    let s = restart_run(free_port(), "--no-readiness-gate");
    assert_eq!(s["status"], "fail", "{s:#}");
    assert!(
        s["verdict"]
            .as_str()
            .unwrap()
            .contains("readiness does not gate traffic"),
        "{s:#}"
    );
    assert!(s["findings"]["admitted_before_ready"].as_u64().unwrap() > 0);
    assert_eq!(s["findings"]["duplicates"], 0, "idempotency still on");
}

#[test]
fn restart_without_idempotency_processes_retries_twice() {
    let _serial = serial();
    let s = restart_run(free_port(), "--no-idempotency");
    assert_eq!(s["status"], "fail", "{s:#}");
    assert_eq!(s["findings"]["duplicates"], 8, "{s:#}");
    assert!(
        s["verdict"].as_str().unwrap().contains("processed again"),
        "{s:#}"
    );
}

/// A long-context-only probe of the server on `port`, compared with `baseline` when given.
fn probe_cmp(col: &Collector, port: u16, baseline: Option<&PathBuf>) -> Value {
    let mut c = oomscope();
    c.args([
        "probe",
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v1"),
        "--collector",
        &col.url,
        "--agent",
        "cmp",
    ])
    .args(["--suite", "long-context", "--max-context", "128", "--json"]);
    if let Some(b) = baseline {
        c.arg("--compare").arg(b);
    }
    serde_json::from_slice(&c.output().unwrap().stdout).unwrap()
}

#[test]
fn compare_warns_when_more_than_one_setting_changed() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let base = tmp.path().join("base.json");
    {
        let port = free_port();
        let _srv = Server::start(&col, "cmp", port, "--restore-seconds 0");
        std::fs::write(
            &base,
            serde_json::to_vec(&probe_cmp(&col, port, None)).unwrap(),
        )
        .unwrap();
    }
    // One flag changed: a clean retest.
    {
        let port = free_port();
        let _srv = Server::start(
            &col,
            "cmp",
            port,
            "--restore-seconds 0 --max-total-tokens 100000",
        );
        let c = probe_cmp(&col, port, Some(&base))["comparison"].clone();
        assert_eq!(c["one_variable"], true, "{c:#}");
        assert_eq!(c["changed"][0]["setting"], "server.--max-total-tokens");
    }
    // Two flags changed: a warning.
    let port = free_port();
    let _srv = Server::start(
        &col,
        "cmp",
        port,
        "--restore-seconds 1 --max-total-tokens 100000",
    );
    let c = probe_cmp(&col, port, Some(&base))["comparison"].clone();
    assert_eq!(c["one_variable"], false, "{c:#}");
    assert!(
        c["warnings"][0]
            .as_str()
            .unwrap()
            .contains("2 settings changed"),
        "{c:#}"
    );
}
