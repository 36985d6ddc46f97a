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

/// The labels that say the supervisor of `name` read the kernel's process
/// events and log: without them these tests could not fail.
fn assert_events_readable(col: &Collector, name: &str) {
    let hello = timeline(&col.url, name).hello.unwrap();
    for (label, want) in [
        ("member_exits", "process events"),
        ("kernel_log", "readable"),
    ] {
        assert_eq!(
            hello.labels.get(label).map(String::as_str),
            Some(want),
            "root on the host reads them here: {:?}",
            hello.labels
        );
    }
}

/// Servers run helpers that fail as a matter of course (pyenv's `python3`
/// shim runs `readlink`s that exit 1, `ctypes.util.find_library` runs
/// `ldconfig`): a tree reading that lists one in passing does not make its
/// exit a failure of the instance. A member that served and exits non-zero
/// does fail it. (A `python3` shim's `readlink` once made a false
/// `member_failed` incident in e2e_compare's clean run.)
#[test]
fn a_helpers_failed_exit_is_no_incident_and_a_members_is() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let pidfile = tmp.path().join("member.pid");
    // Helpers that live 0.2 s, ten readings each, and exit 1; then a member
    // that lives 1.5 s and exits 3; the main process exits 0.
    let script = format!(
        "for i in 1 2 3 4 5; do sh -c 'sleep 0.2; exit 1'; done; \
         sh -c 'sleep 1.5; exit 3' & echo $! > {}; wait $!; exit 0",
        pidfile.display()
    );
    let out = oomscope()
        .args(["run", "--collector", &col.url, "--name", "helpers"])
        .args(["--interval", "20ms", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let member = read_pid(&pidfile) as u32;
    assert_events_readable(&col, "helpers");

    // The readings listed the helpers: their exits were in reach.
    let tl = timeline(&col.url, "helpers");
    let mut helpers: Vec<u32> = tl
        .samples
        .iter()
        .filter_map(|s| s.sample.as_ref())
        .flat_map(|s| s.tree.iter())
        .filter(|p| p.command.contains("exit 1"))
        .map(|p| p.pid)
        .collect();
    helpers.sort_unstable();
    helpers.dedup();
    assert!(
        helpers.len() >= 4,
        "readings listed the helpers: {helpers:?}"
    );

    let incidents = col.json(&["incidents"]);
    let list = incidents.as_array().unwrap();
    assert_eq!(list.len(), 1, "the member's failure only: {incidents:#}");
    let inc = &list[0];
    assert_eq!(inc["kind"], "member_failed", "{inc:#}");
    let summary = inc["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!("member pid {member} (sh)")) && summary.contains("code 3"),
        "{inc:#}"
    );
    let (ends, _) = member_ends(&col, "helpers");
    assert!(
        ends.iter()
            .all(|x| !helpers.contains(&x.pid) || x.exit_code == Some(0)),
        "no helper's failed exit is on record: {ends:#?}"
    );
    let end = ends
        .iter()
        .find(|x| x.pid == member)
        .unwrap_or_else(|| panic!("no end of the member: {ends:#?}"));
    assert_eq!(end.exit_code, Some(3), "{end:#?}");
    assert!(
        end.runtime_ns >= 1_400_000_000,
        "it lived 1.5 s: {}",
        end.runtime_ns
    );
}

const NS_LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";

/// Whether this test may choose the pid of the next process (root in the
/// PID namespace).
fn can_choose_pids() -> bool {
    std::fs::read_to_string(NS_LAST_PID)
        .is_ok_and(|last| std::fs::write(NS_LAST_PID, last.trim()).is_ok())
}

/// When a member has ended, its pid is free: a new member of the tree that
/// takes it is a new life, and its failure is recorded like any other.
#[test]
fn a_new_member_with_an_ended_members_pid_is_recorded() {
    if !can_choose_pids() {
        eprintln!("skipped: {NS_LAST_PID} is not writable here");
        return;
    }
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let (first, second) = (tmp.path().join("first.pid"), tmp.path().join("second.pid"));
    // The first member ends cleanly; then the main process starts members
    // until one gets the first one's pid (others may take it first), and
    // that one lives 1.5 s and exits 3.
    let script = format!(
        "sleep 1.2 & P=$!; echo $P > {first}; wait $P; i=0; \
         while [ $i -lt 50 ]; do i=$((i+1)); echo $((P-1)) > {NS_LAST_PID}; \
         sh -c 'sleep 1.5; exit 3' & Q=$!; [ $Q = $P ] && break; kill $Q; wait $Q; Q=none; done; \
         echo $Q > {second}; [ $Q = none ] || wait $Q; exit 0",
        first = first.display(),
        second = second.display(),
    );
    let out = oomscope()
        .args(run_args(&col.url, "reborn"))
        .args(["--", "sh", "-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let pid = read_pid(&first);
    let again = std::fs::read_to_string(&second).unwrap();
    if again.trim() == "none" {
        eprintln!("skipped: pid {pid} was taken by others 50 times");
        return;
    }
    assert_eq!(again.trim(), pid.to_string());
    assert_events_readable(&col, "reborn");

    let (ends, _) = member_ends(&col, "reborn");
    let lives: Vec<_> = ends
        .iter()
        .filter(|x| x.pid == pid as u32)
        .map(|x| (x.exit_code, x.signal))
        .collect();
    assert_eq!(
        lives,
        [(Some(0), None), (Some(3), None)],
        "both lives of pid {pid} ended on record: {ends:#?}"
    );
    let incidents = col.json(&["incidents"]);
    let list = incidents.as_array().unwrap();
    assert_eq!(list.len(), 1, "{incidents:#}");
    assert_eq!(list[0]["kind"], "member_failed", "{incidents:#}");
    let summary = list[0]["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!("member pid {pid} (sh)")) && summary.contains("code 3"),
        "{summary}"
    );
}

/// The kernel's process events and OOM records are host-wide and name
/// processes by pid: once a member has ended, a process outside the tree
/// that takes its pid is not the instance's, and the kernel's kill of it is
/// no incident of the instance.
#[test]
fn a_process_outside_the_tree_with_an_ended_members_pid_is_not_the_instances() {
    if !can_choose_pids() {
        eprintln!("skipped: {NS_LAST_PID} is not writable here");
        return;
    }
    if TestCgroup::own().is_none() {
        eprintln!("skipped: no memory cgroup controller here");
        return;
    }
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let (pidfile, done) = (tmp.path().join("member.pid"), tmp.path().join("done"));
    // A member that lives 1.2 s and ends cleanly; the main process then
    // waits for the test to finish.
    let script = format!(
        "sleep 1.2 & echo $! > {}; wait $!; while [ ! -e {} ]; do sleep 0.05; done; exit 0",
        pidfile.display(),
        done.display()
    );
    let mut sup = oomscope()
        .args(run_args(&col.url, "reused"))
        .args(["--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let member = read_pid(&pidfile);
    wait_listed(&col, "reused", member);
    let proc_dir = format!("/proc/{member}");
    let t = Instant::now();
    while Path::new(&proc_dir).exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "the member ended");
        std::thread::sleep(Duration::from_millis(20));
    }

    // A process of this test takes the pid in a 64 MiB cgroup, and the
    // kernel kills it there.
    let cg = TestCgroup::create(None, "reused", Some(64 << 20));
    let hog = ["python3", "-c", "b = bytearray(200 << 20)"];
    let mut taken = false;
    for _ in 0..50 {
        std::fs::write(NS_LAST_PID, (member - 1).to_string()).unwrap();
        let mut c = cg
            .command(&hog)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = c.id() as i32;
        let status = c.wait().unwrap();
        if pid == member {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(libc::SIGKILL), "the kernel killed it");
            taken = true;
            break;
        }
    }
    // Polls of the kernel log and events pass before the main process ends.
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(&done, "").unwrap();
    let status = wait_exit(&mut sup, Duration::from_secs(20));
    if !taken {
        eprintln!("skipped: pid {member} was taken by others 50 times");
        return;
    }
    assert_eq!(status.code(), Some(0));
    assert_events_readable(&col, "reused");

    let tl = timeline(&col.url, "reused");
    let kills: Vec<_> = tl
        .events
        .iter()
        .filter_map(|e| match e.event.as_ref()?.kind.as_ref()? {
            pb::event::Kind::KernelOomKill(k) => Some(k.pid),
            _ => None,
        })
        .collect();
    assert!(
        kills.is_empty(),
        "a stranger's kill is not the instance's: {kills:?}"
    );
    assert_eq!(col.json(&["incidents"]), serde_json::json!([]));
}
