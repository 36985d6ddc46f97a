//! A process with no request marks (no in-process agent: `python3 -S` loads
//! no site hook, and nothing counts requests) growing about 20 MB/s under
//! `oomscope run` in a real v1/v2 memory cgroup with a 300 MiB limit: a live
//! `diagnose --agent` names the growth in bytes per second with a runway in
//! time; after the kernel's kill the trigger is `growth_over_time`.

mod common;

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 300 * MIB;

/// Holds 1 MiB more every 50 ms (writing each byte, so it is resident) and
/// logs "seconds bytes" after each step. Past 220 MiB it waits for the `go`
/// file, so a slow test cannot lose the moment before the kill.
const GROW: &str = r#"
import os, sys, time
log, go = open(sys.argv[1], "w"), sys.argv[2]
held, total, t0 = [], 0, time.monotonic()
while True:
    if total >= 220 << 20 and not os.path.exists(go):
        time.sleep(0.05)
        continue
    held.append(b"\x01" * (1 << 20))
    total += 1 << 20
    log.write("%.3f %d\n" % (time.monotonic() - t0, total))
    log.flush()
    time.sleep(0.05)
"#;

/// The child's own log: (seconds, bytes held).
fn steps(log: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (t, b) = l.split_once(' ')?;
            Some((t.parse().ok()?, b.parse().ok()?))
        })
        .collect()
}

/// What the process did: the least-squares rate of its log after the first
/// third of its life (the part the verdict fits), in bytes/s.
fn rate(steps: &[(f64, f64)]) -> f64 {
    let end = steps.last().unwrap().0;
    let pts: Vec<&(f64, f64)> = steps.iter().filter(|p| p.0 >= end / 3.0).collect();
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    sxy / sxx
}

fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(t.elapsed() < limit, "oomscope run did not end");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn host_growth(d: &Value) -> &Value {
    d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == "host_growth")
        .unwrap_or_else(|| panic!("no host_growth: {d:#}"))
}

fn usage(cg: &TestCgroup) -> u64 {
    let file = if cg.version == "v1" {
        "memory.usage_in_bytes"
    } else {
        "memory.current"
    };
    std::fs::read_to_string(cg.dir.join(file))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn growth_without_request_marks_has_a_runway_in_time_and_its_own_trigger() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let cg = TestCgroup::create(None, "oomscope-grow", Some(LIMIT));
    let (log, go) = (tmp.path().join("grow.log"), tmp.path().join("go"));
    let mut argv = vec![bin()];
    argv.extend(run_args(&col.url, "grower"));
    let (log_s, go_s) = (log.to_str().unwrap(), go.to_str().unwrap());
    argv.extend(["--", "python3", "-S", "-c", GROW, log_s, go_s]);
    let mut sup = cg.command(&argv).spawn().expect("oomscope run");

    // Live, while it grows: at 120 MiB held (about 6 s in).
    let t = Instant::now();
    while steps(&log).last().is_none_or(|s| s.1 < (120 * MIB) as f64) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the child never grew"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300)); // the newest readings reach the collector
    let live = col.json(&["diagnose", "--agent", "grower"]);
    let used = usage(&cg);
    let before_go = steps(&log);
    std::fs::write(&go, "").unwrap();

    assert!(live["domain"].is_null(), "nothing failed yet: {live:#}");
    assert_eq!(live["trigger"], "growth_over_time", "{live:#}");
    let c = host_growth(&live);
    let did = rate(&before_go);
    let bps = c["metrics"]["bytes_per_second"].as_f64().unwrap();
    assert!(
        (bps - did).abs() < 0.15 * did,
        "bytes_per_second {bps} against the {did} B/s the process did"
    );
    assert!(c["metrics"].get("bytes_per_request").is_none(), "{c:#}");
    // The runway: the cgroup's headroom at the newest reading, at that rate.
    assert_eq!(c["metrics"]["limit_bytes"].as_f64(), Some(LIMIT as f64));
    let secs = c["metrics"]["seconds_to_limit"].as_f64().unwrap();
    let headroom = secs * bps;
    let now_left = LIMIT.saturating_sub(used) as f64;
    assert!(
        (headroom - now_left).abs() < (24 * MIB) as f64,
        "runway {secs} s at {bps} B/s is {headroom} B; the cgroup has {now_left} B left"
    );
    let first = live["evidence"][0].as_str().unwrap();
    eprintln!("live: {first}; the process did {did:.0} B/s");
    assert!(
        first.starts_with("runway: at ") && first.contains("of the cgroup limit"),
        "the runway leads: {live:#}"
    );

    // The kernel kills it at the limit.
    let status = wait_exit(&mut sup, Duration::from_secs(60));
    assert_eq!(
        status.code(),
        Some(137),
        "killed by the cgroup's OOM killer"
    );
    let incs = col.incidents_of("grower", 1, Duration::from_secs(10));
    let id = incs.last().expect("an incident")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let d = col.json(&["diagnose", &id]);
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    assert_eq!(d["trigger"], "growth_over_time", "{d:#}");
    let c = host_growth(&d);
    let did = rate(&steps(&log));
    let bps = c["metrics"]["bytes_per_second"].as_f64().unwrap();
    assert!(
        (bps - did).abs() < 0.15 * did,
        "bytes_per_second {bps} against the {did} B/s the process did"
    );
    let line = d["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .find(|l| l.starts_with("trigger growth_over_time: with no request marks, host RSS grew"));
    assert!(line.is_some(), "{d:#}");
    eprintln!(
        "after the kill: {}; the process did {did:.0} B/s",
        line.unwrap()
    );
    drop(col);
}
