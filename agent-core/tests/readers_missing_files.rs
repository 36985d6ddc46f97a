//! Missing, unreadable or garbled cgroup files make a reading partial, never an error.

use std::fs;

use oomscope_agent_core::readers::cgroup::{self, Version};
use oomscope_agent_core::readers::{process, system, HostPaths, HostReader};

#[test]
fn v2_level_with_only_memory_current_is_partial() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("memory.current"), "4096\n").unwrap();
    let l = cgroup::read_level(tmp.path(), "/x", Version::V2);
    assert!(l.partial);
    assert_eq!(l.usage_bytes, 4096, "what exists is still read");
    assert_eq!(l.limit_bytes, 0);
    assert_eq!(l.path, "/x");
    assert_eq!(l.version, "v2");
}

#[test]
fn garbled_limit_is_partial() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, text) in [
        ("memory.max", "lots\n"),
        ("memory.current", "1\n"),
        ("memory.high", "max\n"),
        ("memory.events", ""),
        ("memory.events.local", ""),
        ("memory.stat", ""),
    ] {
        fs::write(tmp.path().join(name), text).unwrap();
    }
    let l = cgroup::read_level(tmp.path(), "/x", Version::V2);
    assert!(l.partial);
    assert_eq!(l.limit_bytes, 0);
    // With a good memory.max it is complete (optional peak/swap/PSI absent is fine).
    fs::write(tmp.path().join("memory.max"), "1048576\n").unwrap();
    let l = cgroup::read_level(tmp.path(), "/x", Version::V2);
    assert!(!l.partial);
    assert_eq!(l.limit_bytes, 1048576);
    assert!(l.pressure.is_none());
}

#[test]
fn v1_level_without_oom_control_is_partial() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, text) in [
        ("memory.limit_in_bytes", "67108864\n"),
        ("memory.usage_in_bytes", "1000\n"),
        ("memory.max_usage_in_bytes", "2000\n"),
        ("memory.failcnt", "3\n"),
        ("memory.stat", "rss 10\ncache 20\n"),
        ("memory.memsw.limit_in_bytes", "100663296\n"),
    ] {
        fs::write(tmp.path().join(name), text).unwrap();
    }
    let l = cgroup::read_level(tmp.path(), "/x", Version::V1);
    assert!(l.partial, "memory.oom_control missing");
    assert_eq!(
        (l.limit_bytes, l.usage_bytes, l.peak_bytes, l.failcnt),
        (67108864, 1000, 2000, 3)
    );
    assert_eq!((l.anon_bytes, l.file_bytes), (10, 20));
    assert_eq!(
        l.swap_limit_bytes,
        Some(32 * 1024 * 1024),
        "memsw limit minus memory limit"
    );
}

#[test]
fn a_directory_that_is_gone_reads_as_partial_zeros() {
    let tmp = tempfile::tempdir().unwrap();
    let gone = tmp.path().join("removed");
    for version in [Version::V1, Version::V2] {
        let l = cgroup::read_level(&gone, "/removed", version);
        assert!(l.partial);
        assert_eq!((l.usage_bytes, l.limit_bytes), (0, 0));
    }
}

#[test]
fn an_empty_proc_tree_gives_empty_readings() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = HostPaths {
        proc_root: tmp.path().join("proc"),
        cgroup_root: tmp.path().join("cg"),
    };
    assert!(cgroup::locate(&paths, 1).is_none());
    assert!(process::read(&paths, 1).is_err());
    assert_eq!(process::rlimits(&paths, 1), Default::default());
    let sys = system::read(&paths);
    assert_eq!(sys.mem_total_bytes, 0);
    assert!(sys.pressure.is_none(), "no PSI file: absent, not an error");
    let reader = HostReader::with_gpu(
        paths,
        1,
        oomscope_agent_core::readers::gpu::GpuReader::absent(),
    );
    let s = reader.sample();
    assert!(s.process.is_none());
    assert!(s.cgroup.is_empty());
    assert!(reader.process_list(5).host_top_rss.is_empty());
}

#[test]
fn swap_limit_tells_unlimited_from_no_swap_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("memory.max"), "1048576\n").unwrap();
    let read = |swap_max: Option<&str>| {
        let path = tmp.path().join("memory.swap.max");
        match swap_max {
            Some(text) => fs::write(&path, text).unwrap(),
            None => drop(fs::remove_file(&path)),
        }
        cgroup::read_level(tmp.path(), "/x", Version::V2).swap_limit_bytes
    };
    assert_eq!(read(Some("max\n")), None, "unlimited");
    assert_eq!(read(Some("0\n")), Some(0), "swap forbidden");
    assert_eq!(read(Some("4096\n")), Some(4096));
    assert_eq!(read(None), None, "no swap accounting");

    // v1: memsw equal to the memory limit leaves no room to swap.
    let v1 = tempfile::tempdir().unwrap();
    fs::write(v1.path().join("memory.limit_in_bytes"), "67108864\n").unwrap();
    fs::write(v1.path().join("memory.memsw.limit_in_bytes"), "67108864\n").unwrap();
    let l = cgroup::read_level(v1.path(), "/x", Version::V1);
    assert_eq!(l.swap_limit_bytes, Some(0));
    // The unlimited sentinel on memsw is no swap limit.
    fs::write(
        v1.path().join("memory.memsw.limit_in_bytes"),
        "9223372036854771712\n",
    )
    .unwrap();
    let l = cgroup::read_level(v1.path(), "/x", Version::V1);
    assert_eq!(l.swap_limit_bytes, None);
}

#[test]
fn v2_memory_oom_group_is_read_and_optional() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("memory.max"), "1048576\n").unwrap();
    let read = |group: Option<&str>| {
        let path = tmp.path().join("memory.oom.group");
        match group {
            Some(text) => fs::write(&path, text).unwrap(),
            None => drop(fs::remove_file(&path)),
        }
        cgroup::read_level(tmp.path(), "/x", Version::V2).oom_group
    };
    assert!(read(Some("1\n")), "the whole group is killed");
    assert!(!read(Some("0\n")));
    assert!(!read(None), "kernels before 4.19 have no such file");
}
