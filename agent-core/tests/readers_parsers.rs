//! The pure parsers against literal text, including missing and garbled lines.

use oomscope_agent_core::pb;
use oomscope_agent_core::readers::cgroup::{self, Version};
use oomscope_agent_core::readers::{process, processes, system};

const KIB: u64 = 1024;

#[test]
fn status_fills_vm_lines_in_bytes_and_skips_garbage() {
    let text = "Name:\tpython3 (x)\nPid:\t77\nVmPeak:\t  2048 kB\nVmSize:\t 1024 kB\nVmHWM:\t 512 kB\n\
                VmRSS:\tgarbage kB\nRssAnon:\t 100 kB\nRssShmem:\t 3 MB\nVmSwap:\t7 kB\nno colon here\n:\n";
    let mut p = pb::ProcessMemory::default();
    process::parse_status(text, &mut p);
    assert_eq!(p.pid, 77);
    assert_eq!(p.vm_peak_bytes, 2048 * KIB);
    assert_eq!(p.vm_size_bytes, 1024 * KIB);
    assert_eq!(p.vm_hwm_bytes, 512 * KIB);
    assert_eq!(p.vm_rss_bytes, 0, "garbled value left untouched");
    assert_eq!(p.rss_anon_bytes, 100 * KIB);
    assert_eq!(p.rss_shmem_bytes, 0, "unknown unit is not guessed");
    assert_eq!(p.vm_swap_bytes, 7 * KIB);

    let mut empty = pb::ProcessMemory::default();
    process::parse_status("", &mut empty);
    assert_eq!(empty, pb::ProcessMemory::default());
}

const LIMITS: &str =
    "Limit                     Soft Limit           Hard Limit           Units     \n\
Max data size             1073741824           unlimited            bytes     \n\
Max stack size            8388608              unlimited            bytes     \n\
Max resident set          unlimited            unlimited            bytes     \n\
Max address space         17179869184          unlimited            bytes     \n\
Max nice priority         0                    0                    \n";

#[test]
fn limits_soft_column_with_unlimited_as_zero() {
    let mut p = pb::ProcessMemory::default();
    process::parse_limits(LIMITS, &mut p);
    assert_eq!(p.address_space_limit_bytes, 17179869184);
    assert_eq!(p.data_limit_bytes, 1073741824);

    let rl = process::parse_rlimits(LIMITS);
    assert_eq!(rl.address_space_bytes, 17179869184);
    assert_eq!(rl.data_bytes, 1073741824);
    assert_eq!(rl.stack_bytes, 8388608);
    assert_eq!(rl.rss_bytes, 0);

    let garbled = "Max address space         lots                 unlimited\nMax data size\n";
    let mut p = pb::ProcessMemory::default();
    process::parse_limits(garbled, &mut p);
    assert_eq!((p.address_space_limit_bytes, p.data_limit_bytes), (0, 0));
    assert_eq!(process::parse_rlimits(""), pb::Rlimits::default());
}

#[test]
fn stat_major_faults_after_the_last_paren() {
    // comm with spaces and a ')' inside; majflt (field 12) is 42.
    let stat = "1234 (evil) name (x)) S 1 1234 1234 0 -1 4194304 500 0 42 0 10 5 0 0 20 0 1 0 100 1000 200";
    assert_eq!(process::parse_stat_major_faults(stat), Some(42));
    assert_eq!(process::parse_stat_major_faults("1234 (short) S 1"), None);
    assert_eq!(process::parse_stat_major_faults("no parens at all"), None);
    assert_eq!(process::parse_stat_major_faults(""), None);
}

#[test]
fn meminfo_in_bytes() {
    let text = "MemTotal:       16000 kB\nMemFree: 1 kB\nMemAvailable:    8000 kB\nSwapTotal:  2048 kB\n\
                SwapFree: 1024 kB\nCommitLimit:  9000 kB\nCommitted_AS:   12000 kB\nHugePages_Total: 0\nbroken line\nMemTotal";
    let mut s = pb::SystemMemory::default();
    system::parse_meminfo(text, &mut s);
    assert_eq!(s.mem_total_bytes, 16000 * KIB);
    assert_eq!(s.mem_available_bytes, 8000 * KIB);
    assert_eq!(s.swap_total_bytes, 2048 * KIB);
    assert_eq!(s.swap_free_bytes, 1024 * KIB);
    assert_eq!(s.commit_limit_bytes, 9000 * KIB);
    assert_eq!(
        s.committed_as_bytes,
        12000 * KIB,
        "overcommitted: Committed_AS above CommitLimit"
    );
}

#[test]
fn vmstat_counters() {
    let text = "nr_free_pages 5\noom_kill 3\npswpin 10\npswpout 20\npgmajfault 398\n\
                workingset_refault_anon 7\nworkingset_refault_file 8\noom_kill\npswpin x\n";
    let mut s = pb::SystemMemory::default();
    system::parse_vmstat(text, &mut s);
    assert_eq!(s.vmstat_oom_kill, 3);
    assert_eq!((s.vmstat_pswpin, s.vmstat_pswpout), (10, 20));
    assert_eq!(s.vmstat_pgmajfault, 398);
    assert_eq!(
        (
            s.vmstat_workingset_refault_anon,
            s.vmstat_workingset_refault_file
        ),
        (7, 8)
    );
}

#[test]
fn pressure_some_and_full() {
    let p = system::parse_pressure(
        "some avg10=1.50 avg60=0.30 avg300=0.10 total=123456\nfull avg10=0.75 avg60=0.00 avg300=0.00 total=6543\n",
    );
    assert_eq!(p.some_avg10, 1.5);
    assert_eq!(p.full_avg10, 0.75);
    assert_eq!(p.some_total_us, 123456);
    assert_eq!(p.full_total_us, 6543);

    // Older kernels have no `full` line; garbage stays 0.
    let p = system::parse_pressure("some avg10=oops total=12\nweird\nfull avg10\n");
    assert_eq!(
        (p.some_avg10, p.some_total_us, p.full_avg10, p.full_total_us),
        (0.0, 12, 0.0, 0)
    );
    assert_eq!(system::parse_pressure(""), pb::Pressure::default());
}

#[test]
fn proc_cgroup_lines_of_a_hybrid_host() {
    let lines = cgroup::parse_proc_cgroup(
        "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/x\n0::/\nbad\n",
    );
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[1].controllers, ["memory"]);
    assert_eq!(lines[1].path, "/process_api/abc");
    assert_eq!(lines[2].controllers, ["cpu", "cpuacct"]);
    assert!(lines[3].controllers.is_empty());
    assert_eq!(
        processes::memory_cgroup_path("4:memory:/process_api/abc\n0::/\n"),
        "/process_api/abc"
    );
    assert_eq!(
        processes::memory_cgroup_path("0::/app.slice/x\n"),
        "/app.slice/x"
    );
    assert_eq!(processes::memory_cgroup_path(""), "");
}

#[test]
fn mountinfo_keeps_the_root_field_and_unescapes() {
    let text =
        "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n\
                50 31 0:40 / /mnt/with\\040space rw - cgroup2 cgroup2 rw\n\
                22 1 0:21 / /proc rw - proc proc rw\ngarbage line\n";
    let mounts = cgroup::parse_mountinfo(text);
    assert_eq!(mounts.len(), 3);
    assert_eq!(mounts[0].fstype, "cgroup");
    assert_eq!(mounts[0].root, "/docker/abc");
    assert!(mounts[0].options.iter().any(|o| o == "memory"));
    assert_eq!(mounts[1].fstype, "cgroup2");
    assert_eq!(mounts[2].mount_point.to_str(), Some("/mnt/with space"));

    let m = cgroup::parse_mounts(
        "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\nproc /proc proc rw 0 0\n",
    );
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].root, "/");
}

#[test]
fn limit_sentinels() {
    assert_eq!(cgroup::parse_v2_max("max\n"), Some(0));
    assert_eq!(cgroup::parse_v2_max("1073741824\n"), Some(1073741824));
    assert_eq!(cgroup::parse_v2_max("lots"), None);
    assert_eq!(cgroup::parse_v2_max(""), None);
    assert_eq!(cgroup::v1_limit(9223372036854771712), 0);
    assert_eq!(cgroup::v1_limit(67108864), 67108864);
}

#[test]
fn v1_stat_prefers_hierarchical_totals() {
    let mut l = pb::CgroupLevel::default();
    // The totals may come before or after the local keys.
    cgroup::parse_v1_stat(
        "total_rss 900\ncache 10\nrss 100\nshmem 5\nswap 3\npgmajfault 2\ntotal_cache 20\n",
        &mut l,
    );
    assert_eq!(l.anon_bytes, 900);
    assert_eq!(l.file_bytes, 20);
    assert_eq!((l.shmem_bytes, l.swap_bytes, l.pgmajfault), (5, 3, 2));

    let mut l = pb::CgroupLevel::default();
    cgroup::parse_v1_oom_control("oom_kill_disable 0\nunder_oom 1\noom_kill 4\n", &mut l);
    assert!(l.under_oom);
    assert_eq!(l.oom_control_oom_kill, 4);
}

#[test]
fn v2_events_hierarchical_and_local() {
    let mut l = pb::CgroupLevel::default();
    cgroup::parse_v2_events(
        "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n",
        &mut l,
    );
    cgroup::parse_v2_events_local("low 0\nhigh 0\nmax 0\noom 1\noom_kill 1\n", &mut l);
    assert_eq!(
        (
            l.events_max,
            l.events_oom,
            l.events_oom_kill,
            l.events_oom_group_kill
        ),
        (12, 2, 1, 0)
    );
    assert_eq!((l.local_oom, l.local_oom_kill), (1, 1));
}

#[test]
fn passwd_and_cmdline() {
    let users = processes::parse_passwd(
        "root:x:0:0:root:/root:/bin/bash\nbad\nsvc:x:999:999::/:/bin/false\n:x:5:5\n",
    );
    assert_eq!(users.get(&0).map(String::as_str), Some("root"));
    assert_eq!(users.get(&999).map(String::as_str), Some("svc"));
    assert_eq!(users.len(), 2);
    assert_eq!(
        processes::command_line("python3\0-m\0vllm\0"),
        "python3 -m vllm"
    );
    assert_eq!(processes::command_line(""), "");
    let f = processes::parse_status_fields(
        "Name:\tworker\nUid:\t1000\t1000\t1000\t1000\nVmRSS:\t 10 kB\n",
    );
    assert_eq!(
        (f.name.as_str(), f.uid, f.rss_bytes),
        ("worker", Some(1000), 10 * KIB)
    );
}

#[test]
fn version_names() {
    assert_eq!(Version::V1.as_str(), "v1");
    assert_eq!(Version::V2.as_str(), "v2");
}
