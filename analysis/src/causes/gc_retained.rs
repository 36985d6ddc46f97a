//! Garbage awaiting the cycle collector: live bytes climb between requests and
//! fall back when a collection runs. Not a leak: the objects are unreachable,
//! only not yet collected (reference cycles wait for a full collection).
//!
//! Without a device allocator the heap census shows it: a retained type
//! grows between censuses, and the first census after a full collection
//! finds it gone.

use super::cause;
use crate::census::{self, HeapReclaim, HeapVerdict};
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth::{self, RECLAIMED_SHARE};
use crate::pb;
use crate::units::bytes_short;
use oomscope_proto::CauseKind;

/// Live bytes around the first collection.
pub struct Reclaim {
    /// Gained between the first between-request reading and the collection.
    pub growth: f64,
    /// Freed by the collection.
    pub reclaimed: f64,
    pub before: u64,
    pub after: u64,
    pub bytes_per_request: f64,
    pub requests: f64,
}

impl Reclaim {
    pub fn gave_back_growth(&self) -> bool {
        self.growth >= growth::MIN_LEAK_GROWTH_BYTES
            && self.reclaimed >= RECLAIMED_SHARE * self.growth
    }
}

pub fn reclaim(f: &Findings) -> Option<Reclaim> {
    let at = growth::first_collection(&f.timeline)?;
    let trend = growth::live_baseline(&f.timeline).filter(|t| t.leaks())?;
    let before = f
        .timeline
        .device()
        .filter(|p| p.time_ns < at && p.is_baseline())
        .last()?;
    let after = f
        .timeline
        .device()
        .find(|p| p.time_ns >= at && !p.in_request())?;
    Some(Reclaim {
        growth: trend.last_bytes - trend.first_bytes,
        reclaimed: before.allocated as f64 - after.allocated as f64,
        before: before.allocated,
        after: after.allocated,
        bytes_per_request: trend.bytes_per_request(),
        requests: trend.span,
    })
}

pub fn gc_retained(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    if f.timeline.device().next().is_some() {
        return device_gc_retained(f);
    }
    match census::verdict(f)? {
        HeapVerdict::Retained(r) => Some(heap_gc_retained(&r)),
        HeapVerdict::Growing(_) => None,
    }
}

/// From the heap censuses around a full collection.
fn heap_gc_retained(r: &HeapReclaim) -> pb::Cause {
    let g = &r.growth;
    let mut evidence = vec![g.growth_line(), g.significance_line(), g.objects_line()];
    evidence.extend(g.chain_line());
    evidence.push(format!(
        "a full garbage collection (generation 2, {} objects collected) then dropped {} from {} to {} at the next census: the growth was unreachable objects (reference cycles) awaiting the collector",
        r.collected,
        g.top.name,
        bytes_short(r.before_bytes),
        bytes_short(r.after_bytes)
    ));
    evidence.push(
        "not a leak: break the cycles, or collect between requests, so the garbage does not pile up to the limit"
            .to_string(),
    );
    let metrics = [
        ("bytes_per_request", g.top.bytes_per_request().round()),
        ("reclaimed_bytes", r.freed().max(0.0)),
        ("growth_bytes", r.gained()),
        ("collected_objects", r.collected as f64),
    ];
    cause(CauseKind::GcRetained, 0.85, evidence, &metrics)
}

/// From the device allocator's live bytes around the first collection.
fn device_gc_retained(f: &Findings) -> Option<pb::Cause> {
    let r = reclaim(f).filter(Reclaim::gave_back_growth)?;
    let evidence = vec![
        format!(
            "between requests live bytes grew {} per request over {} requests",
            bytes_short(r.bytes_per_request.round() as u64),
            r.requests
        ),
        format!(
            "a garbage collection then dropped them from {} to {}: the growth was unreachable objects (reference cycles) awaiting the collector",
            bytes_short(r.before),
            bytes_short(r.after)
        ),
        "not a leak: break the cycles, or collect between requests, so the garbage does not pile up to the limit"
            .to_string(),
    ];
    let metrics = [
        ("bytes_per_request", r.bytes_per_request.round()),
        ("reclaimed_bytes", r.reclaimed.max(0.0)),
        ("growth_bytes", r.growth),
    ];
    Some(cause(CauseKind::GcRetained, 0.85, evidence, &metrics))
}
