//! A cgroup directory held open (`LevelDir`, what `oomscope node` keeps for
//! each cgroup it watches, with its counter files) reads the same as by
//! path, and its held files show each new value; once a real cgroup is
//! gone its readings are partial, also after a new one took its path.

use std::fs;

use oomscope_agent_core::readers::cgroup::{self, LevelDir, Version};
use oomscope_testkit::TestCgroup;

fn v1_files(dir: &std::path::Path, usage: u64, oom_kill: u64) {
    for (name, text) in [
        ("memory.limit_in_bytes", "67108864\n".to_string()),
        ("memory.usage_in_bytes", format!("{usage}\n")),
        ("memory.max_usage_in_bytes", "9000000\n".to_string()),
        ("memory.failcnt", "3\n".to_string()),
        (
            "memory.oom_control",
            format!("oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n"),
        ),
        ("memory.stat", "cache 4096\nrss 8192\n".to_string()),
    ] {
        fs::write(dir.join(name), text).unwrap();
    }
}

#[test]
fn a_held_directory_reads_as_by_path_and_its_held_files_move() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cg");
    fs::create_dir(&dir).unwrap();
    v1_files(&dir, 5_000_000, 1);
    let held = LevelDir::open(&dir, Version::V1);
    let by_path = cgroup::read_level(&dir, "/cg", Version::V1);
    assert!(!by_path.partial, "{by_path:?}");
    assert_eq!(cgroup::read_level_in(&held, "/cg", Version::V1), by_path);
    assert_eq!(by_path.oom_control_oom_kill, 1);

    // The counters move (rewritten in place, as the kernel's are); the
    // files held open show it, twice over.
    for (usage, kills) in [(6_000_000, 2), (123, 30)] {
        v1_files(&dir, usage, kills);
        let fresh = cgroup::refresh_counters_in(&held, &by_path, Version::V1);
        assert_eq!(fresh, cgroup::refresh_counters(&dir, &by_path, Version::V1));
        assert_eq!(
            (fresh.usage_bytes, fresh.oom_control_oom_kill),
            (usage, kills)
        );
    }
    // Two subdirectories: four links (a cgroup filesystem counts them alike).
    fs::create_dir(dir.join("a")).unwrap();
    fs::create_dir(dir.join("b")).unwrap();
    assert_eq!(held.links(), Some(4));
}

#[test]
fn a_removed_cgroup_reads_partial_until_its_path_is_opened_again() {
    let Some((_, _, version)) = TestCgroup::own() else {
        eprintln!("skipping: no memory cgroup controller");
        return;
    };
    let version = if version == "v1" {
        Version::V1
    } else {
        Version::V2
    };
    let cg = TestCgroup::create(None, "oomscope-level-dir", None);
    let held = LevelDir::open(&cg.dir, version);
    let first = cgroup::read_level_in(&held, &cg.path, version);
    assert!(!first.partial, "{first:?}");
    assert!(!cgroup::refresh_counters_in(&held, &first, version).partial);

    // Removed, then made again at the same path: the held files are the
    // old cgroup's, and the kernel refuses them.
    fs::remove_dir(&cg.dir).unwrap();
    assert!(cgroup::refresh_counters_in(&held, &first, version).partial);
    fs::create_dir(&cg.dir).unwrap();
    assert!(cgroup::refresh_counters_in(&held, &first, version).partial);
    let reopened = LevelDir::open(&cg.dir, version);
    let again = cgroup::refresh_counters_in(&reopened, &first, version);
    assert!(!again.partial, "{again:?}");
}
