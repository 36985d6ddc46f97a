//! `oomscope run` stands in for its child: a SIGTERM meant for the service
//! is passed on, its end is recorded, and nothing is restarted.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn sigterm_to_the_supervisor_reaches_the_child_and_stops_restarts() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let marker = tmp.path().join("got-term");
    // The child records that it got SIGTERM, then exits 143 as a shell would.
    let script = format!(
        "trap 'echo term > {}; exit 143' TERM; while true; do sleep 0.05; done",
        marker.display()
    );
    let mut sup = oomscope()
        .args([
            "run",
            "--collector",
            &col.url,
            "--name",
            "termed",
            "--restart",
            "3",
            "--backoff",
            "50ms",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    unsafe { libc::kill(sup.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    let status = loop {
        if let Some(s) = sup.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the supervisor did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap().trim(),
        "term",
        "the child got the SIGTERM"
    );
    assert_eq!(status.code(), Some(143), "exits with the child's status");
    let t = col.json(&["timeline", "termed", "--max-points", "0"]);
    let starts = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"]["child_start"].is_object())
        .count();
    assert_eq!(starts, 1, "no restart after a stop signal: {t:#}");
}
