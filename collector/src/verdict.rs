//! The analysis's verdicts, guarded: the analysis is pure code, but a panic
//! in it must not take a query or an ingest down with it. Ingest (incidents)
//! and queries both judge evidence through here.

use std::panic::AssertUnwindSafe;

use oomscope_analysis::{Evidence, IncidentRef};
use tonic::Status;

use crate::pb;

/// The analysis's verdict on some evidence. The analysis is pure code, but a
/// panic in it must not take a query (or an ingest) down with it.
pub fn diagnose(evidence: &Evidence) -> Result<pb::Diagnosis, Status> {
    std::panic::catch_unwind(AssertUnwindSafe(|| oomscope_analysis::diagnose(evidence))).map_err(
        |_| {
            tracing::error!("the analysis panicked while diagnosing");
            Status::internal(
                "the analysis failed on this evidence (a bug: please report it with the incident)",
            )
        },
    )
}

/// The domain the analysis blames ("gpu_vram", ..., "unknown"); "" for a
/// failure at start-up that no memory explains (it has no domain), and if
/// the analysis panicked, so that recording the incident still succeeds.
pub fn attribute_domain(evidence: &Evidence) -> String {
    std::panic::catch_unwind(AssertUnwindSafe(|| {
        oomscope_analysis::memory_domain(evidence)
            .map(|d| d.as_str().to_string())
            .unwrap_or_default()
    }))
    .unwrap_or_else(|_| {
        tracing::error!("the analysis panicked while attributing a domain");
        String::new()
    })
}

pub fn incident_ref(inc: &pb::Incident) -> IncidentRef {
    IncidentRef {
        id: inc.id.clone(),
        kind: inc.kind.clone(),
        time_ns: inc.time_ns,
        agent: inc.agent_id.clone(),
    }
}
