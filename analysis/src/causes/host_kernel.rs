//! Host causes that the kernel's record tells apart from plain exhaustion:
//! a NUMA binding (`numa_binding`), a high-order allocation on fragmented
//! memory (`host_fragmentation`); and cgroup v2's memory.high throttling
//! (`memory_high_throttling`), a slowdown that warns of an OOM to come.

use super::cause;
use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::kernel_constraints::{high_order, numa_binding};
use crate::memory_high::high_throttle;
use crate::pb;
use oomscope_proto::CauseKind;

/// A kill confined to some NUMA nodes: those nodes ran out, whatever the
/// host had free elsewhere.
pub fn numa_binding_cause(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::HostRam {
        return None;
    }
    let b = numa_binding(f)?;
    let mut metrics = vec![
        ("allowed_nodes", b.nodes.len() as f64),
        ("allowed_mem_total_bytes", b.allowed_total() as f64),
        ("allowed_mem_free_bytes", b.allowed_free() as f64),
        ("other_nodes_mem_free_bytes", b.others_free() as f64),
    ];
    if let Some(free) = b.free_at_kill {
        metrics.push(("allowed_free_at_kill_bytes", free as f64));
    }
    if let Some(first) = b.nodes.first() {
        metrics.push(("first_allowed_node", *first as f64));
    }
    // The kernel named the constraint; only the node figures may be missing.
    let confidence = if b.nodes.is_empty() { 0.8 } else { 0.95 };
    Some(cause(
        CauseKind::NumaBinding,
        confidence,
        b.evidence(),
        &metrics,
    ))
}

/// A high-order allocation that failed with memory free: the blocks were
/// too small, not the memory too little.
pub fn host_fragmentation(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::HostRam {
        return None;
    }
    let h = high_order(f).filter(|h| h.fragmented)?;
    let mut metrics = vec![
        ("order", h.order as f64),
        ("request_bytes", h.request_bytes(4096) as f64),
    ];
    if let (Some(free), Some(high)) = (h.free_bytes, h.high_bytes) {
        metrics.push(("free_bytes", free as f64));
        metrics.push(("high_watermark_bytes", high as f64));
    }
    if let Some(b) = h.free_at_order_bytes {
        metrics.push(("free_at_order_bytes", b as f64));
    }
    if let Some((avail, total, _)) = &h.available {
        metrics.push(("mem_available_bytes", *avail as f64));
        metrics.push(("mem_total_bytes", *total as f64));
    }
    // The zone lists are the kernel's own figures at the failure; a
    // MemAvailable reading is from before it.
    let confidence = if h.free_bytes.is_some() { 0.9 } else { 0.7 };
    Some(cause(
        CauseKind::HostFragmentation,
        confidence,
        h.evidence(),
        &metrics,
    ))
}

/// memory.high throttling: a slowdown on its own, and the warning before an
/// OOM at memory.max (then it ranks below the limit that killed).
pub fn memory_high_throttling(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let t = high_throttle(f)?;
    let oom_followed = v.failed && (f.kernel.is_some() || f.memcg.is_some());
    let confidence = match (t.slowed, oom_followed) {
        // An OOM followed: the throttling warned of it.
        (_, true) => 0.5,
        (true, false) => 0.8,
        (false, false) => 0.3,
    };
    let metrics = [
        ("events_high", t.events() as f64),
        ("high_bytes", t.high_bytes as f64),
        ("max_bytes", t.max_bytes as f64),
        ("usage_bytes", t.usage_bytes as f64),
        ("peak_bytes", t.peak_bytes as f64),
        ("stall_s", t.stall_us.unwrap_or(0) as f64 / 1e6),
        ("stall_share", t.stall_share()),
        ("window_s", t.window_ns as f64 / 1e9),
    ];
    Some(cause(
        CauseKind::MemoryHighThrottling,
        confidence,
        t.evidence(),
        &metrics,
    ))
}

/// True where a host-RAM kill has a more specific cause than "the machine
/// ran out": host_ram_exhausted then stays silent (its fixes add RAM).
pub fn more_specific_than_exhaustion(f: &Findings) -> bool {
    numa_binding(f).is_some() || high_order(f).is_some_and(|h| h.fragmented)
}
