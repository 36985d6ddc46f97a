//! A cgroup directory held open (`LevelDir`, what `oomscope node` keeps for
//! each cgroup it watches) reads the same as by path; once the directory
//! is gone its readings are partial, also after a new one took its path.

use std::fs;

use oomscope_agent_core::readers::cgroup::{self, LevelDir, Version};

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
fn a_held_directory_reads_as_by_path_until_it_is_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cg");
    fs::create_dir(&dir).unwrap();
    v1_files(&dir, 5_000_000, 1);
    let held = LevelDir::open(&dir);
    let by_path = cgroup::read_level(&dir, "/cg", Version::V1);
    assert!(!by_path.partial, "{by_path:?}");
    assert_eq!(cgroup::read_level_in(&held, "/cg", Version::V1), by_path);
    assert_eq!(by_path.oom_control_oom_kill, 1);

    // The counters move; the held directory sees them.
    v1_files(&dir, 6_000_000, 2);
    let fresh = cgroup::refresh_counters_in(&held, &by_path, Version::V1);
    assert_eq!(fresh, cgroup::refresh_counters(&dir, &by_path, Version::V1));
    assert_eq!(
        (fresh.usage_bytes, fresh.oom_control_oom_kill),
        (6_000_000, 2)
    );

    // Removed, then made again at the same path: the held one is the old.
    fs::remove_dir_all(&dir).unwrap();
    assert!(cgroup::refresh_counters_in(&held, &fresh, Version::V1).partial);
    fs::create_dir(&dir).unwrap();
    v1_files(&dir, 7_000_000, 0);
    assert!(cgroup::refresh_counters_in(&held, &fresh, Version::V1).partial);
    let reopened = LevelDir::open(&dir);
    let again = cgroup::refresh_counters_in(&reopened, &fresh, Version::V1);
    assert_eq!((again.usage_bytes, again.partial), (7_000_000, false));
}
