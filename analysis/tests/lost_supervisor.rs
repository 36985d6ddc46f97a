//! A supervisor lost without a goodbye (the kernel took it with its child):
//! its last readings still name a cgroup OOM, with the confidence stated,
//! and v2's memory.oom.group is named when it takes the whole group.

mod common;

use common::*;
use oomscope_analysis::{diagnose, pb, Evidence, SUPERVISOR_CGROUP_LABEL};

const OWN: &str = "/demo";

fn cgroup_limit(d: &pb::Diagnosis) -> &pb::Cause {
    d.causes
        .iter()
        .find(|c| c.kind == "cgroup_limit")
        .unwrap_or_else(|| panic!("no cgroup_limit cause in {:#?}", d.causes))
}

/// The shape seen on this project's CI host: a 512 MiB v1 cgroup, failcnt
/// 691 -> 2088 over the last readings, no oom_kill counted before the
/// supervisor died 4 ms after its child.
fn lost(levels_first: Vec<pb::CgroupLevel>, levels_last: Vec<pb::CgroupLevel>) -> Evidence {
    let mut hello = hello();
    hello.labels.insert(
        SUPERVISOR_CGROUP_LABEL.into(),
        "stayed in /demo, the cgroup it watches (OOMSCOPE_TEST_STAY_IN_CGROUP)".into(),
    );
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello),
        samples: vec![
            sample(T0, levels_first, system(40, 10 * GIB)),
            sample(T0 + 5 * SEC, levels_last, system(40, 10 * GIB)),
        ],
        events: vec![],
        incident: incident("agent_lost", T0 + 6 * SEC),
    }
}

#[test]
fn a_lost_supervisor_whose_cgroup_hit_its_limit_is_a_likely_cgroup_oom() {
    let limit = 512 * MIB;
    let e = lost(
        vec![v1(OWN, limit, 300 * MIB, limit, 691, 0)],
        vec![v1(OWN, limit, limit - 20 * 1024, limit, 2088, 0)],
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    let cg = d.cgroup.as_ref().unwrap();
    assert_eq!((cg.limit_bytes, cg.owner_level.as_str()), (limit, OWN));
    has(
        &d.evidence,
        "memory.failcnt 691 -> 2088 (the nearest level at its limit)",
    );
    has(
        &d.evidence,
        "likely killed by a cgroup OOM (confidence 0.70",
    );
    has(
        &d.evidence,
        "the supervisor stayed in /demo, the cgroup it watches",
    );
    let c = cgroup_limit(&d);
    assert_eq!(c.confidence, 0.7);
    assert_eq!(c.metrics["limit_bytes"], limit as f64);
}

#[test]
fn a_lost_supervisor_far_from_its_limit_stays_unknown() {
    // failcnt rose once, long ago in the window, but the level never got near
    // its limit in these readings' peak: no OOM to claim.
    let limit = 512 * MIB;
    let e = lost(
        vec![v1(OWN, limit, 100 * MIB, 200 * MIB, 3, 0)],
        vec![v1(OWN, limit, 120 * MIB, 200 * MIB, 4, 0)],
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("unknown"), "{:#?}", d.evidence);
}

#[test]
fn a_lost_supervisor_at_its_limit_without_failcnt_moving_stays_unknown() {
    let limit = 512 * MIB;
    let e = lost(
        vec![v1(OWN, limit, limit, limit, 50, 0)],
        vec![v1(OWN, limit, limit, limit, 50, 0)],
    );
    assert_eq!(diagnose(&e).domain.as_deref(), Some("unknown"));
}

#[test]
fn v2_oom_group_is_named_for_a_lost_supervisor() {
    let limit = GIB;
    let level = |usage, max, group: bool| {
        let mut l = v2(
            OWN,
            limit,
            usage,
            limit,
            V2Events {
                max,
                ..Default::default()
            },
        );
        l.oom_group = group;
        l
    };
    let e = lost(
        vec![level(GIB / 2, 10, true)],
        vec![level(GIB - MIB, 900, true)],
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    has(&d.evidence, "memory.events max 10 -> 900");
    has(
        &d.evidence,
        "cgroup /demo memory.oom.group = 1: an OOM kill there takes every task of the group",
    );
    // Without oom.group nothing is said of it.
    let e = lost(
        vec![level(GIB / 2, 10, false)],
        vec![level(GIB - MIB, 900, false)],
    );
    let d = diagnose(&e);
    assert!(d.evidence.iter().all(|l| !l.contains("oom.group")));
}

#[test]
fn v2_oom_group_kill_is_named_when_it_took_the_whole_group() {
    let limit = GIB;
    let quiet = V2Events::default();
    let hit = V2Events {
        max: 40,
        oom: 1,
        oom_kill: 3,
        local_oom: 1,
        local_oom_kill: 3,
    };
    let level = |usage, ev: V2Events, group_kills| {
        let mut l = v2(OWN, limit, usage, limit, ev);
        l.oom_group = true;
        l.events_oom_group_kill = group_kills;
        l
    };
    let before = counters(T0, vec![level(GIB / 2, quiet, 0)], system(0, 10 * GIB));
    let after = counters(T0 + 3 * SEC, vec![level(MIB, hit, 1)], system(3, 10 * GIB));
    let e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    has(
        &d.evidence,
        "memory.oom.group = 1 and memory.events oom_group_kill 0 -> 1: the kernel killed the whole group",
    );
}

#[test]
fn a_launcher_shim_that_ended_cleanly_is_not_the_lost_supervisors_exit() {
    // `python3` as a pyenv shim: a bash member of the tree exits 0 early on;
    // the supervisor is lost later. The loss, not the shim, is the incident.
    let limit = 512 * MIB;
    let mut e = lost(
        vec![v1(OWN, limit, 300 * MIB, limit, 691, 0)],
        vec![v1(OWN, limit, limit - 20 * 1024, limit, 2088, 0)],
    );
    e.events.push(pb::Event {
        time_ns: T0 + SEC,
        kind: Some(pb::event::Kind::ChildExit(pb::ChildExit {
            pid: 4300,
            exit_code: Some(0),
            member: true,
            // Its readings are early: the failcnt had not moved yet.
            before: Some(counters(
                T0,
                vec![v1(OWN, 512 * MIB, 300 * MIB, 512 * MIB, 691, 0)],
                system(40, 10 * GIB),
            )),
            after: Some(counters(
                T0 + SEC,
                vec![v1(OWN, 512 * MIB, 300 * MIB, 512 * MIB, 691, 0)],
                system(40, 10 * GIB),
            )),
            ..Default::default()
        })),
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    has(&d.evidence, "memory.failcnt 691 -> 2088");
}
