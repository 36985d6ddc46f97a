//! `oomscope run --memory-limit`: the child runs in a memory cgroup the
//! supervisor made with that limit, a growth past it is a cgroup OOM at that
//! limit, and the cgroup is gone when the run ends. Real cgroup (v1 here;
//! the test's own), real processes, a real collector.

mod common;

use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

/// The `oomscope-run-*` cgroups under `dir`.
fn run_cgroups_under(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("oomscope-run-"))
        .collect()
}

#[test]
fn the_child_runs_under_the_limit_and_the_cgroup_is_removed_after() {
    let _guard = serial();
    let (own_dir, own_path, version) =
        TestCgroup::own().expect("this test needs a memory cgroup controller");
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // The child prints its memory cgroup and that cgroup's limit.
    let limit_file = if version == "v1" {
        "memory.limit_in_bytes"
    } else {
        "memory.max"
    };
    let mount = own_dir.to_string_lossy()
        [..own_dir.to_string_lossy().len() - own_path.trim_end_matches('/').len()]
        .to_string();
    let script = format!(
        "p=$(grep -E ':memory:|^0::' /proc/self/cgroup | head -1 | cut -d: -f3); echo $p; cat {mount}$p/{limit_file}"
    );
    let out = run(
        &col.url,
        "limit-where",
        &["--memory-limit", "96M"],
        &["sh", "-c", &script],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.lines();
    let path = lines.next().unwrap();
    let limit: u64 = lines.next().unwrap().trim().parse().unwrap();
    assert!(
        path.starts_with(&format!("{}/oomscope-run-", own_path.trim_end_matches('/'))),
        "the child ran in a cgroup made under ours ({own_path}): {path}"
    );
    assert_eq!(limit, 96 * MIB, "{stdout}");
    let made = own_dir.join(path.rsplit('/').next().unwrap());
    assert!(!made.exists(), "{} removed at exit", made.display());
}

#[test]
fn growth_past_the_limit_is_a_cgroup_oom_at_that_limit() {
    let _guard = serial();
    let (own_dir, own_path, _) =
        TestCgroup::own().expect("this test needs a memory cgroup controller");
    let before = run_cgroups_under(&own_dir);
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let out = run(
        &col.url,
        "limit-oom",
        &["--memory-limit", "64M"],
        &[
            "python3",
            "-c",
            "b=[bytearray(1<<20) for _ in range(1<<20)]",
        ],
    );
    assert!(!out.status.success(), "the child was killed: {out:?}");
    let incs = col.incidents_of("limit-oom", 1, Duration::from_secs(10));
    let id = incs[0]["id"].as_str().unwrap().to_string();
    let d = col.json(&["diagnose", &id]);
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    assert_eq!(d["cgroup"]["limit_bytes"], 64 * MIB, "{d:#}");
    let owner = d["cgroup"]["owner_level"].as_str().unwrap();
    assert!(
        owner.starts_with(&format!("{}/oomscope-run-", own_path.trim_end_matches('/'))),
        "the limit is the run's own cgroup's: {owner}"
    );
    assert_eq!(
        run_cgroups_under(&own_dir),
        before,
        "the run's cgroup is removed"
    );
}
