//! Every reader against this machine's real /proc, /sys and (absent) GPU.

use oomscope_agent_core::readers::gpu::GpuReader;
use oomscope_agent_core::readers::{process, processes, system, HostPaths, HostReader};

#[test]
fn gpu_probe_is_absent_here_without_panicking() {
    let gpu = GpuReader::open();
    if std::path::Path::new("/dev/nvidiactl").exists() {
        eprintln!("this host has an NVIDIA device; absence is not checked");
        return;
    }
    assert!(!gpu.is_present());
    assert!(gpu.read().is_empty());
    assert!(gpu.placements().is_empty());
}

#[test]
fn host_probe_samples_every_domain() {
    let pid = std::process::id();
    let reader = HostReader::new(HostPaths::system(), pid);
    assert_eq!(reader.pid(), pid);
    let s = reader.sample();
    assert!(s.time_ns > 0);
    let p = s.process.expect("our own status is readable");
    assert_eq!(p.pid, pid);
    assert!(p.vm_rss_bytes > 0);
    assert!(p.vm_size_bytes >= p.vm_rss_bytes);
    assert!(p.vm_hwm_bytes >= p.vm_rss_bytes);
    let sys = s.system.expect("system memory");
    assert!(sys.mem_total_bytes > 0);
    assert!(sys.mem_available_bytes <= sys.mem_total_bytes);
    assert!(sys.shm_total_bytes > 0, "/dev/shm is mounted here");
    assert!(!s.cgroup.is_empty());
    assert!(s.cgroup[0].usage_bytes > 0);
    if !reader.gpu().is_present() {
        assert!(s.gpus.is_empty());
    }

    let counters = reader.counters();
    assert_eq!(counters.cgroup.len(), s.cgroup.len());
    let info = reader.cgroup_info();
    assert_eq!(info.path, s.cgroup[0].path);
    assert!(info.version == "v1" || info.version == "v2");
}

#[test]
fn a_boundary_sample_reads_this_hosts_usage_files() {
    let reader = HostReader::new(HostPaths::system(), std::process::id());
    let full = reader.sample();
    let cg = reader
        .memory_cgroup()
        .expect("a memory controller on this host");
    let usage_file = match cg.version {
        oomscope_agent_core::readers::cgroup::Version::V1 => "memory.usage_in_bytes",
        oomscope_agent_core::readers::cgroup::Version::V2 => "memory.current",
    };
    let read_own = || -> u64 {
        std::fs::read_to_string(cg.dir.join(usage_file))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let before = read_own();
    let b = reader.boundary_sample(&full.cgroup);
    let after = read_own();
    assert_eq!(b.cgroup.len(), full.cgroup.len());
    for (l, f) in b.cgroup.iter().zip(&full.cgroup) {
        assert_eq!((&l.path, l.limit_bytes), (&f.path, f.limit_bytes));
        assert_eq!(l.partial, f.partial, "{}", l.path);
    }
    // Our own level's usage, bracketed by two reads of its file (other
    // processes share the cgroup, so allow for their movement).
    let slack = 64 << 20;
    let own = b.cgroup[0].usage_bytes;
    assert!(
        own + slack >= before.min(after) && own <= before.max(after) + slack,
        "{own} against {before}..{after}"
    );
    assert!(b.process.expect("our status").vm_rss_bytes > 0);
    assert!(b.system.is_none());
}

#[test]
fn rlimits_match_getrlimit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut lim) }, 0);
    let expected = if lim.rlim_cur == libc::RLIM_INFINITY {
        0
    } else {
        lim.rlim_cur
    };
    let rl = process::rlimits(&HostPaths::system(), std::process::id());
    assert_eq!(rl.stack_bytes, expected);
}

#[test]
fn major_faults_and_overcommit_are_read() {
    let paths = HostPaths::system();
    let p = process::read(&paths, std::process::id()).unwrap();
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let majflt_now = process::parse_stat_major_faults(&stat).unwrap();
    assert!(p.major_faults <= majflt_now, "counter only grows");
    let sys = system::read(&paths);
    let mode: i32 = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(sys.overcommit_mode, mode);
}

#[test]
fn top_processes_by_rss_include_us() {
    let paths = HostPaths::system();
    let top = processes::top_by_rss(&paths, 3);
    assert!(!top.is_empty() && top.len() <= 3);
    assert!(
        top.windows(2).all(|w| w[0].rss_bytes >= w[1].rss_bytes),
        "largest first"
    );
    assert!(top.iter().all(|p| p.rss_bytes > 0 && !p.command.is_empty()));

    let all = processes::list(&paths, &[], usize::MAX);
    let me = all
        .host_top_rss
        .iter()
        .find(|p| p.pid == std::process::id())
        .expect("we are on the list");
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } == 0 {
        assert_eq!(me.user, "root");
    }
    assert!(me.command.contains("readers_host_live"), "{}", me.command);
    assert_eq!(
        me.cgroup,
        processes::memory_cgroup_path(&std::fs::read_to_string("/proc/self/cgroup").unwrap())
    );
    assert!(all.gpu.is_empty());
    assert!(processes::top_by_rss(&paths, 0).is_empty());
}

#[test]
fn host_probe_can_move_to_a_sampling_thread() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<HostReader>();
    let reader = HostReader::new(HostPaths::system(), std::process::id());
    let rss = std::thread::spawn(move || reader.sample().process.map(|p| p.vm_rss_bytes))
        .join()
        .unwrap();
    assert!(rss.unwrap_or(0) > 0);
}
