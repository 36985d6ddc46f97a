//! Weights too large: the failure came while loading, before any request,
//! with the bytes loaded so far near the limit.

use super::cause;
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::pb;
use crate::pb::event::Kind;
use crate::units::bytes_short;
use oomscope_proto::CauseKind;

/// Loaded bytes plus the failed request at or above this share of the limit:
/// the weights themselves filled it. Below it, something else held the rest.
const NEAR_LIMIT: f64 = 0.8;

pub fn weights_too_large(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let x = f.failure.as_ref().filter(|x| x.in_load)?;
    let loaded_ctx = f
        .timeline
        .points
        .iter()
        .map(|p| p.loaded_bytes)
        .max()
        .unwrap_or(0);
    let loaded = loaded_ctx.max(x.allocated_bytes);
    let limit = x.limit_bytes;
    if loaded == 0 || limit == 0 {
        return None;
    }
    let model = model_bytes(f);
    let share = (loaded + x.requested_bytes) as f64 / limit as f64;
    let mut evidence = vec![format!(
        "the failure came while loading: {} loaded, {} more asked, against {} ({})",
        bytes_short(loaded),
        bytes_short(x.requested_bytes),
        bytes_short(limit),
        x.limit_source
    )];
    let mut metrics = vec![
        ("loaded_bytes", loaded as f64),
        ("limit_bytes", limit as f64),
        ("requested_bytes", x.requested_bytes as f64),
    ];
    if let Some(m) = model {
        evidence.push(format!("the model is {} in all", bytes_short(m)));
        metrics.push(("model_bytes", m as f64));
    }
    let confidence = match model {
        Some(m) if m > limit => 0.95,
        _ if share >= NEAR_LIMIT => 0.85,
        _ => {
            evidence.push(format!(
                "the load used only {:.0}% of the limit: the rest was held elsewhere",
                share * 100.0
            ));
            0.25
        }
    };
    Some(cause(
        CauseKind::WeightsTooLarge,
        confidence,
        evidence,
        &metrics,
    ))
}

/// The model's full size, where the runtime said it (load phase or context).
fn model_bytes(f: &Findings) -> Option<u64> {
    let from_phase = f.evidence.events.iter().find_map(|e| match &e.kind {
        Some(Kind::Phase(p)) => p.model.as_ref().map(|m| m.bytes).filter(|&b| b > 0),
        _ => None,
    });
    from_phase.or_else(|| {
        f.evidence.samples.iter().find_map(|s| {
            s.context
                .as_ref()
                .and_then(|c| c.numbers.get("model_bytes"))
                .filter(|b| **b > 0.0)
                .map(|b| *b as u64)
        })
    })
}
