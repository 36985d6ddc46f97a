//! Start-up failures: a process that exits within 30 s of starting, before
//! serving anything, with no memory domain near a limit, has no domain and
//! the cause `startup_failure`, led by its stderr's error line. The host's
//! pressure and other jobs' processes around it are context, not causes.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, memory_domain, Domain, Evidence};

const OWN: &str = "/jobs/server";

const TRACEBACK: &str = "INFO 12-04 10:00:00 starting server\nTraceback (most recent call last):\n  File \"/srv/server.py\", line 41, in <module>\n    main()\n  File \"/srv/server.py\", line 37, in main\n    raise ValueError(f\"Model path does not exist: {path}\")\nValueError: Model path does not exist: /models/llama-8b\n";

/// A failed start `runtime_s` after the child began, as restart `attempt`.
fn failed_start(at: i64, attempt: u32, runtime_s: f64, stderr: &str, last: bool) -> pb::Event {
    let level = vec![v1(OWN, 8 * GIB, 40 * MIB, 60 * MIB, 0, 0)];
    pb::Event {
        time_ns: at,
        kind: Some(Kind::ChildExit(pb::ChildExit {
            pid: CHILD_PID + attempt,
            exit_code: Some(1),
            stderr_tail: stderr.into(),
            before: Some(counters(at - SEC, level.clone(), system(7, 12 * GIB))),
            after: Some(counters(at, level, system(7, 12 * GIB))),
            attempt,
            crash_loop: last,
            runtime_ns: (runtime_s * 1e9) as u64,
            ..Default::default()
        })),
    }
}

/// Samples over 60 s of a host whose page cache thrashes for other jobs
/// (60,000 file refaults against a 4 GiB working set, system PSI stalling
/// 20% of the time); the process's own faults rise by `majflt` per sample.
fn neighbours_thrash(majflt: u64) -> Vec<pb::Sample> {
    (0..7u64)
        .map(|i| {
            let mut level = v1(OWN, 8 * GIB, 40 * MIB, 60 * MIB, 0, 0);
            level.workingset_refault_file = 500;
            let mut sys = system(7, 12 * GIB);
            sys.swap_total_bytes = 0;
            sys.swap_free_bytes = 0;
            sys.vmstat_workingset_refault_file = 10_000 + 10_000 * i;
            sys.pressure = Some(pb::Pressure {
                some_avg10: 20.0,
                full_avg10: 8.0,
                some_total_us: 2_000_000 * i,
                full_total_us: 800_000 * i,
            });
            let mut s = sample(T0 + (i as i64) * 10 * SEC, vec![level], sys);
            s.process = Some(pb::ProcessMemory {
                pid: CHILD_PID,
                vm_rss_bytes: 30 * MIB,
                major_faults: 40 + majflt * i,
                ..Default::default()
            });
            s
        })
        .collect()
}

/// Another job's process holding 6 GiB of the 16 GiB host.
fn other_job() -> pb::Event {
    pb::Event {
        time_ns: T0 + 5 * SEC,
        kind: Some(Kind::ProcessList(pb::ProcessList {
            host_top_rss: vec![pb::ProcessInfo {
                pid: 777,
                user: "batch".into(),
                command: "python train.py".into(),
                rss_bytes: 6 * GIB,
                ..Default::default()
            }],
            gpu: vec![],
        })),
    }
}

/// `oomscope run --restart 3`: four starts 0.4 s each that failed the same
/// way, the last one giving up, while other jobs thrash the host.
fn crash_loop(stderr: &str, majflt: u64) -> Evidence {
    let mut events = vec![other_job()];
    for attempt in 0..4u32 {
        let at = T0 + 10 * SEC + attempt as i64 * 15 * SEC;
        events.push(failed_start(at, attempt, 0.4, stderr, attempt == 3));
    }
    let last = events.last().unwrap().time_ns;
    Evidence {
        hello: Some(hello()),
        samples: neighbours_thrash(majflt),
        events,
        incident: incident("crash_loop", last),
        ..Default::default()
    }
}

#[test]
fn a_crash_loop_at_start_up_names_its_error_line_and_no_domain() {
    let e = crash_loop(TRACEBACK, 0);
    let d = diagnose(&e);
    assert_eq!(d.domain, None, "{:#?}", d.evidence);
    assert_eq!(memory_domain(&e), None);
    let first = &d.causes[0];
    assert_eq!(first.kind, "startup_failure", "{:#?}", d.causes);
    assert_eq!(
        first.evidence[0],
        "stderr: ValueError: Model path does not exist: /models/llama-8b"
    );
    has(&first.evidence, "exited with code 1 0.4 s after it started");
    has(&first.evidence, "4 starts failed the same way");
    assert_eq!(metric(first, "failed_starts"), 4.0);
    assert_eq!(metric(first, "exit_code"), 1.0);
    assert!((metric(first, "runtime_s") - 0.4).abs() < 1e-9);
    // The host's pressure and the other job are context only.
    assert!(
        d.causes
            .iter()
            .all(|c| c.kind != "swap_thrash" && c.kind != "other_process"),
        "{:#?}",
        d.causes
    );
    has(&d.evidence, "neighbour_pressure: the host thrashed");
    assert!(d.evidence.iter().all(|l| !l.contains("pid 777")));
    assert_eq!(d.trigger.as_deref(), Some("immediate"));
    // The fix names the error and how to retest it.
    let fix = &d.fixes[0];
    assert!(
        fix.action.contains("ValueError: Model path does not exist"),
        "{fix:#?}"
    );
    assert!(fix.retest.contains("once"), "{fix:#?}");
}

#[test]
fn its_own_major_faults_while_starting_are_no_thrash() {
    // 300 major faults every 10 s: 1,800 in all, past the own-pressure
    // threshold, while the host thrashed for others.
    let e = crash_loop(TRACEBACK, 300);
    let d = diagnose(&e);
    assert_eq!(d.domain, None, "{:#?}", d.evidence);
    assert_eq!(d.causes[0].kind, "startup_failure", "{:#?}", d.causes);
    has(
        &d.causes[0].evidence,
        "its own major faults (+1800) came while it was starting",
    );
    assert!(d.causes.iter().all(|c| c.kind != "swap_thrash"));
}

#[test]
fn any_runtimes_error_line_leads_and_a_silent_one_says_so() {
    for (stderr, line) in [
        (
            "llama_model_load: loading model\nerror: failed to open 'm.gguf': No such file or directory\n",
            "stderr: error: failed to open 'm.gguf': No such file or directory",
        ),
        (
            "Error: unexpected argument '--n_ctx' found\n\nUsage: server [OPTIONS]\n",
            "stderr: Error: unexpected argument '--n_ctx' found",
        ),
        ("", "its stderr was empty"),
        ("starting\nbye\n", "no line of its stderr looks like an error; its last line: bye"),
    ] {
        let d = diagnose(&crash_loop(stderr, 0));
        assert_eq!(d.domain, None);
        assert_eq!(d.causes[0].kind, "startup_failure");
        assert!(
            d.causes[0].evidence[0].starts_with(line),
            "{:#?}",
            d.causes[0].evidence
        );
    }
}

#[test]
fn a_start_that_ran_out_of_memory_keeps_its_domain() {
    // The same quick exit, but its cgroup hit its limit: memory explains it.
    let mut e = crash_loop("Killed\n", 0);
    for ev in &mut e.events {
        if let Some(Kind::ChildExit(x)) = &mut ev.kind {
            x.exit_code = None;
            x.signal = Some(9);
            let before = vec![v1(OWN, 512 * MIB, 40 * MIB, 60 * MIB, 0, 0)];
            let after = vec![v1(OWN, 512 * MIB, 500 * MIB, 512 * MIB, 12, 1)];
            x.before = Some(counters(ev.time_ns - SEC, before, system(7, 12 * GIB)));
            x.after = Some(counters(ev.time_ns, after, system(8, 12 * GIB)));
        }
    }
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert_eq!(memory_domain(&e), Some(Domain::Cgroup));
    assert!(d.causes.iter().all(|c| c.kind != "startup_failure"));
}

#[test]
fn a_failure_after_the_start_up_window_or_after_serving_is_no_start_up_failure() {
    let mut late = crash_loop(TRACEBACK, 0);
    for ev in &mut late.events {
        if let Some(Kind::ChildExit(x)) = &mut ev.kind {
            x.runtime_ns = 45 * SEC as u64;
        }
    }
    let d = diagnose(&late);
    assert_eq!(d.domain.as_deref(), Some("unknown"), "{:#?}", d.evidence);
    assert!(d.causes.iter().all(|c| c.kind != "startup_failure"));
    // Other jobs' memory is still no cause: memory was not short and
    // nothing of the process's own moved.
    assert!(
        d.causes.iter().all(|c| c.kind != "other_process"),
        "{:#?}",
        d.causes
    );

    let mut served = crash_loop(TRACEBACK, 0);
    if let Some(s) = served.samples.get_mut(3) {
        s.context = Some(pb::RequestContext {
            requests_done: 2,
            ..Default::default()
        });
    }
    let d = diagnose(&served);
    assert!(d.causes.iter().all(|c| c.kind != "startup_failure"));
}

#[test]
fn other_processes_stay_a_cause_where_memory_ran_short() {
    // A quick death with MemAvailable under a tenth of the host at it: the
    // other job's 6 GiB is part of the answer.
    let mut e = crash_loop("Killed\n", 0);
    for ev in &mut e.events {
        if let Some(Kind::ChildExit(x)) = &mut ev.kind {
            x.exit_code = None;
            x.signal = Some(9);
            let level = vec![v1(OWN, 8 * GIB, 40 * MIB, 60 * MIB, 0, 0)];
            x.after = Some(counters(ev.time_ns, level, system(8, GIB / 2)));
        }
    }
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    let other = cause(&d, "other_process");
    assert_eq!(other.processes[0].pid, 777);
}
