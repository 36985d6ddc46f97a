//! Host domains the kernel's record tells apart, fed from the fixtures
//! through the agent's real parsers: a NUMA-bound kill (`numa_binding`,
//! never "more RAM"), a high-order failure with memory free
//! (`host_fragmentation`), cgroup v2 memory.high throttling
//! (`memory_high_throttling`, a slowdown) and memory.oom.group taking the
//! whole group. The records and v2 files are constructed from the kernel's
//! formats (tests/fixtures/kmsg/construct.py, host-v2/construct_v2.py).

mod common;

use std::fs;
use std::path::Path;

use common::*;
use oomscope_agent_core::readers::cgroup::{read_level, Version};
use oomscope_agent_core::readers::kmsg::{parse_alloc_failures, parse_kills};
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};
use serde_json::Value;

const KIB: u64 = 1024;

fn kmsg(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/kmsg")
        .join(name);
    fs::read_to_string(p).unwrap()
}

fn v2_fixture(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/host-v2")
        .join(name);
    serde_json::from_str(&fs::read_to_string(p).unwrap()).unwrap()
}

/// One reading of the fixture's cgroup, through the agent's level reader.
fn v2_level(fx: &Value, i: usize) -> pb::CgroupLevel {
    let tmp = tempfile::tempdir().unwrap();
    for (name, text) in fx["readings"][i]["files"].as_object().unwrap() {
        fs::write(tmp.path().join(name), text.as_str().unwrap()).unwrap();
    }
    read_level(tmp.path(), fx["own_path"].as_str().unwrap(), Version::V2)
}

fn v2_time(fx: &Value, i: usize) -> i64 {
    T0 + fx["readings"][i]["t_s"].as_i64().unwrap() * SEC
}

fn node(n: u32, total: u64, free: u64) -> pb::NumaNode {
    pb::NumaNode {
        node: n,
        mem_total_bytes: total,
        mem_free_bytes: free,
        ..Default::default()
    }
}

/// A 128 GiB two-node host with 60 GiB available host-wide.
fn big_host() -> pb::SystemMemory {
    pb::SystemMemory {
        mem_total_bytes: 128 * GIB,
        mem_available_bytes: 60 * GIB,
        ..Default::default()
    }
}

/// The main process (the record's victim) killed by SIGKILL at T0+3s, the
/// kernel's record just before, and one sample 1 s before the death.
fn killed(kill: pb::KernelOomKill, nodes: Vec<pb::NumaNode>, sys: pb::SystemMemory) -> Evidence {
    let before = counters(T0, vec![], sys);
    let after = counters(T0 + 3 * SEC, vec![], sys);
    let mut x = exit(None, Some(9), "", before, after, None);
    if let Some(Kind::ChildExit(c)) = x.kind.as_mut() {
        c.pid = kill.pid;
    }
    let mut e = supervised(x, "signal");
    e.events.insert(
        0,
        pb::Event {
            time_ns: T0 + 3 * SEC - 1_000_000,
            kind: Some(Kind::KernelOomKill(kill)),
        },
    );
    let mut s = sample(T0 + 2 * SEC, vec![], sys);
    s.numa_nodes = nodes;
    e.samples.push(s);
    e
}

fn cause<'a>(d: &'a pb::Diagnosis, kind: &str) -> &'a pb::Cause {
    d.causes
        .iter()
        .find(|c| c.kind == kind)
        .unwrap_or_else(|| panic!("no {kind} in {:#?}", d.causes))
}

fn no_more_ram(d: &pb::Diagnosis) {
    for f in &d.fixes {
        assert!(
            !f.action.contains("more RAM") && !f.action.starts_with("More capacity"),
            "{}",
            f.action
        );
    }
    assert!(
        d.causes.iter().all(|c| c.kind != "host_ram_exhausted"),
        "{:#?}",
        d.causes
    );
}

#[test]
fn a_cpuset_bound_kill_is_numa_binding_naming_the_nodes_and_their_memory() {
    let k = parse_kills(&kmsg("numa_cpuset.kmsg")).remove(0);
    let nodes = vec![node(0, 64 * GIB, 90 * MIB), node(1, 64 * GIB, 58 * GIB)];
    let d = diagnose(&killed(k, nodes, big_host()));
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    let c = &d.causes[0];
    assert_eq!(c.kind, "numa_binding", "{:#?}", d.causes);
    assert_eq!(c.metrics["allowed_nodes"], 1.0);
    assert_eq!(c.metrics["first_allowed_node"], 0.0);
    assert_eq!(c.metrics["allowed_mem_total_bytes"], (64 * GIB) as f64);
    assert_eq!(c.metrics["allowed_mem_free_bytes"], (90 * MIB) as f64);
    assert_eq!(c.metrics["other_nodes_mem_free_bytes"], (58 * GIB) as f64);
    // The record's zone lists of node 0: DMA + DMA32 + Normal.
    assert_eq!(
        c.metrics["allowed_free_at_kill_bytes"],
        ((15576 + 848 + 6784) * KIB) as f64
    );
    assert!(c.evidence[0].contains("CONSTRAINT_CPUSET") && c.evidence[0].contains("node(s) 0"));
    assert!(c.evidence[0].contains("cpuset numa0's mems_allowed"));
    assert!(
        c.evidence
            .iter()
            .any(|l| l.contains("not allowed: node 1: MemFree 58.0 GiB")),
        "{:#?}",
        c.evidence
    );
    assert!(
        d.evidence.iter().any(|l| l.contains("NUMA node(s) 0")),
        "{:#?}",
        d.evidence
    );
    no_more_ram(&d);
    assert!(
        d.fixes
            .iter()
            .any(|f| f.action.contains("Widen the binding")),
        "{:#?}",
        d.fixes
    );
    assert!(d
        .fixes
        .iter()
        .any(|f| f.action.contains("Shrink what each bound node must hold")));
    let k = d.kernel_report.as_ref().unwrap();
    assert_eq!(
        (
            k.mems_allowed.as_str(),
            k.nodemask.as_str(),
            k.cpuset.as_str()
        ),
        ("0", "(null)", "numa0")
    );
    assert_eq!(k.order, Some(0));
    let j = to_json(&d);
    assert_eq!(j["kernel_report"]["mems_allowed"], "0");
    assert_eq!(j["kernel_report"]["order"], 0);
}

#[test]
fn a_memory_policy_kill_binds_to_its_nodemask_not_mems_allowed() {
    let k = parse_kills(&kmsg("numa_mempolicy.kmsg")).remove(0);
    let nodes = vec![node(0, 64 * GIB, 50 * GIB), node(1, 64 * GIB, 70 * MIB)];
    let d = diagnose(&killed(k, nodes, big_host()));
    assert_eq!(d.domain.as_deref(), Some("host_ram"));
    let c = &d.causes[0];
    assert_eq!(c.kind, "numa_binding", "{:#?}", d.causes);
    assert_eq!(c.metrics["first_allowed_node"], 1.0);
    assert_eq!(c.metrics["allowed_mem_free_bytes"], (70 * MIB) as f64);
    assert_eq!(c.metrics["other_nodes_mem_free_bytes"], (50 * GIB) as f64);
    assert!(c.evidence[0].contains("the memory policy's nodemask"));
    no_more_ram(&d);
}

#[test]
fn without_per_node_readings_the_binding_still_decides_and_says_what_is_missing() {
    let k = parse_kills(&kmsg("numa_cpuset.kmsg")).remove(0);
    let d = diagnose(&killed(k, vec![], big_host()));
    let c = cause(&d, "numa_binding");
    assert!(c
        .evidence
        .iter()
        .any(|l| l.contains("per-node memory (/sys/devices/system/node) was not read")));
    no_more_ram(&d);
}

/// The high-order kill's record on a 64 GiB host with 20 GiB available.
fn high_order_kill(k: pb::KernelOomKill) -> Evidence {
    let sys = pb::SystemMemory {
        mem_total_bytes: 64 * GIB,
        mem_available_bytes: 20 * GIB,
        ..Default::default()
    };
    killed(k, vec![], sys)
}

#[test]
fn an_order_3_kill_with_memory_free_is_fragmentation_not_exhaustion() {
    let k = parse_kills(&kmsg("high_order_kill.kmsg")).remove(0);
    let d = diagnose(&high_order_kill(k));
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    let c = &d.causes[0];
    assert_eq!(c.kind, "host_fragmentation", "{:#?}", d.causes);
    assert_eq!(c.metrics["order"], 3.0);
    assert_eq!(c.metrics["request_bytes"], (32 * KIB) as f64);
    assert_eq!(c.metrics["free_bytes"], ((18720 + 2449600) * KIB) as f64);
    assert_eq!(
        c.metrics["high_watermark_bytes"],
        ((4164 + 63384) * KIB) as f64
    );
    assert_eq!(c.metrics["free_at_order_bytes"], 0.0);
    assert!(
        c.evidence.iter().any(|l| l.contains("order=3")),
        "{:#?}",
        c.evidence
    );
    no_more_ram(&d);
    let actions: Vec<&str> = d.fixes.iter().map(|f| f.action.as_str()).collect();
    assert!(
        actions.iter().any(|a| a.contains("compact_memory")),
        "{actions:#?}"
    );
    assert!(actions.iter().any(|a| a.contains("vm.min_free_kbytes")));
    assert!(actions.iter().any(|a| a.contains("fewer huge pages")));
    assert_eq!(d.kernel_report.as_ref().unwrap().order, Some(3));
}

#[test]
fn the_same_order_at_exhaustion_is_host_ram_exhausted() {
    // One step away: the same order-3 kill with the zones drained under
    // their high watermarks is memory that ran out, not fragmentation.
    let mut k = parse_kills(&kmsg("high_order_kill.kmsg")).remove(0);
    for z in &mut k.zones {
        z.free_bytes = z.min_bytes;
    }
    let d = diagnose(&high_order_kill(k));
    assert_eq!(d.domain.as_deref(), Some("host_ram"));
    assert_eq!(d.causes[0].kind, "host_ram_exhausted", "{:#?}", d.causes);
    assert!(d.causes.iter().all(|c| c.kind != "host_fragmentation"));
    // And an order-0 kill is never fragmentation, whatever is free.
    let mut k = parse_kills(&kmsg("high_order_kill.kmsg")).remove(0);
    k.order = Some(0);
    let d = diagnose(&high_order_kill(k));
    assert_eq!(d.causes[0].kind, "host_ram_exhausted", "{:#?}", d.causes);
}

#[test]
fn a_page_allocation_failure_of_the_process_that_then_failed_is_fragmentation() {
    let a = parse_alloc_failures(&kmsg("page_alloc_failure.kmsg")).remove(0);
    let before = counters(T0, vec![], system(3, 12 * GIB));
    let after = counters(T0 + 3 * SEC, vec![], system(3, 12 * GIB));
    let mut x = exit(
        Some(1),
        None,
        "OSError: [Errno 12] Cannot allocate memory\n",
        before,
        after,
        None,
    );
    if let Some(Kind::ChildExit(c)) = x.kind.as_mut() {
        c.pid = a.pid;
    }
    let mut e = supervised(x, "signal");
    e.events.insert(
        0,
        pb::Event {
            time_ns: T0 + 2 * SEC,
            kind: Some(Kind::KernelAllocFailure(a)),
        },
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    assert!(d
        .evidence
        .iter()
        .any(|l| l.contains("page allocation failure: order:4")));
    let c = &d.causes[0];
    assert_eq!(c.kind, "host_fragmentation", "{:#?}", d.causes);
    assert_eq!(c.metrics["order"], 4.0);
    assert_eq!(c.metrics["request_bytes"], (64 * KIB) as f64);
    assert_eq!(c.metrics["free_bytes"], ((18720 + 2449600) * KIB) as f64);
    no_more_ram(&d);
    // The same exit without the kernel's warning names no host domain from it.
    let mut e2 = e.clone();
    e2.events
        .retain(|ev| !matches!(ev.kind, Some(Kind::KernelAllocFailure(_))));
    let d2 = diagnose(&e2);
    assert!(d2.causes.iter().all(|c| c.kind != "host_fragmentation"));
}

/// The throttled cgroup's two readings as the first and last sample of a
/// server that has not failed.
fn throttled() -> Evidence {
    let fx = v2_fixture("memory_high_throttled.json");
    let samples = (0..2)
        .map(|i| sample(v2_time(&fx, i), vec![v2_level(&fx, i)], system(0, 12 * GIB)))
        .collect();
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: Vec::new(),
        incident: None,
    }
}

#[test]
fn memory_high_throttling_is_a_cgroup_slowdown_before_any_oom() {
    let d = diagnose(&throttled());
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    let c = &d.causes[0];
    assert_eq!(c.kind, "memory_high_throttling", "{:#?}", d.causes);
    assert_eq!(c.metrics["events_high"], 1843.0);
    assert_eq!(c.metrics["high_bytes"], (6 * GIB) as f64);
    assert_eq!(c.metrics["max_bytes"], (8 * GIB) as f64);
    assert!((c.metrics["stall_s"] - 14.4).abs() < 1e-9);
    assert!((c.metrics["stall_share"] - 0.24).abs() < 1e-9);
    assert!(c.confidence >= 0.8);
    assert!(
        c.evidence[0].contains("memory.events high 0 -> 1843"),
        "{:#?}",
        c.evidence
    );
    assert!(c.evidence[1].contains("the server slowed"));
    let cg = d.cgroup.as_ref().unwrap();
    assert!(cg.owner_level.ends_with("cri-containerd-7a41.scope"));
    assert_eq!(cg.limit_bytes, 8 * GIB);
    assert!(
        d.fixes
            .iter()
            .any(|f| f.action.contains("Raise memory.high")),
        "{:#?}",
        d.fixes
    );
    assert!(d.victim.is_none(), "a slowdown kills nobody");
}

#[test]
fn high_events_without_stall_are_a_warning_not_a_slowdown() {
    let mut e = throttled();
    // The same events, with the stall of the first reading: nothing waited.
    let first = e.samples[0].cgroup[0].pressure;
    e.samples[1].cgroup[0].pressure = first;
    let d = diagnose(&e);
    assert_eq!(d.domain, None, "{:#?}", d.evidence);
    let c = cause(&d, "memory_high_throttling");
    assert!(c.confidence < 0.5);
    assert!(c.evidence[1].contains("too little stall"));
}

/// The group kill: the two v2 readings around the main process's SIGKILL,
/// with or without the kernel's record.
fn group_killed(kernel: bool) -> Evidence {
    let fx = v2_fixture("oom_group_kill.json");
    let before = counters(v2_time(&fx, 0), vec![v2_level(&fx, 0)], system(0, 12 * GIB));
    let after = counters(v2_time(&fx, 1), vec![v2_level(&fx, 1)], system(0, 12 * GIB));
    let mut x = exit(None, Some(9), "", before, after, None);
    x.time_ns = v2_time(&fx, 1);
    if let Some(Kind::ChildExit(c)) = x.kind.as_mut() {
        c.pid = 311;
        c.runtime_ns = 60 * SEC as u64;
    }
    let mut e = supervised(x, "signal");
    if kernel {
        for (i, k) in parse_kills(&kmsg("cgroup_v2_oom_group.kmsg"))
            .into_iter()
            .enumerate()
        {
            e.events.insert(
                i,
                pb::Event {
                    time_ns: v2_time(&fx, 1) - SEC + i as i64 * 1000,
                    kind: Some(Kind::KernelOomKill(k)),
                },
            );
        }
    }
    e
}

#[test]
fn memory_oom_group_is_named_when_the_kernel_killed_the_whole_group() {
    let d = diagnose(&group_killed(true));
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert_eq!(d.causes[0].kind, "cgroup_limit", "{:#?}", d.causes);
    let k = d.kernel_report.as_ref().unwrap();
    assert_eq!(
        (k.pid, k.oom_score_adj),
        (311, 968),
        "the chosen victim, not a group member"
    );
    assert!(
        d.evidence.iter().any(|l| l.contains("memory.oom.group on")
            && l.contains("whole group killed with the victim: 7 (tini), 312 (python3)")),
        "{:#?}",
        d.evidence
    );
    assert!(
        d.evidence
            .iter()
            .any(|l| l.contains("may not swap (memory.swap.max 0)")),
        "{:#?}",
        d.evidence
    );
}

#[test]
fn without_the_kernel_log_the_group_kill_counter_says_it() {
    let d = diagnose(&group_killed(false));
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert!(
        d.evidence
            .iter()
            .any(|l| l.contains("memory.oom.group = 1 on")
                && l.contains("oom_group_kill 0 -> 1, the kernel killed the whole group")),
        "{:#?}",
        d.evidence
    );
}

#[test]
fn swap_max_is_named_only_where_it_bounds_the_hosts_swap() {
    let mut e = group_killed(false);
    if let Some(Kind::ChildExit(x)) = e.events.last_mut().and_then(|ev| ev.kind.as_mut()) {
        x.after
            .as_mut()
            .unwrap()
            .system
            .as_mut()
            .unwrap()
            .swap_total_bytes = 0;
    }
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"));
    assert!(
        d.evidence.iter().all(|l| !l.contains("may not swap")),
        "no swap on the host: nothing to bound, {:#?}",
        d.evidence
    );
}

#[test]
fn throttling_before_a_kill_is_the_warning_under_the_limit_that_killed() {
    // The throttled minute, then the kernel's memcg kill in the same cgroup.
    let fx = v2_fixture("memory_high_throttled.json");
    let before = counters(v2_time(&fx, 0), vec![v2_level(&fx, 0)], system(0, 12 * GIB));
    let after = counters(v2_time(&fx, 1), vec![v2_level(&fx, 1)], system(0, 12 * GIB));
    let mut x = exit(None, Some(9), "", before, after, None);
    x.time_ns = v2_time(&fx, 1);
    if let Some(Kind::ChildExit(c)) = x.kind.as_mut() {
        c.pid = 311;
        c.runtime_ns = 60 * SEC as u64;
    }
    let mut e = supervised(x, "signal");
    let victim = parse_kills(&kmsg("cgroup_v2_oom_group.kmsg")).remove(0);
    e.events.insert(
        0,
        pb::Event {
            time_ns: v2_time(&fx, 1) - SEC,
            kind: Some(Kind::KernelOomKill(victim)),
        },
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert_eq!(d.causes[0].kind, "cgroup_limit", "{:#?}", d.causes);
    let t = cause(&d, "memory_high_throttling");
    assert_eq!(
        t.confidence, 0.5,
        "a warning before the kill, ranked under it"
    );
    assert_eq!(t.metrics["events_high"], 1843.0);
    assert!(
        d.evidence
            .iter()
            .any(|l| l.contains("memory.events high 0 -> 1843")),
        "the cgroup verdict says it was throttled first: {:#?}",
        d.evidence
    );
}

#[test]
fn without_zone_lists_memavailable_before_the_kill_decides_with_less_confidence() {
    let mut k = parse_kills(&kmsg("high_order_kill.kmsg")).remove(0);
    k.zones.clear();
    // 20 GiB of 64 GiB available a second before the kill: memory was free.
    let d = diagnose(&high_order_kill(k.clone()));
    let c = &d.causes[0];
    assert_eq!(c.kind, "host_fragmentation", "{:#?}", d.causes);
    assert_eq!(c.confidence, 0.7);
    assert_eq!(c.metrics["mem_available_bytes"], (20 * GIB) as f64);
    assert!(c
        .evidence
        .iter()
        .any(|l| l.contains("the record has no zone lists")));
    // 2 GiB of 64 GiB (under a tenth): the same order is exhaustion.
    let sys = pb::SystemMemory {
        mem_total_bytes: 64 * GIB,
        mem_available_bytes: 2 * GIB,
        ..Default::default()
    };
    let d = diagnose(&killed(k, vec![], sys));
    assert_eq!(d.causes[0].kind, "host_ram_exhausted", "{:#?}", d.causes);
}

#[test]
fn an_allocation_failure_from_before_the_childs_life_is_not_its_cause() {
    let a = parse_alloc_failures(&kmsg("page_alloc_failure.kmsg")).remove(0);
    let before = counters(T0, vec![], system(3, 12 * GIB));
    let after = counters(T0 + 3 * SEC, vec![], system(3, 12 * GIB));
    let mut x = exit(Some(1), None, "", before, after, None);
    if let Some(Kind::ChildExit(c)) = x.kind.as_mut() {
        c.pid = a.pid;
    }
    let mut e = supervised(x, "signal");
    // An hour before this child started (3 s before its exit).
    e.events.insert(
        0,
        pb::Event {
            time_ns: T0 - 3600 * SEC,
            kind: Some(Kind::KernelAllocFailure(a)),
        },
    );
    let d = diagnose(&e);
    assert_ne!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    assert!(d.causes.iter().all(|c| c.kind != "host_fragmentation"));
}

/// A v2 cgroup whose anonymous pages refault heavily (100k pages over 10 s)
/// with 30% stall, on a host with swap, its own memory.swap.max as given.
fn anon_refaults(swap_max: Option<u64>) -> Evidence {
    let level = |t: i64, refaults: u64, stall_us: u64| {
        let mut l = v2("/svc", 0, GIB, GIB, V2Events::default());
        l.workingset_refault_anon = refaults;
        l.swap_limit_bytes = swap_max;
        l.pressure = Some(pb::Pressure {
            some_avg10: 30.0,
            some_total_us: stall_us,
            ..Default::default()
        });
        sample(T0 + t * SEC, vec![l], system(0, 12 * GIB))
    };
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples: vec![level(0, 0, 0), level(10, 100_000, 3_000_000)],
        events: Vec::new(),
        incident: None,
    }
}

#[test]
fn a_cgroup_that_may_not_swap_does_not_thrash_on_anonymous_refaults() {
    // The host's 2 GiB of swap counts for a cgroup allowed to swap...
    let d = diagnose(&anon_refaults(None));
    assert_eq!(
        d.domain.as_deref(),
        Some("swap_thrash"),
        "{:#?}",
        d.evidence
    );
    // ...not for one at memory.swap.max 0: its anonymous pages cannot be
    // swapped out, so anonymous refaults are not swap-ins of its own.
    let d = diagnose(&anon_refaults(Some(0)));
    assert_eq!(d.domain, None, "{:#?}", d.evidence);
    assert!(d
        .causes
        .iter()
        .all(|c| c.kind != "swap_thrash" || c.confidence < 0.8));
}
