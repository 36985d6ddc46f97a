//! `oomscope node` against the real kernel: processes it did not start, in
//! cgroups the test makes (the watcher is kept to the test's own subtree
//! with --cgroup-root), one killed at its 64 MiB limit. One incident, for
//! that cgroup, with the kernel's record (anon-rss at the kill, which no
//! file read afterwards still shows); the other cgroup has a timeline and
//! no incident; kills from before the start are not incidents; without the
//! kernel's log the kill is still recorded, from the cgroup's counter;
//! under an open-file limit that holds fewer cgroups than there are, it
//! watches what the limit holds, says so once, and does not spin.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// The hog asks for this much in a 64 MiB cgroup.
const HOG: &str = "b = bytearray(200 << 20)";

/// The watcher the test started, killed if the test fails before stopping it.
struct Watcher(Option<Child>);

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `oomscope node` on `root` reporting to `col`, its stderr in `log`.
fn watcher(col: &Collector, root: &Path, log: &Path, extra: &[&str]) -> Watcher {
    watcher_with(col, root, log, extra, &[])
}

/// `watcher` with `env` set for it.
fn watcher_with(
    col: &Collector,
    root: &Path,
    log: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Watcher {
    let mut cmd = watcher_command(col, root, log, extra);
    Watcher(Some(cmd.envs(env.iter().copied()).spawn().unwrap()))
}

/// The command `watcher` spawns.
fn watcher_command(col: &Collector, root: &Path, log: &Path, extra: &[&str]) -> Command {
    let mut cmd = oomscope();
    cmd.args(["node", "--collector", &col.url, "--interval", "200ms"])
        .arg("--cgroup-root")
        .arg(root)
        .args(extra)
        .stderr(std::fs::File::create(log).unwrap());
    cmd
}

/// The node's agents, once `n` are connected (at most 10 s).
fn wait_agents(col: &Collector, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all = col.json(&["agents"]);
        let connected: Vec<Value> = all
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["state"] == "connected" && a["hello"]["runtime"] == "node")
            .cloned()
            .collect();
        if connected.len() >= n {
            return connected;
        }
        assert!(
            Instant::now() < deadline,
            "the watcher's {n} streams never connected: {all:#}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The agent id of the stream watching cgroup `path`.
fn agent_of(agents: &[Value], path: &str) -> String {
    agents
        .iter()
        .find(|a| a["hello"]["labels"]["container.cgroup"] == path)
        .unwrap_or_else(|| panic!("no stream for {path}: {agents:#?}"))["hello"]["agent_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Stops the watcher the test started (SIGTERM) and returns its stderr.
fn stop(mut watcher: Watcher, log: &Path) -> String {
    let mut w = watcher.0.take().expect("running");
    // SAFETY: kill(2) on the test's own child.
    unsafe { libc::kill(w.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = w.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the watcher did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    let said = std::fs::read_to_string(log).unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "the watcher's exit; it said: {said}"
    );
    said
}

/// Runs the hog in `cg` to its kill; returns its pid.
fn hog(cg: &TestCgroup) -> u32 {
    let mut c = cg
        .command(&["python3", "-c", HOG])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = c.id();
    let status = c.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "the kernel killed the hog: {status:?}"
    );
    pid
}

/// `n` samples on `agent`'s timeline: the watcher has swept that often.
fn wait_samples(col: &Collector, agent: &str, n: usize) -> oomscope_proto::v1::TimelineResponse {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = timeline(&col.url, agent);
        if t.samples.len() >= n {
            return t;
        }
        assert!(Instant::now() < deadline, "{agent}: no {n} samples");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn incidents(col: &Collector) -> Vec<Value> {
    col.json(&["incidents"]).as_array().unwrap().clone()
}

/// The incidents, once there are `n` (at most `wait`).
fn wait_incidents(col: &Collector, n: usize, wait: Duration) -> Vec<Value> {
    let deadline = Instant::now() + wait;
    loop {
        let all = incidents(col);
        if all.len() >= n || Instant::now() > deadline {
            return all;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_kill_in_a_watched_cgroup_is_one_incident_with_the_kernels_record() {
    let _serial = serial();
    let dir = tempdir();
    let col = Collector::start(&dir.path().join("db"));
    let parent = TestCgroup::create(None, "node-kernel", None);
    let limited = TestCgroup::create(Some(&parent), "hog", Some(64 * MIB));
    let calm = TestCgroup::create(Some(&parent), "calm", None);
    // A kill the kernel logged before the watcher started: not an incident.
    let before = hog(&limited);
    let log = dir.path().join("node.log");
    let w = watcher(&col, &parent.dir, &log, &[]);
    let agents = wait_agents(&col, 3);
    let watcher_pid = w.0.as_ref().unwrap().id();
    // Never the victim: shielded as the supervisor is, or it says why not.
    let adj = std::fs::read_to_string(format!("/proc/{watcher_pid}/oom_score_adj")).unwrap();
    let shielded = adj.trim() == "-1000";
    assert_eq!(shielded, has_sys_resource(), "oom_score_adj {adj}");
    let (hog_agent, calm_agent) = (
        agent_of(&agents, &limited.path),
        agent_of(&agents, &calm.path),
    );

    // Started outside oomscope: a process holding 16 MiB that outlives the kill.
    let mut neighbour = calm
        .command(&["python3", "-c", "import time; b = bytearray(16 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(4)"])
        .spawn()
        .unwrap();
    wait_samples(&col, &hog_agent, 2);
    assert_eq!(
        incidents(&col).len(),
        0,
        "the kill of {before} before the start"
    );
    let victim = hog(&limited);
    let killed_at = Instant::now();

    let found = wait_incidents(&col, 1, Duration::from_secs(5));
    let within = killed_at.elapsed();
    assert_eq!(found.len(), 1, "exactly one incident: {found:#?}");
    let inc = &found[0];
    // The bound: an incident within 2 s of the kill.
    assert!(within < Duration::from_secs(2), "incident after {within:?}");
    assert_eq!(inc["kind"], "kernel_oom_kill");
    assert_eq!(
        inc["agent_id"],
        hog_agent.as_str(),
        "the right cgroup: {inc:#}"
    );

    let d = col.json(&["diagnose", inc["id"].as_str().unwrap()]);
    let k = &d["kernel_report"];
    assert_eq!(k["pid"], victim, "the kernel's victim is the hog: {d:#}");
    assert_eq!(k["command"], "python3");
    assert_eq!(k["task_memcg"], limited.path.as_str());
    assert_eq!(k["memcg_limit_bytes"], 64 * MIB);
    // At the kill the victim held most of the 64 MiB: the kernel's figure.
    // After its death the cgroup's files show almost nothing.
    let anon = k["anon_rss_bytes"].as_u64().unwrap();
    assert!((40 * MIB..=64 * MIB).contains(&anon), "anon-rss {anon}");
    let after = std::fs::read_to_string(limited.dir.join("memory.usage_in_bytes"))
        .or_else(|_| std::fs::read_to_string(limited.dir.join("memory.current")))
        .unwrap();
    assert!(
        after.trim().parse::<u64>().unwrap() < anon / 2,
        "the files read after the kill no longer show the victim's memory"
    );
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    // The "done when": the cgroup, the name its identity gives the
    // stream, and the fixes.
    let hog_name = agents
        .iter()
        .find(|a| a["hello"]["agent_id"] == hog_agent.as_str())
        .unwrap()["hello"]["name"]
        .clone();
    assert!(hog_name.as_str().unwrap().starts_with("hog-"), "{hog_name}");
    assert_eq!(d["agent"], hog_name, "{d:#}");
    assert_eq!(d["cgroup"]["path"], limited.path.as_str(), "{d:#}");
    assert!(!d["fixes"].as_array().is_none_or(|f| f.is_empty()), "{d:#}");

    // The neighbour: a timeline with its memory, no incident, not signalled.
    let t = wait_samples(&col, &calm_agent, 3);
    let peak = t
        .samples
        .iter()
        .filter_map(|s| s.sample.as_ref()?.cgroup.first().map(|l| l.usage_bytes))
        .max()
        .unwrap();
    assert!(
        peak >= 16 * MIB,
        "the neighbour's 16 MiB on its timeline: {peak}"
    );
    let status = neighbour.wait().unwrap();
    assert_eq!(status.code(), Some(0), "the neighbour ended by itself");
    let said = stop(w, &log);
    assert!(incidents(&col).len() == 1, "still one incident");
    assert!(said.contains("watching 3 memory cgroup(s)"), "{said}");
    assert_eq!(
        said.contains("cannot set the node watcher's oom_score_adj to -1000"),
        !shielded,
        "{said}"
    );
}

/// The kernel's records of kills on `agent`'s timeline: (counted only, pid, anon-rss).
fn kill_records(col: &Collector, agent: &str) -> Vec<(bool, u32, u64)> {
    timeline(&col.url, agent)
        .events
        .iter()
        .filter_map(|e| match e.event.as_ref()?.kind.as_ref()? {
            oomscope_proto::v1::event::Kind::KernelOomKill(k) => {
                Some((k.counted_only, k.pid, k.anon_rss_bytes))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_kernel_record_after_its_counted_kill_joins_that_incident() {
    let _serial = serial();
    let dir = tempdir();
    let col = Collector::start(&dir.path().join("db"));
    let parent = TestCgroup::create(None, "node-late-record", None);
    let limited = TestCgroup::create(Some(&parent), "hog", Some(64 * MIB));
    let log = dir.path().join("node.log");
    // The watcher holds each kernel record it reads for 3 s, as a loaded
    // host delays it: the counter's wait (1 s) runs out before the record.
    let w = watcher_with(
        &col,
        &parent.dir,
        &log,
        &[],
        &[(oomscope_supervisor::node::TEST_KMSG_DELAY_ENV, "3000")],
    );
    let agents = wait_agents(&col, 2);
    let hog_agent = agent_of(&agents, &limited.path);
    let victim = hog(&limited);

    // First the counted kill: its incident, with no victim named yet.
    let found = wait_incidents(&col, 1, Duration::from_secs(5));
    assert_eq!(found.len(), 1, "{found:#?}");
    let id = found[0]["id"].as_str().unwrap().to_string();
    assert_eq!(found[0]["agent_id"], hog_agent.as_str());
    let records = kill_records(&col, &hog_agent);
    assert_eq!(
        records.iter().map(|r| r.0).collect::<Vec<_>>(),
        [true],
        "the counted kill came first, alone: {records:?}"
    );

    // Then the kernel's record of the same kill, on the same timeline.
    let deadline = Instant::now() + Duration::from_secs(10);
    let records = loop {
        let r = kill_records(&col, &hog_agent);
        if r.iter().any(|k| !k.0) {
            break r;
        }
        assert!(Instant::now() < deadline, "no kernel record came: {r:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(records.len(), 2, "{records:?}");
    let (_, pid, anon) = records.into_iter().find(|k| !k.0).unwrap();
    assert_eq!(pid, victim);

    // One kill, one incident: the record joined the counted one, and its
    // diagnosis carries the kernel's figures.
    let all = incidents(&col);
    assert_eq!(all.len(), 1, "one incident for one kill: {all:#?}");
    assert_eq!(all[0]["id"], id.as_str(), "{all:#?}");
    let d = col.json(&["diagnose", &id]);
    let k = &d["kernel_report"];
    assert_eq!(k["pid"], victim, "the kernel's victim: {d:#}");
    assert_eq!(k["anon_rss_bytes"], anon, "{d:#}");
    assert!((40 * MIB..=64 * MIB).contains(&anon), "anon-rss {anon}");
    assert!(
        all[0]["summary"]
            .as_str()
            .unwrap()
            .contains(&format!("pid {victim}")),
        "the incident names the victim now: {:#}",
        all[0]
    );
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    stop(w, &log);
    assert_eq!(incidents(&col).len(), 1, "still one incident");
}

#[test]
fn a_cgroup_made_after_the_start_counts_its_first_kill() {
    let _serial = serial();
    let dir = tempdir();
    let col = Collector::start(&dir.path().join("db"));
    let parent = TestCgroup::create(None, "node-late", None);
    let log = dir.path().join("node.log");
    let w = watcher(&col, &parent.dir, &log, &[]);
    wait_agents(&col, 1);
    // Made and killed between two walks of the tree: the kernel's record
    // names a cgroup the watcher has not seen yet, and finds it.
    let late = TestCgroup::create(Some(&parent), "late", Some(64 * MIB));
    let victim = hog(&late);
    let found = wait_incidents(&col, 1, Duration::from_secs(5));
    assert_eq!(found.len(), 1, "{found:#?}");
    let agents = wait_agents(&col, 2);
    assert_eq!(found[0]["agent_id"], agent_of(&agents, &late.path).as_str());
    let d = col.json(&["diagnose", found[0]["id"].as_str().unwrap()]);
    assert_eq!(d["kernel_report"]["pid"], victim);
    stop(w, &log);
    assert_eq!(
        incidents(&col).len(),
        1,
        "the counter confirmed the same kill"
    );
}

#[test]
fn kills_before_the_start_are_the_baseline_and_without_the_kernel_log_the_counter_speaks() {
    let _serial = serial();
    let dir = tempdir();
    let col = Collector::start(&dir.path().join("db"));
    let parent = TestCgroup::create(None, "node-counter", None);
    let limited = TestCgroup::create(Some(&parent), "hog", Some(64 * MIB));
    // Before the watcher: its counter's 1 is the baseline, not an incident.
    hog(&limited);
    let log = dir.path().join("node.log");
    let missing = dir.path().join("no-kmsg");
    let w = watcher(
        &col,
        &parent.dir,
        &log,
        &["--kmsg", missing.to_str().unwrap()],
    );
    let agents = wait_agents(&col, 2);
    let hog_agent = agent_of(&agents, &limited.path);
    wait_samples(&col, &hog_agent, 3);
    assert_eq!(incidents(&col).len(), 0, "a kill from before the start");

    let victim = hog(&limited);
    let killed_at = Instant::now();
    let found = wait_incidents(&col, 1, Duration::from_secs(5));
    let within = killed_at.elapsed();
    assert_eq!(found.len(), 1, "exactly one incident: {found:#?}");
    assert!(within < Duration::from_secs(2), "incident after {within:?}");
    assert_eq!(found[0]["agent_id"], hog_agent.as_str());
    let d = col.json(&["diagnose", found[0]["id"].as_str().unwrap()]);
    // No record to name the victim: the cgroup's counter, and it says so.
    assert!(d["kernel_report"].is_null(), "{:#}", d["kernel_report"]);
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    assert!(
        found[0]["summary"]
            .as_str()
            .unwrap()
            .contains(&limited.path),
        "{:#}",
        found[0]
    );
    let evidence = evidence_text(&d);
    assert!(
        evidence.contains("oom_kill 1 -> 2")
            && evidence.contains("the kernel's record of the kill was not read")
            && evidence.contains("no-kmsg")
            && !evidence.contains(&format!("pid {victim}")),
        "{evidence}"
    );
    let said = stop(w, &log);
    assert!(
        said.contains("the kernel log is unreadable") && said.contains("no-kmsg"),
        "{said}"
    );
    let agents = col.json(&["agents"]);
    let label = agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["hello"]["agent_id"] == hog_agent.as_str())
        .unwrap()["hello"]["labels"]["kernel_log"]
        .clone();
    assert!(
        label.as_str().unwrap().starts_with("unreadable: "),
        "{label}"
    );
}

/// The user and system CPU ticks of `pid` so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // After the command's closing parenthesis: utime and stime are the 12th and 13th fields.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn under_a_low_open_file_limit_the_watcher_watches_what_it_holds_and_says_so() {
    use oomscope_agent_core::readers::cgroup::LEVEL_DIR_DESCRIPTORS;
    use oomscope_supervisor::node::{
        CGROUP_CAP_LABEL, DESCRIPTORS_PER_CGROUP, RESERVED_DESCRIPTORS,
    };
    use std::os::unix::process::CommandExt;
    let _serial = serial();
    let dir = tempdir();
    let col = Collector::start(&dir.path().join("db"));
    let parent = TestCgroup::create(None, "node-nofile", None);
    let _kids: Vec<TestCgroup> = (0..11)
        .map(|i| TestCgroup::create(Some(&parent), &format!("c{i}"), None))
        .collect();
    // A hard limit that holds three cgroups (and a few spare descriptors),
    // the soft one below it: the watcher raises the soft one to the hard.
    let holds = 3;
    let hard = (RESERVED_DESCRIPTORS + holds * DESCRIPTORS_PER_CGROUP + 4) as libc::rlim_t;
    let soft = (RESERVED_DESCRIPTORS / 2) as libc::rlim_t;
    let log = dir.path().join("node.log");
    let mut cmd = watcher_command(&col, &parent.dir, &log, &[]);
    // SAFETY: setrlimit in the child between fork and exec (async-signal-safe).
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            match libc::setrlimit(libc::RLIMIT_NOFILE, &lim) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let w = Watcher(Some(cmd.spawn().unwrap()));
    let pid = w.0.as_ref().unwrap().id();
    let agents = wait_agents(&col, holds);

    // Three discovery periods (2 s each) at the cap: the CPU it takes, and
    // that no fourth stream starts.
    let ticks = cpu_ticks(pid);
    let window = Instant::now();
    std::thread::sleep(Duration::from_secs(6));
    let spent = cpu_ticks(pid) - ticks;
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    assert!(
        spent * 10 < hz * window.elapsed().as_secs(),
        "not spinning at the cap: {spent} ticks in {:?}",
        window.elapsed()
    );
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let numbers: Vec<u64> = open_files
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(numbers, [hard, hard], "soft raised to hard: {open_files}");
    let fds: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .collect();
    assert!(
        fds.len() as u64 <= hard,
        "{} descriptors under a limit of {hard}",
        fds.len()
    );
    // Each watched cgroup's directory and three counter files, held open
    // (a whole reading may hold one more for a moment).
    let in_cgroups = fds.iter().filter(|p| p.starts_with(&parent.dir)).count();
    assert!(
        (holds * LEVEL_DIR_DESCRIPTORS..=holds * LEVEL_DIR_DESCRIPTORS + 1).contains(&in_cgroups),
        "{in_cgroups} cgroup files held: {fds:#?}"
    );

    let now = wait_agents(&col, holds);
    assert_eq!(
        now.len(),
        holds,
        "watching only what the limit holds: {now:#?}"
    );
    assert_eq!(
        agents.len(),
        holds,
        "no more at the start either: {agents:#?}"
    );
    for a in &now {
        let cap = a["hello"]["labels"][CGROUP_CAP_LABEL]
            .as_str()
            .unwrap_or("");
        assert!(
            cap.starts_with(&format!("at most {holds} cgroups, not --max-cgroups 512"))
                && cap.contains(&format!("open-file limit {hard}")),
            "the stream's Hello says the cap: {a:#}"
        );
    }
    let said = stop(w, &log);
    assert_eq!(
        said.matches("the open-file limit").count(),
        2,
        "the cap, once, and that it left cgroups out, once: {said}"
    );
    assert!(
        said.contains(&format!(
            "watching at most {holds} cgroups, not --max-cgroups 512"
        )) && said.contains(&format!("more than {holds} memory cgroups under"))
            && said.contains(&format!("watching {holds} memory cgroup(s)")),
        "{said}"
    );
}

#[test]
fn a_root_without_a_memory_controller_is_a_clear_error() {
    let dir = tempdir();
    let out = Command::new(bin())
        .args(["node", "--collector", "http://127.0.0.1:9", "--cgroup-root"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("no memory cgroup controller at"), "{said}");
}
