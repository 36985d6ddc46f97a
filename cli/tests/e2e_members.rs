//! The processes of a supervised tree besides the child (#28): a member
//! killed by a signal is one incident that stays, whatever the main process
//! does next; a stop passed on is none; members that outlive the child keep
//! the instance open and are named. Real processes under `oomscope run`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use oomscope_proto::v1 as pb;

/// `sh` as a main process with one member, `sleep`, whose pid it writes to
/// `pidfile`; once the member ends, it exits 0, as a server that shuts down
/// quietly after its engine died.
fn server_with_a_member(pidfile: &Path) -> String {
    format!(
        "sleep 60 & echo $! > {}; wait $!; exit 0",
        pidfile.display()
    )
}

fn read_pid(path: &Path) -> i32 {
    let t = Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return pid;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no pid in {path:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(t.elapsed() < limit, "oomscope run did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the supervisor's tree reading lists `pid` (a member's end is
/// sent for members a reading listed).
fn wait_listed(col: &Collector, name: &str, pid: i32) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        let agents = col.json(&["agents"]);
        if !agents.to_string().contains(&format!("\"{name}\"")) {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let tl = timeline(&col.url, name);
        let listed = tl
            .samples
            .iter()
            .filter_map(|s| s.sample.as_ref())
            .any(|s| s.tree.iter().any(|p| p.pid == pid as u32));
        if listed {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the tree never listed pid {pid}");
}

/// The ends of the tree's other processes the supervisor recorded, and
/// whether it recorded a stop passed on.
fn member_ends(col: &Collector, name: &str) -> (Vec<pb::ChildExit>, bool) {
    let tl = timeline(&col.url, name);
    let mut ends = Vec::new();
    let mut stop = false;
    for e in tl.events.iter().filter_map(|e| e.event.as_ref()) {
        match &e.kind {
            Some(pb::event::Kind::ChildExit(x)) if x.member => ends.push(x.clone()),
            Some(pb::event::Kind::StopForwarded(s)) => stop |= s.signal == libc::SIGTERM,
            _ => {}
        }
    }
    (ends, stop)
}

#[test]
fn a_member_killed_by_sigkill_is_one_incident_that_stays_after_the_main_process_exits_0() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let pidfile = tmp.path().join("member.pid");
    let script = server_with_a_member(&pidfile);
    let mut sup = oomscope()
        .args(run_args(&col.url, "members"))
        .args(["--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let member = read_pid(&pidfile);
    wait_listed(&col, "members", member);
    unsafe { libc::kill(member, libc::SIGKILL) };
    let status = wait_exit(&mut sup, Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "the main process exited 0");
    // Past the collector's lost grace (1 s in tests) and the correlation of
    // what followed: the incident stays, alone.
    std::thread::sleep(Duration::from_secs(3));
    let incidents = col.json(&["incidents"]);
    let list = incidents.as_array().unwrap();
    assert_eq!(list.len(), 1, "one failure, one incident: {incidents:#}");
    let inc = &list[0];
    assert_eq!(inc["kind"], "member_died", "{inc:#}");
    assert_eq!(inc["domain"], "external_kill", "{inc:#}");
    assert!(
        inc["summary"]
            .as_str()
            .unwrap()
            .contains(&format!("member pid {member} (sleep)")),
        "{inc:#}"
    );

    let d = col.json(&["diagnose"]);
    assert_eq!(d["incident"], inc["id"]);
    assert_eq!(d["domain"], "external_kill");
    assert_eq!(d["victim"]["pid"], member);
    assert_eq!(d["victim"]["title"], "sleep");
    assert_eq!(
        d["victim"]["status"]["signal"], 9,
        "the member's end: {d:#}"
    );
    assert_eq!(d["exit"]["code"], 0, "the main process's end: {d:#}");
    let text = col.text(&["diagnose"]);
    assert!(
        text.contains(&format!(
            "Exit: member pid {member} (sleep) was killed by signal 9 (SIGKILL), then the main process exited with code 0"
        )),
        "{text}"
    );
    let evidence: Vec<&str> = d["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(
        evidence.iter().any(|l| l.contains("then the main process")
            && l.contains("exited with code 0")
            && l.contains("a consequence, not a clean stop")),
        "{evidence:#?}"
    );
    let causes = d["causes"].as_array().unwrap();
    assert_eq!(causes[0]["kind"], "external_kill", "{d:#}");
}

#[test]
fn a_stop_passed_on_ends_the_members_with_no_incident() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let pidfile = tmp.path().join("member.pid");
    // On SIGTERM the main process stops its member with SIGKILL, as servers
    // do with a worker that does not stop in time.
    let script = format!(
        "sleep 60 & echo $! > {}; trap 'kill -9 $!; exit 0' TERM; wait $!; exit 0",
        pidfile.display()
    );
    let mut sup = oomscope()
        .args(run_args(&col.url, "stopped"))
        .args(["--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let member = read_pid(&pidfile);
    wait_listed(&col, "stopped", member);
    unsafe { libc::kill(sup.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut sup, Duration::from_secs(20));
    assert_eq!(status.code(), Some(0));
    std::thread::sleep(Duration::from_secs(3));
    let incidents = col.json(&["incidents"]);
    assert_eq!(incidents, serde_json::json!([]), "a stop is no failure");
    // The member's end is on record all the same, after the stop.
    let (ends, stopped) = member_ends(&col, "stopped");
    assert!(
        ends.iter()
            .any(|x| x.pid == member as u32 && x.signal == Some(libc::SIGKILL)),
        "{ends:#?}"
    );
    assert!(stopped, "the stop is on record");
}

#[test]
fn members_that_outlive_the_child_keep_the_instance_open_and_are_named() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let pidfile = tmp.path().join("member.pid");
    // The main process leaves its member behind and exits 0.
    let script = format!("sleep 2 & echo $! > {}; exit 0", pidfile.display());
    let t = Instant::now();
    let out = oomscope()
        .args(run_args(&col.url, "outlived"))
        .args(["--", "sh", "-c", &script])
        .output()
        .unwrap();
    let elapsed = t.elapsed();
    let member = read_pid(&pidfile);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("live on") && stderr.contains(&format!("pid {member} (sleep)")),
        "{stderr}"
    );
    assert!(
        elapsed >= Duration::from_millis(1500),
        "the supervisor waited for the member: {elapsed:?}"
    );
    // The member was adopted and reaped by the supervisor: its status is known.
    let (ends, _) = member_ends(&col, "outlived");
    let end = ends
        .iter()
        .find(|x| x.pid == member as u32)
        .unwrap_or_else(|| panic!("no end of the member: {ends:#?}"));
    assert_eq!(end.exit_code, Some(0), "{end:#?}");
    assert_eq!(col.json(&["incidents"]), serde_json::json!([]));
}
