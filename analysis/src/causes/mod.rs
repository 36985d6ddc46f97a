//! Causes: why the domain ran out. Each analyzer looks at the findings and
//! returns at most one cause; `analyze` runs them all and ranks the results.
//!
//! This file holds the lists. Host-side analyzers of a failure live in `host`;
//! each timeline analyzer (leak, gc, cache, fragmentation, KV growth, weights,
//! other processes, host growth, slow growth), memory outside PyTorch's
//! allocator and the runtime's own text have a module of their own; the verdicts of runtimes with a preallocated KV pool (vLLM,
//! SGLang, llama.cpp) live in `kv_pool`; a failure at start-up that no
//! memory explains is `startup_failure`.

mod cache_retention;
mod fragmentation;
mod gc_retained;
mod host;
pub(crate) mod host_growth;
mod host_kernel;
mod kv_growth;
mod kv_pool;
mod leak;
mod non_pytorch;
mod other_process;
mod runtime_text;
mod slow_growth;
pub(crate) mod startup_failure;
mod weights;

use std::collections::HashMap;

pub(crate) use kv_pool::full_without_pressure;

use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::pb;
use oomscope_proto::CauseKind;

/// One analyzer: a cause or nothing.
pub type Analyzer = fn(&Findings, &DomainVerdict) -> Option<pb::Cause>;

/// Analyzers of a failure: they explain what ran out, so they run only when
/// something failed. In no particular order (ranking is by confidence).
pub const ANALYZERS: &[Analyzer] = &[
    host::cgroup_limit,
    host::host_ram_exhausted,
    host::address_space_limit,
    host::data_limit,
    host::overcommit_limit,
    host::shm_full,
    host::swap_thrash,
    host::external_kill,
    host_kernel::numa_binding_cause,
    host_kernel::host_fragmentation,
    other_process::other_process,
    fragmentation::fragmentation,
    non_pytorch::non_pytorch_memory,
    kv_growth::kv_growth,
    weights::weights_too_large,
    runtime_text::runtime_text,
    kv_pool::kv_reservation_kill,
    kv_pool::activation_headroom,
    kv_pool::taken_after_profiling,
    startup_failure::startup_failure,
];

/// Analyzers of a timeline's growth: they run with or without a failure
/// (a leak hunt diagnoses a server that has not failed yet).
pub const TIMELINE_ANALYZERS: &[Analyzer] = &[
    leak::leak,
    gc_retained::gc_retained,
    cache_retention::cache_retention,
    host_growth::host_growth,
    slow_growth::slow_growth,
    kv_pool::kv_pool_saturation,
    host_kernel::memory_high_throttling,
];

/// Every cause found, most likely first.
pub fn analyze(f: &Findings, v: &DomainVerdict) -> Vec<pb::Cause> {
    let failure = if v.failed { ANALYZERS } else { &[] };
    let mut causes: Vec<pb::Cause> = failure
        .iter()
        .chain(TIMELINE_ANALYZERS)
        .filter_map(|a| a(f, v))
        .collect();
    causes.sort_by(|a, b| b.confidence.total_cmp(&a.confidence));
    // A runtime's text and a timeline analyzer can name the same cause:
    // the more confident one speaks for it.
    let mut seen = std::collections::HashSet::new();
    causes.retain(|c| seen.insert(c.kind.clone()));
    causes
}

/// A cause from its parts; metrics are named with their unit (`_bytes`, `_per_s`).
pub(crate) fn cause(
    kind: CauseKind,
    confidence: f64,
    evidence: Vec<String>,
    metrics: &[(&str, f64)],
) -> pb::Cause {
    pb::Cause {
        kind: kind.as_str().to_string(),
        confidence,
        evidence,
        metrics: metrics
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect::<HashMap<_, _>>(),
        processes: Vec::new(),
    }
}
