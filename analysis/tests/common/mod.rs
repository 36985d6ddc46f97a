//! Builders for evidence shaped like what `oomscope run` and the agents record.
//! Numbers follow real readings: v1 and v2 counter files, /proc/meminfo of a 16 GiB host.
#![allow(dead_code)]

use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{Evidence, IncidentRef};

pub const MIB: u64 = 1024 * 1024;
pub const GIB: u64 = 1024 * MIB;
/// 2026-11-03T10:00:00Z
pub const T0: i64 = 1_793_700_000_000_000_000;
pub const SEC: i64 = 1_000_000_000;
/// What v1 memory.limit_in_bytes reads when no limit is set.
pub const V1_UNLIMITED: u64 = 9_223_372_036_854_771_712;

/// A v1 level: memory.limit_in_bytes, usage, max_usage, failcnt, oom_control oom_kill.
pub fn v1(
    path: &str,
    limit: u64,
    usage: u64,
    peak: u64,
    failcnt: u64,
    oom_kill: u64,
) -> pb::CgroupLevel {
    pb::CgroupLevel {
        path: path.into(),
        version: "v1".into(),
        limit_bytes: limit,
        usage_bytes: usage,
        peak_bytes: peak,
        failcnt,
        oom_control_oom_kill: oom_kill,
        ..Default::default()
    }
}

/// v2 counters of one level: memory.events and memory.events.local.
#[derive(Default, Clone, Copy)]
pub struct V2Events {
    pub max: u64,
    pub oom: u64,
    pub oom_kill: u64,
    pub local_oom: u64,
    pub local_oom_kill: u64,
}

pub fn v2(path: &str, limit: u64, usage: u64, peak: u64, ev: V2Events) -> pb::CgroupLevel {
    pb::CgroupLevel {
        path: path.into(),
        version: "v2".into(),
        limit_bytes: limit,
        usage_bytes: usage,
        peak_bytes: peak,
        events_max: ev.max,
        events_oom: ev.oom,
        events_oom_kill: ev.oom_kill,
        local_oom: ev.local_oom,
        local_oom_kill: ev.local_oom_kill,
        ..Default::default()
    }
}

/// /proc/meminfo + vmstat of a 16 GiB host with 2 GiB swap.
pub fn system(vmstat_oom_kill: u64, mem_available: u64) -> pb::SystemMemory {
    pb::SystemMemory {
        mem_total_bytes: 16 * GIB,
        mem_available_bytes: mem_available,
        commit_limit_bytes: 10 * GIB,
        committed_as_bytes: 5 * GIB,
        swap_total_bytes: 2 * GIB,
        swap_free_bytes: 2 * GIB,
        vmstat_oom_kill,
        shm_total_bytes: 8 * GIB,
        shm_used_bytes: 12 * MIB,
        ..Default::default()
    }
}

pub fn counters(
    time_ns: i64,
    cgroup: Vec<pb::CgroupLevel>,
    system: pb::SystemMemory,
) -> pb::HostCounters {
    pb::HostCounters {
        time_ns,
        cgroup,
        system: Some(system),
    }
}

pub fn process(pid: u32, as_limit: u64, vm_peak: u64, vm_size: u64) -> pb::ProcessMemory {
    pb::ProcessMemory {
        pid,
        vm_rss_bytes: vm_size / 2,
        vm_hwm_bytes: vm_peak / 2,
        vm_size_bytes: vm_size,
        vm_peak_bytes: vm_peak,
        address_space_limit_bytes: as_limit,
        ..Default::default()
    }
}

pub const CHILD_PID: u32 = 4242;

/// A ChildExit 3 s after the start, with the given status and counters.
pub fn exit(
    code: Option<i32>,
    signal: Option<i32>,
    stderr: &str,
    before: pb::HostCounters,
    after: pb::HostCounters,
    proc_: Option<pb::ProcessMemory>,
) -> pb::Event {
    pb::Event {
        time_ns: T0 + 3 * SEC,
        kind: Some(Kind::ChildExit(pb::ChildExit {
            pid: CHILD_PID,
            exit_code: code,
            signal,
            stderr_tail: stderr.into(),
            before: Some(before),
            after: Some(after),
            process: proc_,
            runtime_ns: 3 * SEC as u64,
            ..Default::default()
        })),
    }
}

pub fn hello() -> pb::Hello {
    pb::Hello {
        agent_id: "agent-7f3a".into(),
        name: "oomtest".into(),
        host: "gpu-01".into(),
        pid: 4200,
        role: "supervisor".into(),
        runtime: "supervisor".into(),
        ..Default::default()
    }
}

pub fn incident(kind: &str, time_ns: i64) -> Option<IncidentRef> {
    Some(IncidentRef {
        id: "inc-1".into(),
        kind: kind.into(),
        time_ns,
        agent: "agent-7f3a".into(),
    })
}

/// Evidence of one supervised child that ended with `event`.
pub fn supervised(event: pb::Event, kind: &str) -> Evidence {
    let t = event.time_ns;
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples: vec![],
        events: vec![event],
        incident: incident(kind, t),
    }
}

pub fn sample(time_ns: i64, cgroup: Vec<pb::CgroupLevel>, system: pb::SystemMemory) -> pb::Sample {
    pb::Sample {
        time_ns,
        cgroup,
        system: Some(system),
        ..Default::default()
    }
}

/// Some line of `lines` contains `needle` (the failure lists them all).
pub fn has(lines: &[String], needle: &str) {
    assert!(
        lines.iter().any(|l| l.contains(needle)),
        "no line contains {needle:?} in {lines:#?}"
    );
}

/// The cause of `kind`; its absence fails with the causes found.
pub fn cause<'a>(d: &'a pb::Diagnosis, kind: &str) -> &'a pb::Cause {
    d.causes
        .iter()
        .find(|c| c.kind == kind)
        .unwrap_or_else(|| panic!("no {kind} cause in {:#?}", d.causes))
}

/// A cause's metric; its absence fails with the metrics found.
pub fn metric(c: &pb::Cause, name: &str) -> f64 {
    *c.metrics
        .get(name)
        .unwrap_or_else(|| panic!("no metric {name} in {:?}", c.metrics))
}

/// What `diagnose --json` prints and Python's `oomscope.query.diagnose`
/// gives: the Diagnosis message's serde form.
pub fn to_json(d: &pb::Diagnosis) -> serde_json::Value {
    serde_json::to_value(d).unwrap()
}
