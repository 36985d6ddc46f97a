//! Start-up failures under `oomscope run`: a real child that prints a Python
//! traceback (`ValueError: Model path does not exist`) and exits 1, under
//! `--restart 3` and as three separate runs under one name, while a
//! test-owned cgroup thrashes its page cache beside it. Each is one crash
//! loop whose verdict has no memory domain and the first cause
//! `startup_failure`, led by the error line; no other process is named.
//! A real collector over loopback gRPC with a real SQLite file.

mod common;

use std::process::Child;
use std::time::Duration;

use common::*;
use serde_json::Value;

const MIB: u64 = 1 << 20;

const MODEL: &str = "/nonexistent/models/llama-8b";

/// The server's start: it checks its model path and raises, as a server
/// given a wrong path does.
fn failing_server() -> Vec<String> {
    vec![
        "python3".into(),
        "-c".into(),
        format!(
            "import os, sys\nprint('INFO starting server', file=sys.stderr)\ndef load(p):\n    if not os.path.exists(p):\n        raise ValueError(f'Model path does not exist: {{p}}')\nload('{MODEL}')\n"
        ),
    ]
}

const ERROR_LINE: &str = "ValueError: Model path does not exist: /nonexistent/models/llama-8b";

/// Pressure on the host that is not the server's: a reader in a test-owned
/// 32 MiB cgroup re-reading a 96 MiB file, so its page cache is evicted
/// and refaulted over and over. Killed (and its file removed) on drop.
struct Neighbour {
    child: Child,
    _cg: TestCgroup,
    _dir: tempfile::TempDir,
}

impl Neighbour {
    /// `name` tells the cgroups of tests running at once apart.
    fn start(name: &str) -> Neighbour {
        let dir = tempdir();
        let file = dir.path().join("cache.bin");
        std::fs::write(&file, vec![7u8; (96 * MIB) as usize]).unwrap();
        let cg = TestCgroup::create(None, &format!("oomscope-{name}"), Some(32 * MIB));
        let script = format!("while true; do cat {} > /dev/null; done", file.display());
        let child = cg.command(&["sh", "-c", &script]).spawn().unwrap();
        Neighbour {
            child,
            _cg: cg,
            _dir: dir,
        }
    }
}

impl Drop for Neighbour {
    fn drop(&mut self) {
        // Its sh and the cat it runs: the cgroup's processes, all ours.
        if let Ok(procs) = std::fs::read_to_string(self._cg.dir.join("cgroup.procs")) {
            for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_server(col: &Collector, name: &str, extra: &[&str]) -> std::process::Output {
    let cmd = failing_server();
    let argv: Vec<&str> = cmd.iter().map(String::as_str).collect();
    let out = run(&col.url, name, extra, &argv);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The one crash loop of `name`, once it is recorded: (the incident, its parts).
fn one_crash_loop(col: &Collector, name: &str) -> (Value, Vec<Value>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let incs = col.incidents_of(name, 1, Duration::from_secs(5));
        if incs.iter().any(|i| i["kind"] == "crash_loop") || std::time::Instant::now() > deadline {
            assert_eq!(
                incs.len(),
                1,
                "one crash loop, not {}: {incs:#?}",
                incs.len()
            );
            let inc = incs[0].clone();
            assert_eq!(inc["kind"], "crash_loop", "{inc:#}");
            let parts = inc["parts"].as_array().cloned().unwrap_or_default();
            return (inc, parts);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The verdict of a start-up failure: no domain, `startup_failure` first
/// with the error line, its numbers, no host cause, a fix naming the error.
fn assert_startup_failure(d: &Value, failed_starts: f64) {
    assert!(d["domain"].is_null(), "no memory domain: {d:#}");
    let first = &d["causes"][0];
    assert_eq!(first["kind"], "startup_failure", "{d:#}");
    assert_eq!(
        first["evidence"][0],
        format!("stderr: {ERROR_LINE}"),
        "{d:#}"
    );
    assert_eq!(first["metrics"]["exit_code"], 1.0, "{d:#}");
    assert_eq!(first["metrics"]["failed_starts"], failed_starts, "{d:#}");
    let runtime = first["metrics"]["runtime_s"].as_f64().unwrap();
    assert!(runtime > 0.0 && runtime < 30.0, "{d:#}");
    for c in d["causes"].as_array().unwrap() {
        assert!(
            !["other_process", "swap_thrash"].contains(&c["kind"].as_str().unwrap()),
            "the host's pressure is no cause of this: {d:#}"
        );
        assert!(
            c["processes"].as_array().is_none_or(|p| p.is_empty()),
            "no other process named: {d:#}"
        );
    }
    assert_eq!(d["trigger"], "immediate", "{d:#}");
    let fix = d["fixes"][0]["action"].as_str().unwrap();
    assert!(fix.contains(ERROR_LINE), "{d:#}");
    assert!(
        d["victim"]["command"].as_str().unwrap().contains("python3"),
        "{d:#}"
    );
}

#[test]
fn a_startup_crash_loop_under_restart_names_its_error_line() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let _neighbour = Neighbour::start("neighbour-restart");
    let out = run_server(&col, "bad-path", &["--restart", "3", "--backoff", "100ms"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.matches(ERROR_LINE).count(),
        4,
        "1 run + 3 restarts: {stderr}"
    );

    let (inc, parts) = one_crash_loop(&col, "bad-path");
    assert_eq!(inc["domain"], "", "{inc:#}");
    assert!(
        inc["summary"].as_str().unwrap().contains(ERROR_LINE),
        "{inc:#}"
    );
    // The three earlier starts are its parts, each a failed start.
    assert_eq!(parts.len(), 3, "{inc:#}");
    assert!(parts.iter().all(|p| p["kind"] == "failed_start"), "{inc:#}");

    let d = col.json(&["diagnose", inc["id"].as_str().unwrap()]);
    assert_startup_failure(&d, 4.0);
    assert!(
        evidence_text(&d).contains("restarts gave up (crash loop)"),
        "{d:#}"
    );
    // People read the text form: no domain, and not "nothing failed".
    let text = col.text(&["diagnose", inc["id"].as_str().unwrap()]);
    assert!(
        text.contains("Memory domain: - (no memory ran out: it failed while starting)")
            && text.contains(ERROR_LINE),
        "{text}"
    );
}

#[test]
fn separate_failed_runs_under_one_name_are_one_crash_loop() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let _neighbour = Neighbour::start("neighbour-runs");

    // One failed start is an incident of its own, with the same verdict.
    run_server(&col, "bad-path", &[]);
    let incs = col.incidents_of("bad-path", 1, Duration::from_secs(10));
    assert_eq!(incs.len(), 1, "{incs:#?}");
    assert_eq!(incs[0]["kind"], "failed_start", "{incs:#?}");
    assert_eq!(incs[0]["domain"], "", "{incs:#?}");
    let d = col.json(&["diagnose", incs[0]["id"].as_str().unwrap()]);
    assert_startup_failure(&d, 1.0);

    for _ in 0..2 {
        run_server(&col, "bad-path", &[]);
    }
    let (inc, parts) = one_crash_loop(&col, "bad-path");
    assert!(
        inc["summary"].as_str().unwrap().contains("died 3 times"),
        "{inc:#}"
    );
    assert_eq!(parts.len(), 3, "{inc:#}");
    assert!(parts.iter().all(|p| p["kind"] == "failed_start"), "{inc:#}");
    let id = inc["id"].as_str().unwrap().to_string();
    let d = col.json(&["diagnose", &id]);
    // Each run is an instance of its own: the last run's start is read.
    assert_startup_failure(&d, 1.0);

    // A part answers with its crash loop's verdict and says so; an id that
    // `incidents` lists neither as an incident nor as a part is NotFound.
    let part = parts[0]["id"].as_str().unwrap();
    let d = col.json(&["diagnose", part]);
    assert_eq!(d["incident"], id.as_str(), "{d:#}");
    assert!(
        d["evidence"][0]
            .as_str()
            .unwrap()
            .contains(&format!("{part} is part of incident {id}")),
        "{d:#}"
    );
    let listed: Vec<String> = std::iter::once(id.clone())
        .chain(parts.iter().map(|p| p["id"].as_str().unwrap().to_string()))
        .collect();
    let unlisted = (1..=listed.len() + 1)
        .map(|n| format!("inc-{n:06}"))
        .find(|i| !listed.contains(i))
        .unwrap();
    let out = oomscope()
        .args(["diagnose", &unlisted, "--collector", &col.url])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("no incident \"{unlisted}\"")) && err.contains("oomscope incidents"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "no verdict printed: {out:?}");
}
