//! Fragmentation: at the OOM the allocator held enough free bytes for the
//! request, but not in one piece.
//!
//! The test is reserved − allocated ≥ the request. A largest free block (from
//! the snapshot) smaller than the request confirms the split, but alone it
//! proves nothing: it holds at every OOM the cache could not serve. Under
//! expandable segments inactive_split is not counted, so the verdict rests on
//! reserved − allocated and the snapshot.
//!
//! Free space in private pools (a CUDA graph's, a MemPool's) is held for its
//! owner and is not counted: it could never have served the request. Under
//! `backend:cudaMallocAsync` the driver's pool keeps no segment, split or
//! retry counters (memory_stats reads 0 for them): they are unknown, so
//! nothing is concluded from them and the metrics leave them out.

use super::cause;
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::pb;
use crate::units::bytes_short;
use oomscope_proto::CauseKind;

/// Confidence before the evidence is weighed; the share of the limit tied up
/// in free-but-unusable bytes adds to it.
const BASE_CONFIDENCE: f64 = 0.35;
const MAX_CONFIDENCE: f64 = 0.9;
/// Each corroborating sign (split largest block, retries, inactive split) adds this.
const CORROBORATION: f64 = 0.05;

pub fn fragmentation(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let x = f.failure.as_ref()?;
    let request = x.requested_bytes;
    let private = x
        .private_pool_free_bytes
        .min(x.reserved_unallocated_bytes());
    let free = x.reserved_unallocated_bytes() - private;
    if request == 0 || free < request {
        return None;
    }
    let held_by = if x.cuda_malloc_async {
        "the cudaMallocAsync pool held"
    } else {
        "was reserved but unallocated"
    };
    let mut evidence = vec![format!(
        "at the OOM {} {held_by} ({} reserved, {} allocated{}), more than the {} request",
        bytes_short(free),
        bytes_short(x.reserved_bytes),
        bytes_short(x.allocated_bytes),
        if private > 0 {
            format!(", {} free in private pools", bytes_short(private))
        } else {
            String::new()
        },
        bytes_short(request)
    )];
    let mut metrics = vec![
        ("request_bytes", request as f64),
        ("reserved_unallocated_bytes", free as f64),
        (
            "expandable_segments",
            if x.expandable_segments { 1.0 } else { 0.0 },
        ),
    ];
    if private > 0 {
        evidence.push(format!(
            "{} more was free in private pools (CUDA graphs, MemPool): held for their owners, not fragmentation",
            bytes_short(private)
        ));
        metrics.push(("private_pool_free_bytes", private as f64));
    }
    if x.cuda_malloc_async {
        evidence.push(
            "backend:cudaMallocAsync keeps no segment, split or retry counters (memory_stats reads 0 for them): unknown, so judged by the pool's reserved − allocated alone"
                .to_string(),
        );
        metrics.push(("cuda_malloc_async", 1.0));
    } else {
        metrics.push(("inactive_split_bytes", x.inactive_split_bytes as f64));
        metrics.push(("num_alloc_retries", x.alloc_retries as f64));
    }
    let share = if x.limit_bytes > 0 {
        free as f64 / x.limit_bytes as f64
    } else {
        free as f64 / x.reserved_bytes.max(1) as f64
    };
    let mut confidence = BASE_CONFIDENCE + share;
    if let Some(lfb) = x.largest_free_block_bytes {
        metrics.push(("largest_free_block_bytes", lfb as f64));
        if lfb < request {
            evidence.push(format!(
                "the largest free block was {}, smaller than the request: the free bytes are split",
                bytes_short(lfb)
            ));
            confidence += CORROBORATION;
        }
    }
    if x.limit_bytes > 0 {
        evidence.push(format!(
            "{:.0}% of {} ({}) was free but unusable",
            share * 100.0,
            x.limit_source,
            bytes_short(x.limit_bytes)
        ));
        metrics.push(("limit_bytes", x.limit_bytes as f64));
    }
    if x.alloc_retries > 0 {
        evidence.push(format!(
            "num_alloc_retries {}: the allocator already freed its cache and retried",
            x.alloc_retries
        ));
        confidence += CORROBORATION;
    }
    if x.expandable_segments {
        evidence.push(
            "expandable_segments is already on (inactive_split is not counted under it): judged by reserved − allocated and the snapshot; turning it on is not the cure here, retest any other fix"
                .to_string(),
        );
    } else if x.inactive_split_bytes >= request {
        evidence.push(format!(
            "inactive_split {}: freed pieces of split blocks",
            bytes_short(x.inactive_split_bytes)
        ));
        confidence += CORROBORATION;
    }
    Some(cause(
        CauseKind::Fragmentation,
        confidence.min(MAX_CONFIDENCE),
        evidence,
        &metrics,
    ))
}
