//! Domain verdicts on real memory failures: a real child under `oomscope run`,
//! real memory cgroups, real rlimits, a real tmpfs, a real collector over
//! loopback gRPC with a real SQLite file.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// The only incident of `name`, diagnosed.
fn diagnose_only(col: &Collector, name: &str) -> Value {
    let incs = col.incidents_of(name, 1, Duration::from_secs(10));
    assert!(!incs.is_empty(), "no incident recorded for {name}");
    let id = incs.last().unwrap()["id"].as_str().unwrap().to_string();
    col.json(&["diagnose", &id])
}

/// 200 MiB allocated in `cg` (under a 64 MiB limit on its level or above):
/// the kernel kills it (exit 137), and its incident is diagnosed.
fn killed_in_cgroup(col: &Collector, cg: &TestCgroup, name: &str) -> Value {
    let out = cg.run(col, name, &["python3", "-c", "bytearray(200<<20)"]);
    assert_eq!(
        out.status.code(),
        Some(137),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    diagnose_only(col, name)
}

#[test]
fn cgroup_limit_on_own_level() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let cg = TestCgroup::create(None, "oomscope-own", Some(64 * MIB));
    let d = killed_in_cgroup(&col, &cg, "cg-own");
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    assert_eq!(d["exit"]["signal"], 9);
    assert_eq!(d["cgroup"]["limit_bytes"], 67108864);
    assert_eq!(d["cgroup"]["owner_level"], cg.path.as_str());
    let ev = evidence_text(&d);
    assert!(ev.contains("peak"), "evidence names the peak: {ev}");
    assert!(
        ev.contains("oom_kill"),
        "evidence names the oom_kill increase: {ev}"
    );
    assert!(
        ev.contains("67108864") || ev.contains("64.0"),
        "evidence shows the limit: {ev}"
    );

    // People read the text form.
    let id = col.incidents_of("cg-own", 1, Duration::ZERO)[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let text = col.text(&["diagnose", &id]);
    assert!(
        text.contains("cgroup") && text.contains("64.00 MiB") && text.contains("SIGKILL"),
        "{text}"
    );
}

#[test]
fn cgroup_limit_on_parent_level() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let parent = TestCgroup::create(None, "oomscope-parent", Some(64 * MIB));
    let child = TestCgroup::create(Some(&parent), "leaf", None);
    let d = killed_in_cgroup(&col, &child, "cg-parent");
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    assert_eq!(d["cgroup"]["limit_bytes"], 67108864);
    assert_eq!(
        d["cgroup"]["owner_level"],
        parent.path.as_str(),
        "the parent owns the limit: {d:#}"
    );
    assert_eq!(d["cgroup"]["path"], child.path.as_str());
    drop(child);
}

#[test]
fn address_space_limit() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let out = run(
        &col.url,
        "as-limit",
        &[],
        &[
            "prlimit",
            "--as=268435456",
            "python3",
            "-c",
            "bytearray(300<<20)",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("MemoryError"),
        "stderr passes through"
    );

    let d = diagnose_only(&col, "as-limit");
    assert_eq!(d["domain"], "address_space", "{d:#}");
    assert_eq!(d["exit"]["code"], 1);
    let ev = evidence_text(&d);
    assert!(
        ev.contains("268435456") || ev.contains("256.0 MiB"),
        "evidence shows the 256 MiB limit: {ev}"
    );
}

#[test]
fn shm_full_is_sigbus() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let mnt = tmp.path().join("shm");
    std::fs::create_dir(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(ok.success(), "mounting a 1 MiB tmpfs");
    struct Umount(std::path::PathBuf);
    impl Drop for Umount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _guard = Umount(mnt.clone());
    let script = format!(
        "import mmap,os\nfd=os.open('{}/seg',os.O_RDWR|os.O_CREAT)\nos.ftruncate(fd,8<<20)\n\
         m=mmap.mmap(fd,8<<20)\nfor i in range(0,8<<20,4096): m[i]=1\n",
        mnt.display()
    );
    let out = run(&col.url, "shm", &[], &["python3", "-c", &script]);
    assert_eq!(
        out.status.code(),
        Some(128 + 7),
        "SIGBUS: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let d = diagnose_only(&col, "shm");
    assert_eq!(d["domain"], "shm", "{d:#}");
    assert_eq!(d["exit"]["signal"], 7);
}

#[test]
fn external_kill_is_not_a_memory_verdict() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let pidfile = tmp.path().join("pid");
    let script = format!("echo $$ > {}; exec sleep 30", pidfile.display());
    let url = col.url.clone();
    let runner = std::thread::spawn(move || run(&url, "ext-kill", &[], &["sh", "-c", &script]));
    let pid = loop {
        if let Some(p) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
        {
            break p;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(300));
    // The test started this process (through oomscope run): it may kill it.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let out = runner.join().unwrap();
    assert_eq!(out.status.code(), Some(137));
    let d = diagnose_only(&col, "ext-kill");
    assert_eq!(d["domain"], "external_kill", "{d:#}");
    assert_eq!(d["exit"]["signal"], 9);
    assert!(
        d["cgroup"].is_null(),
        "no cgroup verdict for an external kill: {d:#}"
    );
}

#[test]
fn clean_exit_is_no_incident() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let out = run(&col.url, "clean", &[], &["python3", "-c", "print('fine')"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "fine\n",
        "stdout passes through unchanged"
    );
    // The agent is known (so the stream arrived), but nothing is an incident.
    let agents = col.json(&["agents"]);
    assert!(
        agents
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["hello"]["name"] == "clean" && a["state"] == "disconnected"),
        "{agents:#}"
    );
    assert!(col
        .incidents_of("clean", 1, Duration::from_millis(1500))
        .is_empty());
}

#[test]
fn crash_loop_is_bounded_and_reported() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let t0 = std::time::Instant::now();
    let out = run(
        &col.url,
        "looper",
        &["--restart", "3", "--backoff", "100ms"],
        &["sh", "-c", "echo boom >&2; exit 3"],
    );
    let took = t0.elapsed();
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().filter(|l| *l == "boom").count(),
        4,
        "1 run + 3 restarts: {stderr}"
    );
    // Growing delays: 0.1 + 0.2 + 0.4 s.
    for d in [
        "restart 1/3 in 0.1 s",
        "restart 2/3 in 0.2 s",
        "restart 3/3 in 0.4 s",
    ] {
        assert!(stderr.contains(d), "missing `{d}` in {stderr}");
    }
    assert!(
        took >= Duration::from_millis(700),
        "the delays were slept: {took:?}"
    );
    assert!(stderr.contains("crash loop"), "{stderr}");
    let incs = col.incidents_of("looper", 1, Duration::from_secs(5));
    assert!(incs.iter().any(|i| i["kind"] == "crash_loop"), "{incs:#?}");
    // A plain failing exit without OOM text is not an incident of its own.
    assert!(incs.iter().all(|i| i["kind"] == "crash_loop"), "{incs:#?}");
}
