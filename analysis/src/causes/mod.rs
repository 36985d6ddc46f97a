//! Causes: why the domain ran out. Each analyzer looks at the findings and
//! returns at most one cause; `analyze` runs them all and ranks the results.
//!
//! This file holds the list. Host-side analyzers live in `host` and
//! `other_process`; analyzers of GPU allocator timelines (leak,
//! fragmentation, cache retention, KV growth ...) join the list as modules of
//! their own, with the same signature.

mod host;
mod other_process;

use std::collections::HashMap;

use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::pb;

/// One analyzer: a cause or nothing.
pub type Analyzer = fn(&Findings, &DomainVerdict) -> Option<pb::Cause>;

/// Every analyzer, in no particular order (ranking is by confidence).
pub const ANALYZERS: &[Analyzer] = &[
    host::cgroup_limit,
    host::host_ram_exhausted,
    host::address_space_limit,
    host::overcommit_limit,
    host::shm_full,
    host::swap_thrash,
    host::external_kill,
    other_process::other_process,
];

/// Every cause found, most likely first.
pub fn analyze(f: &Findings, v: &DomainVerdict) -> Vec<pb::Cause> {
    let mut causes: Vec<pb::Cause> = ANALYZERS.iter().filter_map(|a| a(f, v)).collect();
    causes.sort_by(|a, b| b.confidence.total_cmp(&a.confidence));
    causes
}

/// A cause from its parts; metrics are named with their unit (`_bytes`, `_per_s`).
pub(crate) fn cause(
    kind: &str,
    confidence: f64,
    evidence: Vec<String>,
    metrics: &[(&str, f64)],
) -> pb::Cause {
    pb::Cause {
        kind: kind.to_string(),
        confidence,
        evidence,
        metrics: metrics
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect::<HashMap<_, _>>(),
        processes: Vec::new(),
    }
}
