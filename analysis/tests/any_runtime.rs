//! Verdicts that hold for any runtime: the runtimes' own memory texts, the
//! kernel's OOM record, stops passed on by the supervisor, the machine-wide
//! OOM counter that other processes move, and thrash read relative to the
//! working set.

mod common;

use common::*;
use oomscope_analysis::oom_texts::Memory;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{attribute_domain, diagnose, Domain, Evidence, RUNTIME_TEXTS};

const OWN: &str = "/oomtest/child";
const SIGTERM: i32 = 15;

/// Counters that did not move, on a host with 12 GiB of 16 GiB available.
fn quiet() -> (pb::HostCounters, pb::HostCounters) {
    let levels = vec![v1(OWN, V1_UNLIMITED, 200 * MIB, 210 * MIB, 0, 0)];
    (
        counters(T0, levels.clone(), system(7, 12 * GIB)),
        counters(T0 + 3 * SEC, levels, system(7, 12 * GIB)),
    )
}

/// Another cgroup on the host was OOM-killed during the run: only
/// /proc/vmstat oom_kill moved, and RAM stayed plentiful.
fn neighbour_killed() -> (pb::HostCounters, pb::HostCounters) {
    let levels = vec![v1(OWN, V1_UNLIMITED, 200 * MIB, 210 * MIB, 0, 0)];
    (
        counters(T0, levels.clone(), system(7, 12 * GIB)),
        counters(T0 + 3 * SEC, levels, system(8, 12 * GIB)),
    )
}

fn with_stop(mut e: Evidence, sig: i32) -> Evidence {
    for ev in &mut e.events {
        if let Some(Kind::ChildExit(x)) = &mut ev.kind {
            x.stop_signal = Some(sig);
        }
    }
    e
}

fn kernel_event(time_ns: i64, k: pb::KernelOomKill) -> pb::Event {
    pb::Event {
        time_ns,
        kind: Some(Kind::KernelOomKill(k)),
    }
}

/// The record of tests/fixtures/kmsg/cgroup_v1_own_level.kmsg, for our child.
fn memcg_record() -> pb::KernelOomKill {
    pb::KernelOomKill {
        pid: CHILD_PID,
        task: "VLLM::Worker".into(),
        constraint: "CONSTRAINT_MEMCG".into(),
        oom_memcg: "/process_api/ddeec585/oomcap-test".into(),
        task_memcg: "/process_api/ddeec585/oomcap-test/worker".into(),
        total_vm_bytes: 221_368 * 1024,
        anon_rss_bytes: 65_280 * 1024,
        file_rss_bytes: 6_656 * 1024,
        memcg_usage_bytes: 64 * MIB,
        memcg_limit_bytes: 64 * MIB,
        invoked_by: "python3".into(),
        lines: vec![
            "python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0".into(),
            "memory: usage 65536kB, limit 65536kB, failcnt 76".into(),
            format!("Memory cgroup out of memory: Killed process {CHILD_PID} (VLLM::Worker) total-vm:221368kB, anon-rss:65280kB, file-rss:6656kB, shmem-rss:0kB, UID:0 pgtables:188kB oom_score_adj:0"),
        ],
        ..Default::default()
    }
}

// --- the runtimes' own texts ------------------------------------------------

#[test]
fn each_runtime_text_in_a_failed_exit_names_its_domain_and_cause() {
    for t in RUNTIME_TEXTS {
        let (before, after) = quiet();
        let stderr = format!("INFO loading weights\n{}\nINFO shutting down\n", t.example);
        let e = supervised(
            exit(Some(1), None, &stderr, before, after, None),
            "exit_oom_text",
        );
        let d = diagnose(&e);
        // No GPU in this evidence: a runtime's own memory is host RAM.
        let want = t.memory.domain(false).unwrap_or(Domain::Unknown);
        assert_eq!(
            d.domain.as_deref(),
            Some(want.as_str()),
            "{} {:?}: {:#?}",
            t.runtime,
            t.example,
            d.evidence
        );
        has(&d.evidence, "stderr: ");
        if let Some(kind) = t.cause {
            let c =
                d.causes.iter().find(|c| c.kind == kind).unwrap_or_else(|| {
                    panic!("{:?}: no {kind} cause in {:#?}", t.example, d.causes)
                });
            has(&c.evidence, t.meaning);
            assert!(
                d.fixes.iter().any(|f| f.action == t.fix),
                "{:?}: the table's fix is offered: {:#?}",
                t.example,
                d.fixes
            );
        }
    }
}

#[test]
fn a_runtime_text_on_a_gpu_host_names_the_device() {
    let (before, after) = quiet();
    let mut e = supervised(
        exit(
            Some(1),
            None,
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.\n",
            before,
            after,
            None,
        ),
        "exit_oom_text",
    );
    e.hello.as_mut().unwrap().gpus.push(pb::GpuPlacement {
        index: 0,
        total_bytes: 80 * GIB,
        ..Default::default()
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    assert_eq!(d.causes[0].kind, "kv_no_room");
}

#[test]
fn the_kv_reservation_text_asks_to_lower_the_reservation() {
    let t = RUNTIME_TEXTS
        .iter()
        .find(|t| t.example.contains("less than requested memory for kv"))
        .unwrap();
    assert_eq!((t.memory, t.cause), (Memory::Host, Some("kv_reservation")));
    let (before, after) = quiet();
    let e = supervised(
        exit(Some(1), None, "(Worker pid=114) ERROR ValueError: Available memory on node 0 (20.88/23.54 GiB) on kv cache allocation is less than requested memory for kv (40.0 GiB).\n", before, after, None),
        "exit_oom_text",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"));
    assert_eq!(d.causes[0].kind, "kv_reservation");
    assert!(
        d.fixes[0].action.starts_with("Lower the KV reservation"),
        "{:#?}",
        d.fixes
    );
    assert_eq!(d.victim.as_ref().map(|v| v.pid), Some(CHILD_PID));
}

// --- the machine-wide counter never decides alone ----------------------------

#[test]
fn a_sigterm_while_another_cgroup_was_oom_killed_is_never_host_ram() {
    let (before, after) = neighbour_killed();
    let e = supervised(exit(None, Some(SIGTERM), "", before, after, None), "signal");
    let v = attribute_domain(&e);
    assert_ne!(v.domain, Domain::HostRam, "{v:#?}");
    has(&v.evidence, "it counts every kill on the host");
}

#[test]
fn a_stop_passed_on_with_a_global_vmstat_move_has_no_failed_domain() {
    let (before, after) = neighbour_killed();
    let e = with_stop(
        supervised(exit(None, Some(SIGTERM), "", before, after, None), "signal"),
        SIGTERM,
    );
    let d = diagnose(&e);
    assert_eq!(d.domain, None, "{:#?}", d.evidence);
    assert!(d.victim.is_none());
    assert!(d.fixes.is_empty());
    has(
        &d.evidence,
        "SIGTERM was a stop that oomscope run passed on",
    );
    has(&d.evidence, "another process's kill on this host");

    // A shell that reports the stop as 143 is the same stop.
    let (before, after) = neighbour_killed();
    let e = with_stop(
        supervised(exit(Some(143), None, "", before, after, None), "signal"),
        SIGTERM,
    );
    assert!(!attribute_domain(&e).failed);
}

#[test]
fn a_sigkill_with_a_vmstat_move_but_plenty_of_ram_is_not_host_ram() {
    let (before, after) = neighbour_killed();
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let v = attribute_domain(&e);
    assert_ne!(v.domain, Domain::HostRam, "{v:#?}");
}

#[test]
fn a_sigkill_with_a_vmstat_move_and_low_ram_before_the_death_is_host_ram() {
    let (before, after) = neighbour_killed();
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    // The last sample before the death saw RAM nearly gone; the reading at
    // the exit (after the kill freed the victim) looks healthy again.
    e.samples
        .push(sample(T0 + 2 * SEC, vec![], system(7, 200 * MIB)));
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    has(
        &d.evidence,
        "MemAvailable 200.0 MiB (209715200 bytes) of MemTotal 16.0 GiB (17179869184 bytes); swap free 2.0 GiB of 2.0 GiB (the last sample, 1.0 s before the death)",
    );
}

// --- the kernel's record decides -------------------------------------------

#[test]
fn a_memcg_kernel_record_decides_cgroup_at_its_level() {
    let (before, after) = quiet();
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    e.events
        .insert(0, kernel_event(T0 + 3 * SEC - 50_000_000, memcg_record()));
    e.samples.push(pb::Sample {
        time_ns: T0 + 2 * SEC,
        tree: vec![pb::ProcessInfo {
            pid: CHILD_PID,
            command: "python -m vllm.entrypoints.openai.api_server".into(),
            title: "VLLM::Worker".into(),
            rss_bytes: 60 * MIB,
            ..Default::default()
        }],
        ..Default::default()
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    let cg = d.cgroup.as_ref().unwrap();
    assert_eq!(cg.owner_level, "/process_api/ddeec585/oomcap-test");
    assert_eq!(cg.path, "/process_api/ddeec585/oomcap-test/worker");
    assert_eq!(cg.limit_bytes, 64 * MIB);
    has(
        &d.evidence,
        "kernel: Memory cgroup out of memory: Killed process 4242 (VLLM::Worker)",
    );
    has(
        &d.evidence,
        "CONSTRAINT_MEMCG, the limit of /process_api/ddeec585/oomcap-test was hit",
    );
    has(
        &d.evidence,
        "victim pid 4242 (VLLM::Worker) at the kill: anon-rss 63.8 MiB",
    );
    let v = d.victim.as_ref().unwrap();
    assert_eq!((v.pid, v.title.as_str()), (CHILD_PID, "VLLM::Worker"));
    assert_eq!(v.command, "python -m vllm.entrypoints.openai.api_server");
    assert_eq!(d.causes[0].kind, "cgroup_limit");
    assert!(d
        .fixes
        .iter()
        .any(|f| f.action.contains("/process_api/ddeec585/oomcap-test")));
}

#[test]
fn a_global_kernel_record_decides_host_ram_with_figures_in_precedence() {
    let (before, after) = quiet();
    let mut record = memcg_record();
    record.constraint = "CONSTRAINT_NONE".into();
    record.oom_memcg = "/".into();
    record.memcg_limit_bytes = 0;
    record.lines = vec![format!(
        "Out of memory: Killed process {CHILD_PID} (python3) total-vm:221368kB, anon-rss:65280kB, file-rss:6656kB, shmem-rss:0kB"
    )];
    // Without a sample before the death, the host's reading is the one at
    // the exit, and it says so.
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    e.events.push(kernel_event(T0 + 3 * SEC, record.clone()));
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    has(
        &d.evidence,
        "kernel: Out of memory: Killed process 4242 (python3)",
    );
    has(&d.evidence, "CONSTRAINT_NONE: the machine's memory");
    has(&d.evidence, "(read after the death)");
    assert_eq!(d.causes[0].kind, "host_ram_exhausted");
    assert_eq!(d.victim.as_ref().unwrap().title, "VLLM::Worker");

    // With a sample before it, that sample speaks for the moment of the death.
    let (before, after) = quiet();
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    e.events.push(kernel_event(T0 + 3 * SEC, record));
    e.samples
        .push(sample(T0 + 2 * SEC, vec![], system(7, 90 * MIB)));
    let d = diagnose(&e);
    has(
        &d.evidence,
        "MemAvailable 90.0 MiB (94371840 bytes) of MemTotal 16.0 GiB",
    );
    has(&d.evidence, "(the last sample, 1.0 s before the death)");
}

#[test]
fn a_kernel_record_beats_a_passed_on_stop() {
    let (before, after) = quiet();
    let mut e = with_stop(
        supervised(exit(None, Some(SIGTERM), "", before, after, None), "signal"),
        SIGTERM,
    );
    e.events.push(kernel_event(T0 + 2 * SEC, memcg_record()));
    assert_eq!(attribute_domain(&e).domain, Domain::Cgroup);
}

#[test]
fn a_record_from_before_the_childs_life_does_not_explain_its_exit() {
    let (before, after) = quiet();
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    // The child ran 3 s; this kill was a minute earlier (a previous attempt).
    e.events
        .insert(0, kernel_event(T0 - 60 * SEC, memcg_record()));
    assert_eq!(attribute_domain(&e).domain, Domain::ExternalKill);
}

#[test]
fn an_unreadable_kernel_log_is_said() {
    let (before, after) = quiet();
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    e.hello.as_mut().unwrap().labels.insert(
        "kernel_log".into(),
        "unreadable: /dev/kmsg: Operation not permitted (os error 1)".into(),
    );
    let d = diagnose(&e);
    has(
        &d.evidence,
        "the kernel log could not be read (/dev/kmsg: Operation not permitted (os error 1))",
    );
}

// --- thrash is relative -----------------------------------------------------

/// Ten samples over 60 s of a 4 GiB cgroup on a host without swap.
fn no_swap_samples(refault_file_per_s: u64, psi: Option<f64>) -> Vec<pb::Sample> {
    (0..10u64)
        .map(|i| {
            let mut level = v2(OWN, 8 * GIB, 4 * GIB, 4 * GIB, V2Events::default());
            level.workingset_refault_file = refault_file_per_s * 6 * i;
            level.pressure = psi.map(|share| pb::Pressure {
                some_avg10: share * 100.0,
                some_total_us: (share * 6e6) as u64 * i,
                ..Default::default()
            });
            let mut sys = system(0, 8 * GIB);
            sys.swap_total_bytes = 0;
            sys.swap_free_bytes = 0;
            sample(T0 + (i as i64) * 6 * SEC, vec![level], sys)
        })
        .collect()
}

fn quiet_window(samples: Vec<pb::Sample>) -> Evidence {
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: vec![],
        incident: None,
    }
}

#[test]
fn a_no_swap_host_with_an_absolute_refault_count_only_is_not_thrash() {
    // 540,000 pages (2.1 GiB, half the working set) refaulted, but no PSI:
    // without swap there is no swap-in to show anyone waited.
    let e = quiet_window(no_swap_samples(10_000, None));
    let d = diagnose(&e);
    assert_eq!(d.domain, None, "{:#?}", d.evidence);
    assert!(d.causes.iter().all(|c| c.kind != "swap_thrash"));
    has(&d.evidence, "no swap on this host");
}

#[test]
fn page_cache_refaults_that_slowed_the_process_are_thrash_without_swap() {
    let e = quiet_window(no_swap_samples(10_000, Some(0.3)));
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("swap_thrash"),
        "{:#?}",
        d.evidence
    );
    has(&d.evidence, "of the working set (4.0 GiB in use)");
}

#[test]
fn refaults_that_are_a_sliver_of_the_working_set_are_not_thrash() {
    // 9,000 pages (35 MiB) over a minute with PSI stalling, against 4 GiB:
    // under 1% of the working set came back.
    let e = quiet_window(no_swap_samples(150, Some(0.3)));
    let v = attribute_domain(&e);
    assert!(!v.failed, "{v:#?}");
}
