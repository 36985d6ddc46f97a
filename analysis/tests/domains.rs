//! Domain attribution on evidence shaped like real recordings (v1 and v2
//! counters). Each test checks the verdict and the numbers behind it.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{attribute_domain, diagnose, Domain, Evidence};

const OWN: &str = "/oomtest/child";

#[test]
fn v1_limit_on_own_cgroup() {
    // A 64 MiB limit on the child's own cgroup; the kernel killed it (exit 137).
    let before = counters(
        T0,
        vec![
            v1(OWN, 64 * MIB, MIB, 2 * MIB, 0, 0),
            v1("/oomtest", V1_UNLIMITED, MIB, 2 * MIB, 0, 0),
        ],
        system(10, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![
            v1(OWN, 64 * MIB, 66_973_696, 67_108_864, 312, 1),
            v1("/oomtest", V1_UNLIMITED, 66_973_696, 67_108_864, 0, 0),
        ],
        system(11, 12 * GIB),
    );
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"));
    let cg = d.cgroup.as_ref().unwrap();
    assert_eq!(
        (cg.path.as_str(), cg.limit_bytes, cg.owner_level.as_str()),
        (OWN, 67_108_864, OWN)
    );
    has(&d.evidence, "cgroup /oomtest/child (own cgroup) limit 64.0 MiB (67108864 bytes); peak 64.0 MiB (67108864 bytes)");
    has(&d.evidence, "memory.failcnt 0 -> 312");
    has(
        &d.evidence,
        "cgroup /oomtest/child memory.oom_control oom_kill 0 -> 1",
    );
    assert_eq!(
        d.exit,
        Some(pb::ExitStatus {
            code: None,
            signal: Some(9)
        })
    );
    let c = &d.causes[0];
    assert_eq!(c.kind, "cgroup_limit");
    assert_eq!(metric(c, "limit_bytes"), 67_108_864.0);
    assert_eq!(metric(c, "peak_bytes"), 67_108_864.0);
    assert_eq!(metric(c, "owner_depth"), 0.0);
    assert!(d.fixes.iter().any(|f| f
        .action
        .contains("Right-size the memory limit on /oomtest/child (now 64.0 MiB)")));
    assert_eq!(d.fixes[0].risk, "low");
}

#[test]
fn v1_limit_on_parent_names_the_parent() {
    // The limit is on the parent: the parent's oom_kill stays 0, the child's rises;
    // the parent's max_usage stops a page short of its limit and its failcnt rises.
    let child = "/oomtest/parent/child";
    let before = counters(
        T0,
        vec![
            v1(child, V1_UNLIMITED, MIB, MIB, 0, 0),
            v1("/oomtest/parent", 64 * MIB, MIB, MIB, 0, 0),
        ],
        system(20, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![
            v1(child, V1_UNLIMITED, 66_945_024, 67_104_768, 0, 1),
            v1("/oomtest/parent", 64 * MIB, 66_945_024, 67_104_768, 57, 0),
        ],
        system(21, 12 * GIB),
    );
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let v = attribute_domain(&e);
    assert_eq!(v.domain, Domain::Cgroup);
    let cg = v.cgroup.as_ref().unwrap();
    assert_eq!(
        (cg.path.as_str(), cg.limit_bytes, cg.owner_level.as_str()),
        (child, 67_108_864, "/oomtest/parent")
    );
    has(&v.evidence, "cgroup /oomtest/parent (parent) limit 64.0 MiB (67108864 bytes); peak 64.0 MiB (67104768 bytes)");
    has(&v.evidence, "memory.failcnt 0 -> 57");
    has(
        &v.evidence,
        "cgroup /oomtest/parent/child memory.oom_control oom_kill 0 -> 1",
    );
    has(
        &v.evidence,
        "the owner's own memory.oom_control oom_kill stays at 0",
    );
    has(
        &v.evidence,
        "/proc/vmstat oom_kill 20 -> 21 (it counts cgroup kills too)",
    );
    let d = diagnose(&e);
    assert_eq!(metric(cause(&d, "cgroup_limit"), "owner_depth"), 1.0);
    assert!(d
        .fixes
        .iter()
        .any(|f| f.caveat.as_deref().is_some_and(|c| c.contains("ancestor"))));
}

#[test]
fn v2_local_oom_at_an_ancestor() {
    // The pure-v2 GPU machine's layout: the limit is on app.slice, the victim in
    // inference-server; memory.events counts up the tree, events.local only at the owner.
    let own = "/app.slice/inference-server";
    let quiet = V2Events::default();
    let before = counters(
        T0,
        vec![
            v2(own, 0, 15_224_832, 15_224_832, quiet),
            v2("/app.slice", GIB, 15_224_832, 15_224_832, quiet),
        ],
        system(0, 12 * GIB),
    );
    let victim = V2Events {
        oom_kill: 1,
        local_oom_kill: 1,
        ..quiet
    };
    let owner = V2Events {
        max: 41,
        oom: 1,
        oom_kill: 1,
        local_oom: 1,
        ..quiet
    };
    let after = counters(
        T0 + 3 * SEC,
        vec![
            v2(own, 0, 1_070_000_128, 1_073_741_824, victim),
            v2("/app.slice", GIB, 1_073_676_288, 1_073_741_824, owner),
        ],
        system(1, 12 * GIB),
    );
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"));
    let cg = d.cgroup.as_ref().unwrap();
    assert_eq!(
        (cg.path.as_str(), cg.limit_bytes, cg.owner_level.as_str()),
        (own, 1_073_741_824, "/app.slice")
    );
    has(
        &d.evidence,
        "cgroup /app.slice (parent) limit 1.0 GiB (1073741824 bytes)",
    );
    has(&d.evidence, "memory.events.local oom 0 -> 1");
    has(
        &d.evidence,
        "cgroup /app.slice/inference-server memory.events oom_kill 0 -> 1",
    );
    let c = cause(&d, "cgroup_limit");
    assert_eq!(metric(c, "limit_bytes"), 1_073_741_824.0);
    assert!(c.confidence >= 0.9);
}

#[test]
fn v2_own_level_limit_with_exit_code_137_from_a_shell() {
    // `sh -c` reports the SIGKILL of its child as exit code 137.
    let quiet = V2Events::default();
    let before = counters(
        T0,
        vec![v2(OWN, 256 * MIB, MIB, MIB, quiet)],
        system(5, 12 * GIB),
    );
    let hit = V2Events {
        max: 9,
        oom: 1,
        oom_kill: 1,
        local_oom: 1,
        local_oom_kill: 1,
    };
    let after = counters(
        T0 + 3 * SEC,
        vec![v2(OWN, 256 * MIB, 268_369_920, 268_435_456, hit)],
        system(6, 12 * GIB),
    );
    let e = supervised(
        exit(Some(137), None, "Killed\n", before, after, None),
        "signal",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"));
    assert_eq!(d.cgroup.as_ref().unwrap().limit_bytes, 268_435_456);
    has(&d.evidence, "exit code 137 (128 + 9, SIGKILL)");
    assert_eq!(
        d.exit,
        Some(pb::ExitStatus {
            code: Some(137),
            signal: None
        })
    );
}

#[test]
fn global_oom_is_host_ram() {
    // vmstat oom_kill +1; the child's own v1 oom_kill rises too (v1 counts victims on
    // a global OOM as well), but no level is anywhere near its limit.
    let before = counters(
        T0,
        vec![v1(OWN, 8 * GIB, GIB, GIB, 0, 0)],
        system(3, 9 * GIB),
    );
    let mut sys_after = system(4, 96 * MIB);
    sys_after.swap_free_bytes = 0;
    let after = counters(
        T0 + 3 * SEC,
        vec![v1(OWN, 8 * GIB, 1_288_490_188, 1_288_490_188, 0, 1)],
        sys_after,
    );
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    // Another tenant's process holds most of the RAM.
    e.events.push(pb::Event {
        time_ns: T0 + 2 * SEC,
        kind: Some(Kind::ProcessList(pb::ProcessList {
            host_top_rss: vec![
                pb::ProcessInfo {
                    pid: 777,
                    user: "etl".into(),
                    command: "java -Xmx14g Etl".into(),
                    rss_bytes: 13 * GIB,
                    ..Default::default()
                },
                pb::ProcessInfo {
                    pid: CHILD_PID,
                    user: "svc".into(),
                    command: "python serve.py".into(),
                    rss_bytes: 1_288_490_188,
                    ..Default::default()
                },
                pb::ProcessInfo {
                    pid: 1,
                    user: "root".into(),
                    command: "init".into(),
                    rss_bytes: 12 * MIB,
                    ..Default::default()
                },
            ],
            gpu: vec![],
        })),
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"));
    assert!(d.cgroup.is_none());
    has(&d.evidence, "/proc/vmstat oom_kill 3 -> 4");
    has(&d.evidence, "no cgroup level reached its limit: /oomtest/child limit 8.0 GiB (8589934592 bytes); peak 1.2 GiB (1288490188 bytes)");
    has(
        &d.evidence,
        "MemAvailable 96.0 MiB (100663296 bytes) of MemTotal 16.0 GiB (17179869184 bytes)",
    );
    let c = cause(&d, "host_ram_exhausted");
    assert_eq!(metric(c, "vmstat_oom_kill_delta"), 1.0);
    assert_eq!(metric(c, "mem_available_bytes"), 100_663_296.0);
    let o = cause(&d, "other_process");
    assert_eq!(
        o.processes.len(),
        1,
        "only pid 777 is someone else's and big: {:?}",
        o.processes
    );
    assert_eq!((o.processes[0].pid, o.processes[0].bytes), (777, 13 * GIB));
    assert_eq!(o.processes[0].user.as_deref(), Some("etl"));
    assert_eq!(metric(o, "other_bytes"), (13 * GIB) as f64);
    assert!(d
        .fixes
        .iter()
        .all(|f| !f.action.to_lowercase().contains("kill")));
    let ranks: Vec<u8> = d
        .fixes
        .iter()
        .map(|f| match f.risk.as_str() {
            "low" => 0,
            "medium" => 1,
            _ => 2,
        })
        .collect();
    assert!(
        ranks.windows(2).all(|w| w[0] <= w[1]),
        "fixes not least-risky first: {ranks:?}"
    );
}

/// A reading of the supervised child: its RSS and its own cgroup's usage.
fn host_reading(time_ns: i64, rss: u64, usage: u64) -> pb::Sample {
    pb::Sample {
        process: Some(pb::ProcessMemory {
            pid: CHILD_PID,
            vm_rss_bytes: rss,
            ..Default::default()
        }),
        ..sample(
            time_ns,
            vec![v1(OWN, 64 * MIB, usage, usage, 0, 0)],
            system(10, 12 * GIB),
        )
    }
}

#[test]
fn a_host_side_kill_before_any_growth_is_immediate() {
    // The README's demo: 200 MiB asked for under a 64 MiB cgroup limit, killed
    // within 0.3 s.
    let before = counters(
        T0,
        vec![v1(OWN, 64 * MIB, MIB, 2 * MIB, 0, 0)],
        system(10, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![v1(OWN, 64 * MIB, 66_973_696, 67_108_864, 312, 1)],
        system(11, 12 * GIB),
    );
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let trigger = |e: &Evidence| {
        let d = diagnose(e);
        assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:?}", d.evidence);
        (d.trigger.unwrap_or_default(), d.evidence)
    };

    // No reading came before the kill.
    let (t, evidence) = trigger(&e);
    assert_eq!(t, "immediate");
    has(
        &evidence,
        "trigger immediate: the failure came before any reading of the process, with no growth before it",
    );

    // Only the reading `oomscope run` takes as it starts the child: nothing grew yet.
    e.samples = vec![host_reading(T0, MIB, 2 * MIB)];
    let (t, evidence) = trigger(&e);
    assert_eq!(t, "immediate");
    has(
        &evidence,
        "trigger immediate: the failure came with no growth before it: the 1 reading(s) before it stayed within 16.0 MiB of the first",
    );

    // Readings that show the child growing (10 -> 60 MiB) before the kill: the
    // growth has no pattern to name, but it was there, so not immediate.
    e.samples = (0..6)
        .map(|i| {
            let b = (10 + 10 * i as u64) * MIB;
            host_reading(T0 + i * SEC / 10, b, b + MIB)
        })
        .collect();
    assert_eq!(trigger(&e).0, "unknown");

    // Growth of the cgroup alone counts too.
    e.samples = vec![
        host_reading(T0, 10 * MIB, 11 * MIB),
        host_reading(T0 + SEC, 10 * MIB, 40 * MIB),
    ];
    assert_eq!(trigger(&e).0, "unknown");

    // Readings after the failure say nothing about what came before it.
    e.samples = vec![
        host_reading(T0, MIB, 2 * MIB),
        host_reading(T0 + 4 * SEC, 60 * MIB, 61 * MIB),
    ];
    assert_eq!(trigger(&e).0, "immediate");
}

#[test]
fn a_kill_that_is_no_memory_failure_is_never_immediate() {
    let (before, after) = unchanged(vec![v1(OWN, 64 * MIB, 10 * MIB, 12 * MIB, 3, 0)]);
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("external_kill"));
    assert_eq!(d.trigger.as_deref(), Some("unknown"));
}

fn unchanged(levels: Vec<pb::CgroupLevel>) -> (pb::HostCounters, pb::HostCounters) {
    (
        counters(T0, levels.clone(), system(7, 12 * GIB)),
        counters(T0 + 3 * SEC, levels, system(7, 12 * GIB)),
    )
}

#[test]
fn memory_error_under_rlimit_as_is_address_space() {
    let (before, after) = unchanged(vec![v1(OWN, V1_UNLIMITED, 200 * MIB, 210 * MIB, 0, 0)]);
    let stderr = "Traceback (most recent call last):\n  File \"grow.py\", line 9, in <module>\n    buf = bytearray(512 * 1024 * 1024)\nMemoryError\n";
    let proc_ = process(CHILD_PID, 268_435_456, 251_658_240, 249_561_088);
    let e = supervised(
        exit(Some(1), None, stderr, before, after, Some(proc_)),
        "exit_oom_text",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("address_space"));
    has(&d.evidence, "stderr: MemoryError");
    has(
        &d.evidence,
        "RLIMIT_AS 256.0 MiB (268435456 bytes); VmPeak 240.0 MiB (251658240 bytes)",
    );
    has(&d.evidence, "no kernel OOM counter moved");
    let c = cause(&d, "address_space_limit");
    assert_eq!(metric(c, "limit_bytes"), 268_435_456.0);
    assert_eq!(metric(c, "vm_peak_bytes"), 251_658_240.0);
    assert!(c.confidence >= 0.9, "VmPeak is 94% of the limit");
    assert!(d
        .fixes
        .iter()
        .any(|f| f.action.contains("RLIMIT_AS (256.0 MiB)")));
}

/// Another process's OOM kill moves /proc/vmstat oom_kill during the run.
fn someone_else_killed(levels: Vec<pb::CgroupLevel>) -> (pb::HostCounters, pb::HostCounters) {
    (
        counters(T0, levels.clone(), system(7, 12 * GIB)),
        counters(T0 + 3 * SEC, levels, system(8, 12 * GIB)),
    )
}

#[test]
fn its_own_refusal_beats_another_processs_oom_kill() {
    // Seen in CI: an RLIMIT_AS MemoryError while a neighbouring test's
    // cgroup kill moved the machine-wide counter.
    let levels = vec![v1(OWN, V1_UNLIMITED, 200 * MIB, 210 * MIB, 0, 0)];
    let (before, after) = someone_else_killed(levels.clone());
    let proc_ = process(CHILD_PID, 268_435_456, 251_658_240, 249_561_088);
    let e = supervised(
        exit(Some(1), None, "MemoryError\n", before, after, Some(proc_)),
        "exit_oom_text",
    );
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("address_space"),
        "{:#?}",
        d.evidence
    );
    has(&d.evidence, "RLIMIT_AS 256.0 MiB (268435456 bytes)");

    // A CUDA OOM that ended the process with code 1: the device, not the host.
    let (before, after) = someone_else_killed(levels.clone());
    let e = supervised(
        exit(
            Some(1),
            None,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n",
            before,
            after,
            None,
        ),
        "exit_oom_text",
    );
    assert_eq!(diagnose(&e).domain.as_deref(), Some("gpu_vram"));

    // Killed (SIGKILL) while the global OOM killer ran: that kill is the death.
    let (before, after) = someone_else_killed(levels);
    let proc_ = process(CHILD_PID, 268_435_456, 251_658_240, 249_561_088);
    let e = supervised(
        exit(None, Some(9), "MemoryError\n", before, after, Some(proc_)),
        "signal",
    );
    assert_eq!(diagnose(&e).domain.as_deref(), Some("host_ram"));
}

#[test]
fn bad_alloc_abort_under_rlimit_as_is_address_space() {
    let (before, after) = unchanged(vec![v1(OWN, V1_UNLIMITED, 20 * MIB, 20 * MIB, 0, 0)]);
    let stderr = "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n";
    let proc_ = process(CHILD_PID, 512 * MIB, 40 * MIB, 40 * MIB);
    let e = supervised(
        exit(Some(134), None, stderr, before, after, Some(proc_)),
        "exit_oom_text",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("address_space"));
    has(&d.evidence, "RLIMIT_AS 512.0 MiB (536870912 bytes)");
    // VmPeak far below the limit: one huge request, and the cause says so.
    let c = cause(&d, "address_space_limit");
    assert!(c.confidence < 0.9);
    has(&c.evidence, "one large request was refused");
}

#[test]
fn sigbus_is_shm() {
    let (before, mut after) = unchanged(vec![v1(OWN, V1_UNLIMITED, 300 * MIB, 310 * MIB, 0, 0)]);
    let sys = after.system.as_mut().unwrap();
    sys.shm_total_bytes = 64 * MIB; // Docker's default --shm-size
    sys.shm_used_bytes = 64 * MIB;
    let e = supervised(
        exit(
            None,
            Some(7),
            "Bus error (core dumped)\n",
            before,
            after,
            None,
        ),
        "signal",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("shm"));
    has(&d.evidence, "killed by signal 7 (SIGBUS)");
    has(
        &d.evidence,
        "/dev/shm used 64.0 MiB (67108864 bytes) of 64.0 MiB (67108864 bytes) (100.0%)",
    );
    has(&d.evidence, "no kernel OOM counter moved");
    let c = cause(&d, "shm_full");
    assert_eq!(metric(c, "shm_used_bytes"), 67_108_864.0);
    assert_eq!(c.confidence, 0.9);
    assert!(d
        .fixes
        .iter()
        .any(|f| f.action.contains("Enlarge /dev/shm")));
}

/// Seven samples over 60 s: the cgroup refaults 58,000 pages, swap-in runs, PSI stalls.
fn thrashing_samples() -> Vec<pb::Sample> {
    (0..7u64)
        .map(|i| {
            let mut level = v2(
                OWN,
                2 * GIB,
                2 * GIB - 4 * MIB,
                2 * GIB,
                V2Events {
                    max: 100 * i,
                    ..Default::default()
                },
            );
            level.workingset_refault_file = 1_000 + 50_000 * i / 6;
            level.workingset_refault_anon = 200 + 8_000 * i / 6;
            level.pressure = Some(pb::Pressure {
                some_avg10: if i == 6 { 35.2 } else { 5.0 * i as f64 },
                full_avg10: if i == 6 { 12.1 } else { 2.0 * i as f64 },
                some_total_us: 1_000_000 + 1_400_000 * i,
                full_total_us: 300_000 + 500_000 * i,
            });
            let mut sys = system(0, 300 * MIB);
            sys.vmstat_pswpin = 10_000 + 2_000 * i;
            sys.vmstat_pswpout = 20_000 + 5_000 * i;
            sys.vmstat_workingset_refault_file = 5_000 + 50_500 * i / 6;
            sample(T0 + (i as i64) * 10 * SEC, vec![level], sys)
        })
        .collect()
}

#[test]
fn swap_thrash_from_samples_without_a_death() {
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples: thrashing_samples(),
        events: vec![],
        incident: None,
    };
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("swap_thrash"));
    has(&d.evidence, "cgroup /oomtest/child workingset refaults +58000 pages (file 50000, anon 8000) over 60.0 s = 966.7/s");
    has(
        &d.evidence,
        "swap pswpin +12000 pages (200.0/s), pswpout +30000 pages (500.0/s)",
    );
    has(&d.evidence, "PSI memory some avg10 35.20%, full avg10 12.10%; stall total +8.400 s (some), +3.000 s (full)");
    let c = cause(&d, "swap_thrash");
    assert!((metric(c, "refaults_per_s") - 966.666).abs() < 0.01);
    assert_eq!(metric(c, "psi_some_avg10"), 35.2);
    assert_eq!(metric(c, "refault_pages"), 58_000.0);
    assert!(d.fixes.iter().any(|f| f
        .caveat
        .as_deref()
        .is_some_and(|c| c.contains("more swap does not fix thrash"))));
}

#[test]
fn swap_thrash_when_the_child_exited_zero() {
    let (before, after) = unchanged(vec![v2(OWN, 2 * GIB, GIB, GIB, V2Events::default())]);
    let mut e = supervised(exit(Some(0), None, "", before, after, None), "signal");
    e.incident = None;
    e.samples = thrashing_samples();
    assert_eq!(attribute_domain(&e).domain, Domain::SwapThrash);
}

#[test]
fn refaults_without_stall_are_not_thrash() {
    let mut samples = thrashing_samples();
    for s in &mut samples {
        s.cgroup[0].pressure = Some(pb::Pressure::default());
        s.system.as_mut().unwrap().pressure = Some(pb::Pressure::default());
        s.system.as_mut().unwrap().vmstat_pswpin = 0;
    }
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: vec![],
        incident: None,
    };
    let v = attribute_domain(&e);
    assert!(!v.failed, "{v:#?}");
    assert_eq!(diagnose(&e).domain, None);
}

#[test]
fn sigkill_with_no_counter_moving_is_external_kill() {
    let (before, after) = unchanged(vec![
        v1(OWN, 64 * MIB, 10 * MIB, 12 * MIB, 3, 0),
        v1("/oomtest", V1_UNLIMITED, 10 * MIB, 12 * MIB, 0, 0),
    ]);
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("external_kill"));
    assert!(d.cgroup.is_none());
    has(
        &d.evidence,
        "killed by signal 9 (SIGKILL) with no kernel OOM counter moving",
    );
    has(
        &d.evidence,
        "cgroup oom_kill/oom/failcnt and /proc/vmstat oom_kill unchanged",
    );
    let c = cause(&d, "external_kill");
    assert_eq!(metric(c, "runtime_s"), 3.0);
}

#[test]
fn sigkill_with_a_cgroup_counter_moving_is_cgroup() {
    // The oom_control reading came before the kill was counted (the v1 eventfd fires
    // first), but the level sits at its limit with failcnt rising: a cgroup kill.
    let before = counters(
        T0,
        vec![v1(OWN, 64 * MIB, MIB, 2 * MIB, 3, 0)],
        system(7, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![v1(OWN, 64 * MIB, 67_076_096, 67_108_864, 145, 0)],
        system(7, 12 * GIB),
    );
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"));
    assert_eq!(d.cgroup.as_ref().unwrap().limit_bytes, 67_108_864);
    has(&d.evidence, "memory.failcnt 3 -> 145");
}

#[test]
fn failcnt_at_the_limit_without_a_kill_is_not_a_cgroup_oom() {
    // Reclaim at the limit succeeded; the child then failed for its own reason.
    let before = counters(
        T0,
        vec![v1(OWN, 64 * MIB, MIB, 2 * MIB, 3, 0)],
        system(7, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![v1(OWN, 64 * MIB, 60 * MIB, 67_108_864, 145, 0)],
        system(7, 12 * GIB),
    );
    let e = supervised(
        exit(Some(1), None, "KeyError: 'model'\n", before, after, None),
        "signal",
    );
    let v = attribute_domain(&e);
    assert_eq!(v.domain, Domain::Unknown);
    has(&v.evidence, "cgroup /oomtest/child memory.failcnt 3 -> 145");
}

#[test]
fn clean_exit_has_no_domain() {
    let (before, after) = unchanged(vec![v1(OWN, 64 * MIB, 10 * MIB, 12 * MIB, 0, 0)]);
    let mut e = supervised(exit(Some(0), None, "", before, after, None), "signal");
    e.incident = None;
    let d = diagnose(&e);
    assert_eq!(d.domain, None);
    assert!(d.causes.is_empty() && d.fixes.is_empty());
    assert_eq!(
        d.exit,
        Some(pb::ExitStatus {
            code: Some(0),
            signal: None
        })
    );
    has(&d.evidence, "exited with code 0");
    assert!(!attribute_domain(&e).failed);
}

#[test]
fn ambiguous_evidence_is_unknown() {
    // Exit 1 with an unrelated error and nothing moved, long after it
    // started (within 30 s of its start it is a start-up failure: startup.rs).
    let (before, after) = unchanged(vec![v1(OWN, V1_UNLIMITED, 10 * MIB, 12 * MIB, 0, 0)]);
    let mut ended = exit(
        Some(1),
        None,
        "ValueError: bad config\n",
        before,
        after,
        None,
    );
    if let Some(pb::event::Kind::ChildExit(x)) = &mut ended.kind {
        x.runtime_ns = 600 * SEC as u64;
    }
    let e = supervised(ended, "signal");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("unknown"));
    has(&d.evidence, "exited with code 1");
    has(&d.evidence, "no kernel OOM counter moved");

    // MemoryError with no limit to blame and no counter: say so, do not guess.
    let (before, after) = unchanged(vec![v1(OWN, V1_UNLIMITED, 10 * MIB, 12 * MIB, 0, 0)]);
    let e = supervised(
        exit(
            Some(1),
            None,
            "MemoryError\n",
            before,
            after,
            Some(process(CHILD_PID, 0, 90 * MIB, 90 * MIB)),
        ),
        "exit_oom_text",
    );
    let v = attribute_domain(&e);
    assert_eq!(v.domain, Domain::Unknown);
    has(
        &v.evidence,
        "no RLIMIT_AS, no strict overcommit and no OOM counter explains it",
    );

    // SIGKILL without before/after counters cannot tell a kernel kill from an outside one.
    let mut event = exit(
        None,
        Some(9),
        "",
        counters(T0, vec![], system(0, 0)),
        counters(T0, vec![], system(0, 0)),
        None,
    );
    if let Some(Kind::ChildExit(x)) = &mut event.kind {
        x.before = None;
        x.after = None;
    }
    let v = attribute_domain(&supervised(event, "signal"));
    assert_eq!(v.domain, Domain::Unknown);
    has(&v.evidence, "no before/after kernel counters were recorded");
}

#[test]
fn strict_overcommit_is_address_space() {
    let (before, mut after) = unchanged(vec![v1(OWN, V1_UNLIMITED, 10 * MIB, 12 * MIB, 0, 0)]);
    let sys = after.system.as_mut().unwrap();
    sys.overcommit_mode = 2;
    sys.commit_limit_bytes = 10 * GIB;
    sys.committed_as_bytes = 9_900_000_000;
    let stderr = "OSError: [Errno 12] Cannot allocate memory\n";
    let e = supervised(
        exit(Some(1), None, stderr, before, after, None),
        "exit_oom_text",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("address_space"));
    has(
        &d.evidence,
        "Committed_AS 9.2 GiB (9900000000 bytes) of CommitLimit 10.0 GiB (10737418240 bytes)",
    );
    let c = cause(&d, "overcommit_limit");
    assert_eq!(metric(c, "committed_as_bytes"), 9_900_000_000.0);
}

#[test]
fn device_oom_is_gpu_vram() {
    // fragmentation_oom on the H200: 96 MiB refused under a 2 GiB cap.
    let text = "CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 137.33 GiB is free. Including non-PyTorch memory, this process has 2.46 GiB memory in use. 2.00 GiB allowed; Of the allocated memory 800.00 MiB is allocated by PyTorch, and 1.17 GiB is reserved by PyTorch but unallocated.";
    let oom = pb::Oom {
        device: 0,
        requested_bytes: 100_663_296,
        observer: Some(pb::OomObserver {
            device: 0,
            alloc: 100_663_296,
            device_allocated: 2_147_483_648,
            device_free: 147_460_325_376,
        }),
        error_type: "OutOfMemoryError".into(),
        error_text: text.into(),
        ..Default::default()
    };
    let gpu = pb::GpuDevice {
        index: 0,
        name: "NVIDIA H200".into(),
        total_bytes: 150_754_820_096,
        free_bytes: 147_460_325_376,
        used_bytes: 3_294_494_720,
        processes: vec![pb::GpuProcessUsage {
            pid: 4200,
            used_bytes: Some(2_641_362_944),
            ..Default::default()
        }],
        ..Default::default()
    };
    let s = pb::Sample {
        time_ns: T0,
        gpus: vec![gpu],
        ..Default::default()
    };
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples: vec![s],
        events: vec![pb::Event {
            time_ns: T0 + SEC,
            kind: Some(Kind::Oom(oom)),
        }],
        incident: incident("oom", T0 + SEC),
    };
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    assert_eq!(d.exit, None);
    has(
        &d.evidence,
        "device OOM on GPU 0: requested 96.0 MiB (100663296 bytes)",
    );
    has(
        &d.evidence,
        "OOM observer: device total or cap 2.0 GiB (2147483648 bytes)",
    );
    has(
        &d.evidence,
        "NVML GPU 0 (NVIDIA H200): used 3.1 GiB of 140.4 GiB",
    );
    // Our own pid on the GPU is not "another process".
    assert!(d.causes.iter().all(|c| c.kind != "other_process"));
    assert!(!d.fixes.is_empty() && d.fixes.iter().all(|f| !f.retest.is_empty()));
}

#[test]
fn cuda_error_2_under_a_finite_rlimit_as_says_so() {
    let (before, after) = unchanged(vec![v1(OWN, V1_UNLIMITED, 10 * MIB, 12 * MIB, 0, 0)]);
    let proc_ = process(CHILD_PID, 8 * GIB, 7 * GIB, 7 * GIB);
    let e = supervised(
        exit(
            Some(1),
            None,
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")\n",
            before,
            after,
            Some(proc_),
        ),
        "exit_oom_text",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    has(&d.evidence, "RLIMIT_AS is finite (8.0 GiB (8589934592 bytes)); CUDA error 2 can be a host address-space failure");
    assert_eq!(
        metric(cause(&d, "address_space_limit"), "limit_bytes"),
        (8 * GIB) as f64
    );
}

#[test]
fn lost_agent_with_quiet_samples_is_unknown_with_the_last_sample_time() {
    let levels = vec![v2(OWN, 0, GIB, GIB, V2Events::default())];
    let samples = vec![
        sample(T0, levels.clone(), system(0, 10 * GIB)),
        sample(T0 + 5 * SEC, levels, system(0, 10 * GIB)),
    ];
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: vec![],
        incident: incident("agent_lost", T0 + 35 * SEC),
    };
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("unknown"));
    has(&d.evidence, "last sample at 2026-11-03T10:00:05.000Z (30.0 s before the stream broke at 2026-11-03T10:00:35.000Z)");
    assert_eq!(d.agent.as_deref(), Some("oomtest"), "the agent by its name");
}

#[test]
fn lost_agent_whose_samples_show_a_cgroup_oom() {
    let quiet = V2Events::default();
    let hit = V2Events {
        max: 3,
        oom: 2,
        oom_kill: 1,
        local_oom: 2,
        local_oom_kill: 1,
    };
    let samples = vec![
        sample(
            T0,
            vec![v2(OWN, 4 * GIB, GIB, GIB, quiet)],
            system(0, 10 * GIB),
        ),
        sample(
            T0 + 5 * SEC,
            vec![v2(OWN, 4 * GIB, 4 * GIB - MIB, 4 * GIB, hit)],
            system(1, 10 * GIB),
        ),
    ];
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: vec![],
        incident: incident("agent_lost", T0 + 6 * SEC),
    };
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"));
    assert_eq!(d.cgroup.as_ref().unwrap().limit_bytes, 4 * GIB);
    has(&d.evidence, "memory.events.local oom 0 -> 2");
    has(&d.evidence, "last sample at 2026-11-03T10:00:05.000Z");
}

#[test]
fn crash_loop_gets_a_bounded_restart_fix() {
    let (before, after) = unchanged(vec![v1(OWN, 64 * MIB, 10 * MIB, 12 * MIB, 0, 0)]);
    let mut event = exit(None, Some(9), "", before, after, None);
    if let Some(Kind::ChildExit(x)) = &mut event.kind {
        x.attempt = 5;
        x.crash_loop = true;
    }
    let d = diagnose(&supervised(event, "crash_loop"));
    has(&d.evidence, "(restart 5); restarts gave up (crash loop)");
    assert!(d
        .fixes
        .iter()
        .any(|f| f.action.contains("Keep restarts bounded")));
}

#[test]
fn v2_global_oom_raises_oom_kill_but_no_oom_anywhere() {
    // On a global OOM, v2 counts the kill up the victim's tree (oom_kill) but no
    // level records `oom`: no cgroup limit was hit.
    let own = "/app.slice/inference-server";
    let quiet = V2Events::default();
    let killed = V2Events {
        oom_kill: 1,
        local_oom_kill: 1,
        ..quiet
    };
    let before = counters(
        T0,
        vec![
            v2(own, 0, 12 * GIB, 12 * GIB, quiet),
            v2("/app.slice", 0, 12 * GIB, 12 * GIB, quiet),
        ],
        system(0, 8 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![
            v2(own, 0, 15 * GIB, 15 * GIB, killed),
            v2(
                "/app.slice",
                0,
                15 * GIB,
                15 * GIB,
                V2Events {
                    oom_kill: 1,
                    ..quiet
                },
            ),
        ],
        system(1, 64 * MIB),
    );
    let d = diagnose(&supervised(
        exit(None, Some(9), "", before, after, None),
        "signal",
    ));
    assert_eq!(d.domain.as_deref(), Some("host_ram"));
    assert!(d.cgroup.is_none());
    has(
        &d.evidence,
        "/proc/vmstat oom_kill 0 -> 1: the global OOM killer ran",
    );
    has(&d.evidence, "no cgroup level has a memory limit");
    assert_eq!(
        metric(cause(&d, "host_ram_exhausted"), "mem_available_bytes"),
        (64 * MIB) as f64
    );
}

#[test]
fn v1_memsw_limit_leaves_failcnt_at_zero_but_peak_and_kill_decide() {
    // Recorded on kernel 6.18 (v1): memory.memsw.limit_in_bytes equal to the
    // limit makes the memsw counter fail the charge, so memory.failcnt stays
    // 0; vmstat oom_kill rises for this cgroup kill as for a global one.
    let before = counters(
        T0,
        vec![
            v1(OWN, 64 * MIB, MIB, 2 * MIB, 0, 0),
            v1("/oomtest", V1_UNLIMITED, MIB, 2 * MIB, 0, 0),
        ],
        system(3, 12 * GIB),
    );
    let after = counters(
        T0 + SEC,
        vec![
            v1(OWN, 64 * MIB, 3 * MIB, 67_108_864, 0, 1),
            v1("/oomtest", V1_UNLIMITED, 3 * MIB, 67_108_864, 0, 0),
        ],
        system(4, 12 * GIB),
    );
    let d = diagnose(&supervised(
        exit(None, Some(9), "", before, after, None),
        "signal",
    ));
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    let cg = d.cgroup.as_ref().unwrap();
    assert_eq!((cg.limit_bytes, cg.owner_level.as_str()), (67_108_864, OWN));
    has(&d.evidence, "peak 64.0 MiB (67108864 bytes)");
    has(&d.evidence, "memory.oom_control oom_kill 0 -> 1");
    has(
        &d.evidence,
        "/proc/vmstat oom_kill 3 -> 4 (it counts cgroup kills too)",
    );
}
