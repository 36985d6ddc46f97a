//! Growth against time for a process with no request marks (a C++ runtime or
//! any non-Python server under `oomscope run`): the supervisor's periodic
//! readings of the child (RSS, the tree's PSS, its v1 cgroup, /proc/meminfo)
//! and nothing that counts requests.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const OWN: &str = "/oomtest/child";
const MS: i64 = 1_000_000;
/// The supervisor's default sampling interval.
const INTERVAL_MS: i64 = 250;

/// What the cgroup charges beyond the child's RSS (page cache, kernel memory).
const CGROUP_OVER_RSS: u64 = 8 * MIB;

/// A few pages of allocator noise, deterministic.
fn jitter(i: i64) -> u64 {
    ((i * 7919) % 17) as u64 * 4096
}

/// One periodic reading at `t_s` seconds: RSS, tree PSS, the own cgroup
/// (limit `limit`, usage RSS + 8 MiB) and the host.
fn reading(i: i64, rss: u64, pss: u64, limit: Option<u64>) -> pb::Sample {
    let t = T0 + i * INTERVAL_MS * MS;
    let rss = rss + jitter(i);
    let usage = rss + CGROUP_OVER_RSS;
    pb::Sample {
        process: Some(pb::ProcessMemory {
            pid: CHILD_PID,
            vm_rss_bytes: rss,
            ..Default::default()
        }),
        tree_pss_bytes: pss + jitter(i + 3),
        ..sample(
            t,
            limit.map_or_else(Vec::new, |l| vec![v1(OWN, l, usage, usage, 0, 0)]),
            system(10, 12 * GIB),
        )
    }
}

/// A supervised child started at T0, read every 250 ms for `secs` seconds:
/// its RSS (and PSS) at `t` seconds is `rss(t)`.
fn run_of(secs: f64, limit: Option<u64>, rss: impl Fn(f64) -> u64) -> Evidence {
    let n = (secs * 1000.0 / INTERVAL_MS as f64) as i64;
    let samples = (0..=n)
        .map(|i| {
            let b = rss(i as f64 * INTERVAL_MS as f64 / 1000.0);
            reading(i, b, b, limit)
        })
        .collect();
    Evidence {
        hello: Some(hello()),
        samples,
        events: vec![pb::Event {
            time_ns: T0,
            kind: Some(Kind::ChildStart(pb::ChildStart {
                pid: CHILD_PID,
                command: vec!["./server".into()],
                ..Default::default()
            })),
        }],
        ..Default::default()
    }
}

fn last_usage(e: &Evidence) -> u64 {
    e.samples.last().unwrap().cgroup[0].usage_bytes
}

fn host_growth(d: &pb::Diagnosis) -> &pb::Cause {
    d.causes
        .iter()
        .find(|c| c.kind == "host_growth")
        .unwrap_or_else(|| panic!("no host_growth: {:?} {:?}", d.causes, d.evidence))
}

fn close(got: f64, want: f64, share: f64) -> bool {
    (got - want).abs() <= share * want.abs()
}

#[test]
fn steady_growth_without_requests_is_host_growth_with_a_runway_in_time() {
    // 20 MiB at the start, 10 MiB/s, 300 MiB limit, read at 8 s.
    let rate = 10.0 * MIB as f64;
    let e = run_of(8.0, Some(300 * MIB), |t| 20 * MIB + (rate * t) as u64);
    let d = diagnose(&e);
    assert!(d.domain.is_none(), "nothing failed yet");
    let c = host_growth(&d);
    let bps = c.metrics["bytes_per_second"];
    assert!(close(bps, rate, 0.02), "bytes_per_second {bps}");
    // The runway: what the cgroup has left at the newest reading, at the fitted rate.
    let left = (300 * MIB - last_usage(&e)) as f64;
    let secs = c.metrics["seconds_to_limit"];
    assert!(close(secs, left / rate, 0.03), "seconds_to_limit {secs}");
    assert!((secs - 19.2).abs() < 0.3, "about 19 s left: {secs}");
    assert_eq!(c.metrics["limit_bytes"], (300 * MIB) as f64);
    assert!(!c.metrics.contains_key("bytes_per_request"));
    // A life of 8 s: its first third (2.7 s) is warm-up, not its first 30 s.
    let fitted = c.metrics["fitted_seconds"];
    assert!((fitted - 8.0 * 2.0 / 3.0).abs() < 0.3, "fitted {fitted}");
    assert!(
        c.evidence[0].starts_with(
            "runway: at 10.0 MiB/s, the 300.0 MiB of the cgroup limit (192.0 MiB left) is gone in about 19 seconds"
        ),
        "{:?}",
        c.evidence
    );
    assert!(c.evidence[1].starts_with("without request marks, host RSS rose from"));
    assert!(c.evidence[2].starts_with("the first 2.7 s of the process's life are left out"));
    // No Python heap to census: the first fix says how to find a native growth.
    assert!(
        d.fixes[0].action.contains("allocator's heap profile")
            && d.fixes[0].retest.contains("over time"),
        "{:?}",
        d.fixes
    );
    // Before the failure the runway leads the verdict's own lines.
    assert_eq!(d.evidence[0], c.evidence[0]);
    // The trigger agrees with the cause.
    assert_eq!(d.trigger.as_deref(), Some("growth_over_time"));
    assert!(
        d.evidence.iter().any(|l| l.starts_with(
            "trigger growth_over_time: with no request marks, host RSS grew 10.0 MiB/s over 5."
        )),
        "{:?}",
        d.evidence
    );
}

#[test]
fn a_flat_process_has_no_growth_and_no_trigger() {
    let d = diagnose(&run_of(120.0, Some(300 * MIB), |_| 80 * MIB));
    assert!(d.causes.is_empty(), "{:?}", d.causes);
    assert_eq!(d.trigger, None);
}

#[test]
fn warm_up_that_levels_off_is_not_growth() {
    // 2 MiB/s over its first 20 s (inside the 30 s left out), then flat.
    let warm = |until: f64| move |t: f64| 20 * MIB + (2.0 * MIB as f64 * t.min(until)) as u64;
    let d = diagnose(&run_of(120.0, Some(300 * MIB), warm(20.0)));
    assert!(d.causes.is_empty(), "{:?}", d.causes);
    assert_eq!(d.trigger, None);
    // A warm-up past the 30 s (to 45 s) is turned away by the persistence
    // test: the later half of the window is flat.
    let d = diagnose(&run_of(150.0, Some(300 * MIB), warm(45.0)));
    assert!(d.causes.is_empty(), "{:?}", d.causes);
    assert_eq!(d.trigger, None);
    // While it still grows it is growth: the verdict is of the moment.
    let d = diagnose(&run_of(40.0, Some(300 * MIB), warm(45.0)));
    let bps = host_growth(&d).metrics["bytes_per_second"];
    assert!(close(bps, 2.0 * MIB as f64, 0.05), "{bps}");
}

#[test]
fn growth_inside_a_load_phase_only_is_not_growth() {
    // Flat for a minute, then a load phase (weights read in) that grows
    // 3 MiB/s for 30 s; read at its end.
    let rss = |t: f64| 40 * MIB + (3.0 * MIB as f64 * (t - 60.0).max(0.0)) as u64;
    let mut e = run_of(90.0, Some(1 << 30), rss);
    let load_from = T0 + 60 * SEC;
    // The same readings without the phase are growth: the phase is what
    // keeps them out.
    assert!(diagnose(&e).causes.iter().any(|c| c.kind == "host_growth"));
    for s in e.samples.iter_mut().filter(|s| s.time_ns > load_from) {
        s.context = Some(pb::RequestContext {
            phase: "load".into(),
            ..Default::default()
        });
    }
    let d = diagnose(&e);
    assert!(d.causes.is_empty(), "{:?}", d.causes);
    assert_eq!(d.trigger, None);
}

/// The kernel's kill in the 300 MiB cgroup, 100 ms after the newest reading.
fn killed_at_the_limit(e: &mut Evidence) {
    let dead = e.samples.last().unwrap().time_ns + 100 * MS;
    let levels = |usage, failcnt, kills| vec![v1(OWN, 300 * MIB, usage, usage, failcnt, kills)];
    e.events.push(pb::Event {
        time_ns: dead,
        kind: Some(Kind::ChildExit(pb::ChildExit {
            pid: CHILD_PID,
            signal: Some(9),
            before: Some(counters(T0, levels(MIB, 0, 0), system(10, 12 * GIB))),
            after: Some(counters(
                dead,
                levels(300 * MIB - 4096, 940, 1),
                system(11, 12 * GIB),
            )),
            runtime_ns: (dead - T0) as u64,
            ..Default::default()
        })),
    });
    e.incident = incident("signal", dead);
}

#[test]
fn a_kill_after_a_small_growth_is_immediate_not_growth_over_time() {
    // 1 MiB/s for 9 s, then one allocation the 300 MiB limit refuses: the
    // growth (6 MiB in the window) stands, but did not set the kill off.
    let mut e = run_of(9.0, Some(300 * MIB), |t| 20 * MIB + (MIB as f64 * t) as u64);
    killed_at_the_limit(&mut e);
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:?}", d.evidence);
    assert_eq!(d.trigger.as_deref(), Some("immediate"), "{:?}", d.evidence);
    assert!(close(
        host_growth(&d).metrics["bytes_per_second"],
        MIB as f64,
        0.05
    ));
}

#[test]
fn after_a_cgroup_kill_the_trigger_is_growth_over_time() {
    // 30 MiB/s from 20 MiB in a 300 MiB cgroup: the kernel kills it at 9 s.
    let rate = 30.0 * MIB as f64;
    let mut e = run_of(9.0, Some(300 * MIB), |t| 20 * MIB + (rate * t) as u64);
    killed_at_the_limit(&mut e);
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:?}", d.evidence);
    assert_eq!(d.trigger.as_deref(), Some("growth_over_time"));
    assert!(
        d.evidence.iter().any(|l| l.starts_with(
            "trigger growth_over_time: with no request marks, host RSS grew 30.0 MiB/s"
        )),
        "{:?}",
        d.evidence
    );
    let c = host_growth(&d);
    let bps = c.metrics["bytes_per_second"];
    assert!(close(bps, rate, 0.02), "bytes_per_second {bps}");
    assert_eq!(c.confidence, 0.7);
}

#[test]
fn with_request_marks_the_growth_is_per_request_never_both() {
    // The same growth, with a request every second marked by boundaries.
    let marked = |requests: i64| {
        let mut e = run_of(40.0, Some(1 << 30), |t| {
            20 * MIB + (10.0 * MIB as f64 * t) as u64
        });
        for k in 1..=requests {
            for (dt, start) in [(0, true), (100 * MS, false)] {
                e.events.push(pb::Event {
                    time_ns: T0 + k * SEC + 10 * MS + dt,
                    kind: Some(Kind::Request(pb::RequestBoundary {
                        request_id: format!("r{k}"),
                        start,
                        ..Default::default()
                    })),
                });
            }
        }
        e
    };
    let d = diagnose(&marked(39));
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
    let c = host_growth(&d);
    assert!(
        c.metrics.contains_key("bytes_per_request"),
        "{:?}",
        c.metrics
    );
    assert!(
        !c.metrics.contains_key("bytes_per_second"),
        "{:?}",
        c.metrics
    );
    // Too few requests to fit against: marked, so not read against time either.
    let d = diagnose(&marked(3));
    assert_ne!(d.trigger.as_deref(), Some("growth_over_time"));
    assert!(
        d.causes
            .iter()
            .all(|c| !c.metrics.contains_key("bytes_per_second")),
        "{:?}",
        d.causes
    );
}

#[test]
fn without_a_cgroup_limit_memavailable_or_the_commit_limit_bounds_it() {
    // 40 MiB/s, no cgroup; 12 GiB available on a 16 GiB host.
    let rate = 40.0 * MIB as f64;
    let mut e = run_of(60.0, None, |t| GIB + (rate * t) as u64);
    let c = host_growth(&diagnose(&e)).clone();
    assert_eq!(c.metrics["limit_bytes"], (16 * GIB) as f64);
    let secs = c.metrics["seconds_to_limit"];
    assert!(close(secs, (12 * GIB) as f64 / rate, 0.03), "{secs}");
    assert!(
        c.evidence[0].contains("of MemTotal (12.0 GiB left)"),
        "{:?}",
        c.evidence
    );
    assert!(!c.metrics.contains_key("measured_on_cgroup_usage"));
    // Strict overcommit: 10 GiB CommitLimit with 5 GiB committed bounds it first.
    let last = e.samples.last_mut().unwrap().system.as_mut().unwrap();
    last.overcommit_mode = 2;
    let c = host_growth(&diagnose(&e)).clone();
    assert_eq!(c.metrics["limit_bytes"], (10 * GIB) as f64);
    let secs = c.metrics["seconds_to_limit"];
    assert!(close(secs, (5 * GIB) as f64 / rate, 0.03), "{secs}");
    assert!(c.evidence[0].contains("of CommitLimit"), "{:?}", c.evidence);
}

#[test]
fn a_tree_that_grows_in_its_children_grows_in_pss() {
    // The child's own RSS is flat; the tree's PSS (its workers) grows 5 MiB/s.
    let mut e = run_of(60.0, Some(2 << 30), |_| 100 * MIB);
    for (i, s) in e.samples.iter_mut().enumerate() {
        s.tree_pss_bytes = 100 * MIB + (5.0 * MIB as f64 * i as f64 * 0.25) as u64;
        // The cgroup holds the tree.
        s.cgroup[0].usage_bytes = s.tree_pss_bytes + CGROUP_OVER_RSS;
    }
    let d = diagnose(&e);
    let c = host_growth(&d);
    assert!(
        c.evidence[1].starts_with("without request marks, the process tree's PSS rose"),
        "{:?}",
        c.evidence
    );
    assert!(close(c.metrics["bytes_per_second"], 5.0 * MIB as f64, 0.02));
    assert_eq!(d.trigger.as_deref(), Some("growth_over_time"));
}

#[test]
fn host_growth_over_time_does_not_trigger_a_device_oom() {
    // A CUDA OOM at 9 s, while the host RSS grew 10 MiB/s with no request marks.
    let mut e = run_of(9.0, None, |t| 20 * MIB + (10.0 * MIB as f64 * t) as u64);
    let oom_at = T0 + 9 * SEC + 50 * MS;
    e.events.push(pb::Event {
        time_ns: oom_at,
        kind: Some(Kind::Oom(pb::Oom {
            device: 0,
            requested_bytes: 2 * GIB,
            error_type: "OutOfMemoryError".into(),
            error_text: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.33 GiB is free.".into(),
            ..Default::default()
        })),
    });
    e.incident = incident("oom", oom_at);
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"), "{:?}", d.evidence);
    assert_ne!(d.trigger.as_deref(), Some("growth_over_time"));
    // The host's growth is still a finding of its own.
    assert!(close(
        host_growth(&d).metrics["bytes_per_second"],
        10.0 * MIB as f64,
        0.02
    ));
}

#[test]
fn growth_whose_limit_lasts_months_is_slow_growth() {
    // 3 KiB/s for 40 minutes, no cgroup: 12 GiB available lasts about 49 days.
    let rate = 3.0 * 1024.0;
    let e = run_of(2400.0, None, |t| GIB + (rate * t) as u64);
    let d = diagnose(&e);
    let kinds: Vec<&str> = d.causes.iter().map(|c| c.kind.as_str()).collect();
    assert_eq!(kinds, ["slow_growth"], "{:?}", d.causes);
    let c = &d.causes[0];
    assert!(
        close(c.metrics["bytes_per_second"], rate, 0.05),
        "{:?}",
        c.metrics
    );
    let secs = c.metrics["seconds_to_limit"];
    assert!(close(secs, (12 * GIB) as f64 / rate, 0.05), "{secs}");
    assert!(
        c.evidence[0].contains("is gone in about 7 weeks"),
        "{:?}",
        c.evidence
    );
    assert!(
        d.fixes[0]
            .action
            .starts_with("Nothing urgent: the limit lasts about 7 weeks"),
        "{:?}",
        d.fixes
    );
    // Slow growth sets nothing off.
    assert_eq!(d.trigger, None);
    // Ten times faster (about 5 days) it is still slow growth: days are not
    // urgent (runway::URGENT_RUNWAY_S) ...
    let e = run_of(2400.0, None, |t| GIB + (10.0 * rate * t) as u64);
    let kinds: Vec<String> = diagnose(&e).causes.into_iter().map(|c| c.kind).collect();
    assert_eq!(kinds, ["slow_growth"]);
    // ... a hundred times faster (about 12 hours) it is host growth.
    let e = run_of(2400.0, None, |t| GIB + (100.0 * rate * t) as u64);
    let c = host_growth(&diagnose(&e)).clone();
    assert!(close(c.metrics["bytes_per_second"], 100.0 * rate, 0.05));
    let hours = c.metrics["seconds_to_limit"] / 3_600.0;
    assert!((10.0..13.0).contains(&hours), "{hours} h");
}
