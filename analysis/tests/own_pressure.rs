//! Whose pressure: swap thrash needs the process's own major faults, or its
//! cgroup's refaults, pgmajfault or PSI, to move. Host-wide pressure alone is
//! the context fact `neighbour_pressure`, never the domain or a cause.

mod common;

use common::*;
use oomscope_analysis::{diagnose, pb, Evidence, OWN_MIN_MAJOR_FAULTS};

const OWN: &str = "/jobs/server";

/// Seven samples over 60 s of a host without swap whose page cache thrashes
/// (60,000 file refaults, a 4 GiB working set, system PSI stalling 20% of the
/// time); the process's own cgroup and faults move by `own(i)`.
fn host_thrash(path: &str, own: impl Fn(u64) -> (u64, u64, u64)) -> Vec<pb::Sample> {
    (0..7u64)
        .map(|i| {
            let (cg_refaults, cg_majflt, proc_majflt) = own(i);
            let mut level = v1(path, 8 * GIB, GIB, GIB, 0, 0);
            level.workingset_refault_file = 500 + cg_refaults;
            level.pgmajfault = 900 + cg_majflt;
            let mut sys = system(0, 12 * GIB);
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
                vm_rss_bytes: 300 * MIB,
                major_faults: 40 + proc_majflt,
                ..Default::default()
            });
            s
        })
        .collect()
}

/// A SIGKILL that moved no OOM counter, after the given samples.
fn killed(samples: Vec<pb::Sample>) -> Evidence {
    let level = samples.last().unwrap().cgroup.clone();
    let before = counters(T0, level.clone(), system(7, 12 * GIB));
    let after = counters(T0 + 60 * SEC, level, system(7, 12 * GIB));
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    e.samples = samples;
    e
}

#[test]
fn a_sigkill_under_other_jobs_pressure_is_external_kill_with_the_pressure_as_context() {
    let e = killed(host_thrash(OWN, |i| (10 * i, 2 * i, 3 * i)));
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("external_kill"),
        "{:#?}",
        d.evidence
    );
    assert!(
        d.causes.iter().all(|c| c.kind != "swap_thrash"),
        "{:#?}",
        d.causes
    );
    has(
        &d.evidence,
        "neighbour_pressure: the host thrashed (system refaults +60000 pages over 60.0 s",
    );
    has(
        &d.evidence,
        "system PSI some avg10 20.00%, stall 20.0% of the window",
    );
    has(&d.evidence, "major faults +18 (threshold 1024), its cgroup's refaults +60 (threshold 4096) and pgmajfault +12");
}

#[test]
fn the_same_kill_with_the_process_faulting_its_own_pages_back_is_thrash() {
    // The process itself read 30,000 pages back: the pressure was its own.
    let e = killed(host_thrash(OWN, |i| (10 * i, 5_000 * i, 5_000 * i)));
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("swap_thrash"),
        "{:#?}",
        d.evidence
    );
    has(
        &d.evidence,
        &format!("major faults +30000 (threshold {OWN_MIN_MAJOR_FAULTS})"),
    );
    assert!(d
        .evidence
        .iter()
        .all(|l| !l.starts_with("neighbour_pressure")));
}

#[test]
fn its_cgroups_refaults_alone_make_the_pressure_its_own() {
    let e = killed(host_thrash(OWN, |i| (9_000 * i, 0, 0)));
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("swap_thrash"),
        "{:#?}",
        d.evidence
    );
    has(&d.evidence, "its cgroup's refaults +54000");
}

#[test]
fn the_root_cgroups_refaults_are_the_hosts_not_the_process() {
    // A process outside any container: its "own" cgroup is the root, whose
    // counters are the host's. Nothing died: no incident, the context said.
    let mut e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples: host_thrash("/", |i| (10_000 * i, 8_000 * i, 0)),
        events: vec![],
        incident: None,
    };
    let d = diagnose(&e);
    assert_eq!(d.domain, None, "{:#?}", d.evidence);
    has(&d.evidence, "neighbour_pressure: the host thrashed");
    // Its own faults moving makes it its own.
    e.samples = host_thrash("/", |i| (10_000 * i, 8_000 * i, 4_000 * i));
    assert_eq!(diagnose(&e).domain.as_deref(), Some("swap_thrash"));
}

/// A SIGKILL while another process's OOM kill moved the host-wide counter.
fn killed_on_a_busy_host(kernel_log: Option<&str>) -> Evidence {
    let level = vec![v1(OWN, 8 * GIB, GIB, GIB, 0, 0)];
    let before = counters(T0, level.clone(), system(79, 12 * GIB));
    let after = counters(T0 + 6 * SEC, level, system(81, 12 * GIB));
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    if let Some(l) = kernel_log {
        e.hello
            .as_mut()
            .unwrap()
            .labels
            .insert("kernel_log".into(), l.into());
    }
    e
}

#[test]
fn a_sigkill_on_a_busy_host_with_the_kernel_log_silent_about_it_is_external_kill() {
    let d = diagnose(&killed_on_a_busy_host(Some("readable")));
    assert_eq!(
        d.domain.as_deref(),
        Some("external_kill"),
        "{:#?}",
        d.evidence
    );
    has(&d.evidence, "/proc/vmstat oom_kill 79 -> 81, but the kernel's log, read throughout, records no OOM kill of this instance");
    // Without the kernel's log the host-wide counter cannot be told apart.
    let d = diagnose(&killed_on_a_busy_host(Some("unreadable: EPERM")));
    assert_eq!(d.domain.as_deref(), Some("unknown"), "{:#?}", d.evidence);
    let d = diagnose(&killed_on_a_busy_host(None));
    assert_eq!(d.domain.as_deref(), Some("unknown"), "{:#?}", d.evidence);
}
