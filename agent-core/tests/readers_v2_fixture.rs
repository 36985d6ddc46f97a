//! The GPU machine's pure cgroup-v2 files (tests/fixtures/host-v2), laid out
//! as a fake /proc and /sys/fs/cgroup tree and read through the real readers.

use std::fs;

use oomscope_agent_core::readers::cgroup::{self, Version};
use oomscope_agent_core::readers::gpu::GpuReader;
use oomscope_agent_core::readers::{process, system, HostPaths, HostReader};
use oomscope_testkit::host_v2::{fixture, write, HostV2};
use serde_json::Value;

const PID: u32 = 422;
const KIB: u64 = 1024;

/// Materialises the fixture with this test's process files; returns the
/// tempdir guard and the paths.
fn fake_tree(fx: &Value) -> (tempfile::TempDir, HostPaths) {
    let tree = HostV2::materialise(PID);
    write(
        &tree.pid_file(PID, "cgroup"),
        fx["proc_self_cgroup"].as_str().unwrap(),
    );
    for name in ["status", "limits"] {
        write(
            &tree.pid_file(PID, name),
            fx[format!("/proc/self/{name}").as_str()].as_str().unwrap(),
        );
    }
    for name in ["meminfo", "vmstat", "pressure/memory"] {
        write(
            &tree.proc_root.join(name),
            fx[format!("/proc/{name}").as_str()].as_str().unwrap(),
        );
    }
    let paths = HostPaths {
        proc_root: tree.proc_root,
        cgroup_root: tree.cgroup_root,
    };
    (tree.dir, paths)
}

/// The value of `key` in a `key value` file of the fixture, read independently of the reader.
fn stat_value(fx: &Value, file: &str, key: &str) -> u64 {
    let text = fx["files"][file].as_str().unwrap();
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `Key:  N kB` of a fixture text, in bytes.
fn kb_value(text: &str, key: &str) -> u64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{key}:")))
        .unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * KIB
}

const OWN: &str = "/sys/fs/cgroup/app.slice/inference-server";

#[test]
fn locates_the_v2_memory_controller_from_proc_mounts() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    let cg = cgroup::locate(&paths, PID).expect("memory controller found");
    assert_eq!(cg.version, Version::V2);
    assert_eq!(cg.path, fx["own_path"].as_str().unwrap());
    assert_eq!(cg.dir, paths.cgroup_root.join("app.slice/inference-server"));
    assert_eq!(cg.mount, paths.cgroup_root);
}

#[test]
fn reads_own_level_numbers_as_the_files_say() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    let cg = cgroup::locate(&paths, PID).unwrap();
    let levels = cgroup::read_levels(&paths, &cg);
    let paths_seen: Vec<&str> = levels.iter().map(|l| l.path.as_str()).collect();
    assert_eq!(
        paths_seen,
        ["/app.slice/inference-server", "/app.slice", "/"]
    );

    let own = &levels[0];
    assert_eq!(own.version, "v2");
    assert!(
        !own.partial,
        "every required file of the own level is in the fixture"
    );
    assert_eq!(own.usage_bytes, 15224832);
    assert_eq!(own.peak_bytes, 15224832);
    assert_eq!(own.limit_bytes, 0, "memory.max = max means unlimited");
    assert_eq!(own.high_bytes, 0);
    assert_eq!(
        own.swap_limit_bytes, None,
        "memory.swap.max = max means unlimited"
    );
    let stat = format!("{OWN}/memory.stat");
    assert_eq!(own.anon_bytes, stat_value(&fx, &stat, "anon"));
    assert_eq!(own.anon_bytes, 11325440);
    assert_eq!(own.file_bytes, stat_value(&fx, &stat, "file"));
    assert_eq!(own.shmem_bytes, stat_value(&fx, &stat, "shmem"));
    assert_eq!(own.pgmajfault, stat_value(&fx, &stat, "pgmajfault"));
    assert_eq!(
        own.events_oom_kill,
        stat_value(&fx, &format!("{OWN}/memory.events"), "oom_kill")
    );
    assert_eq!(own.local_oom, 0);
    assert!(own.pressure.is_some());

    // The intermediate slice was not captured: an honest, partial, all-zero level.
    assert!(levels[1].partial);
    assert_eq!(levels[1].usage_bytes, 0);

    // The v2 root has memory.stat but no memory.max/current.
    let root = &levels[2];
    assert!(root.partial);
    assert_eq!(
        root.anon_bytes,
        stat_value(&fx, "/sys/fs/cgroup/memory.stat", "anon")
    );
    assert_eq!(root.shmem_bytes, 7544832);

    let info = cgroup::info(&levels, &cg);
    assert_eq!(info.version, "v2");
    assert_eq!(info.path, "/app.slice/inference-server");
    assert_eq!((info.limit_bytes, info.limit_owner.as_str()), (0, ""));
}

#[test]
fn a_limit_on_the_slice_is_owned_by_the_slice() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    // Give the own cgroup a loose limit and the slice a tight one.
    fs::write(
        paths
            .cgroup_root
            .join("app.slice/inference-server/memory.max"),
        "4294967296\n",
    )
    .unwrap();
    write(
        &paths.cgroup_root.join("app.slice/memory.max"),
        "1073741824\n",
    );
    let cg = cgroup::locate(&paths, PID).unwrap();
    let levels = cgroup::read_levels(&paths, &cg);
    assert_eq!(levels[0].limit_bytes, 4294967296);
    assert_eq!(levels[1].limit_bytes, 1073741824);
    let info = cgroup::info(&levels, &cg);
    assert_eq!(info.limit_bytes, 1073741824);
    assert_eq!(info.limit_owner, "/app.slice");
}

#[test]
fn system_memory_in_bytes() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    let sys = system::read(&paths);
    let meminfo = fx["/proc/meminfo"].as_str().unwrap();
    assert_eq!(sys.mem_total_bytes, 131981020 * KIB);
    assert_eq!(sys.mem_available_bytes, kb_value(meminfo, "MemAvailable"));
    assert_eq!(sys.commit_limit_bytes, kb_value(meminfo, "CommitLimit"));
    assert_eq!(sys.committed_as_bytes, kb_value(meminfo, "Committed_AS"));
    assert_eq!(sys.swap_total_bytes, 0);
    assert_eq!(sys.vmstat_pgmajfault, 398);
    assert_eq!(sys.vmstat_oom_kill, 0);
    let psi = sys.pressure.expect("PSI file present");
    assert_eq!((psi.some_avg10, psi.full_total_us), (0.0, 0));
    // No overcommit file in the fake tree: 0, not an error.
    assert_eq!(sys.overcommit_mode, 0);
}

#[test]
fn process_status_and_limits() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    let p = process::read(&paths, PID).expect("status present");
    let status = fx["/proc/self/status"].as_str().unwrap();
    assert_eq!(p.pid, PID);
    assert_eq!(p.vm_rss_bytes, 17664 * KIB);
    assert_eq!(p.vm_hwm_bytes, kb_value(status, "VmHWM"));
    assert_eq!(p.vm_size_bytes, kb_value(status, "VmSize"));
    assert_eq!(p.vm_peak_bytes, kb_value(status, "VmPeak"));
    assert_eq!(p.rss_anon_bytes, kb_value(status, "RssAnon"));
    assert_eq!(p.rss_shmem_bytes, 0);
    assert_eq!(p.address_space_limit_bytes, 0, "unlimited");
    assert_eq!(p.major_faults, 0, "no stat file in the fixture");

    let rl = process::rlimits(&paths, PID);
    assert_eq!(rl.stack_bytes, 8388608);
    assert_eq!(
        (rl.address_space_bytes, rl.data_bytes, rl.rss_bytes),
        (0, 0, 0)
    );

    assert!(
        process::read(&paths, PID + 1).is_err(),
        "a pid with no status is an error"
    );
}

#[test]
fn host_probe_over_the_fake_tree() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    let reader = HostReader::with_gpu(
        paths,
        PID,
        oomscope_agent_core::readers::gpu::GpuReader::absent(),
    );
    let s = reader.sample();
    assert!(s.time_ns > 0);
    assert_eq!(s.process.unwrap().vm_rss_bytes, 17664 * KIB);
    assert_eq!(s.cgroup[0].usage_bytes, 15224832);
    assert_eq!(s.system.unwrap().mem_total_bytes, 131981020 * KIB);
    assert_eq!(reader.cgroup_info().version, "v2");
    assert_eq!(reader.counters().cgroup.len(), 3);
}

#[test]
fn no_memory_controller_means_none() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    // The same host, but the cgroup2 mount without the memory controller.
    fs::write(
        paths.cgroup_root.join("cgroup.controllers"),
        "cpuset cpu io pids\n",
    )
    .unwrap();
    assert!(cgroup::locate(&paths, PID).is_none());
    let reader = HostReader::with_gpu(
        paths,
        PID,
        oomscope_agent_core::readers::gpu::GpuReader::absent(),
    );
    assert!(reader.sample().cgroup.is_empty());
    assert_eq!(reader.cgroup_info().version, "");
}

#[test]
fn a_boundary_sample_reads_usage_again_and_carries_the_rest_of_the_levels() {
    let fx = fixture();
    let (_tmp, paths) = fake_tree(&fx);
    let own = paths.cgroup_root.join("app.slice/inference-server");
    let reader = HostReader::with_gpu(paths.clone(), PID, GpuReader::absent());
    let full = reader.sample();
    assert_eq!(full.cgroup[0].usage_bytes, 15224832);
    assert!(full.system.is_some());

    // After the full reading the usage and RSS move and the limit changes.
    fs::write(own.join("memory.current"), "123456789\n").unwrap();
    fs::write(own.join("memory.max"), "1073741824\n").unwrap();
    let status = fx["/proc/self/status"].as_str().unwrap();
    let status = status.replace(
        &status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .unwrap()
            .to_string(),
        "VmRSS:\t   99999 kB",
    );
    write(&paths.proc_root.join(format!("{PID}/status")), &status);

    let b = reader.boundary_sample(&full.cgroup);
    let paths_of = |s: &oomscope_agent_core::pb::Sample| {
        s.cgroup.iter().map(|l| l.path.clone()).collect::<Vec<_>>()
    };
    assert_eq!(paths_of(&b), paths_of(&full));
    assert_eq!(b.cgroup[0].usage_bytes, 123456789, "usage read again");
    assert_eq!(
        b.cgroup[0].limit_bytes, full.cgroup[0].limit_bytes,
        "the limit as the full reading had it"
    );
    assert_eq!(b.cgroup[0].anon_bytes, full.cgroup[0].anon_bytes);
    assert_eq!(b.process.unwrap().vm_rss_bytes, 99999 * KIB);
    assert!(b.system.is_none(), "the periodic sample reads the system");

    // Levels that are not this cgroup's are read whole.
    let mut elsewhere = full.cgroup.clone();
    elsewhere[0].path = "/elsewhere".to_string();
    for last in [&[][..], &elsewhere[..]] {
        let whole = reader.boundary_sample(last);
        assert_eq!(paths_of(&whole), paths_of(&full));
        assert_eq!(
            (whole.cgroup[0].usage_bytes, whole.cgroup[0].limit_bytes),
            (123456789, 1073741824)
        );
    }

    // A usage file gone: 0 and partial, as a full reading would say.
    fs::remove_file(own.join("memory.current")).unwrap();
    let gone = reader.boundary_sample(&full.cgroup);
    assert!(!full.cgroup[0].partial);
    assert_eq!(
        (gone.cgroup[0].usage_bytes, gone.cgroup[0].partial),
        (0, true)
    );
    let whole = reader.sample();
    assert_eq!(
        (whole.cgroup[0].usage_bytes, whole.cgroup[0].partial),
        (0, true)
    );
}
