//! KV growth: live bytes track active tokens, the failure came as tokens or
//! sequences rose, and the weights stayed flat.

use super::cause;
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth;
use crate::kv_fit;
use crate::pb;
use crate::trigger;
use crate::units::bytes_short;
use oomscope_proto::{CauseKind, TriggerKind};

/// A fit explaining less than this share of the variance is weak evidence.
const GOOD_FIT_R2: f64 = 0.8;

pub fn kv_growth(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let x = f.failure.as_ref().filter(|x| !x.in_load)?;
    let fit = kv_fit::fit(&f.timeline)?;
    // Weights flat: the runtime's own count does not move, and nothing grows between requests.
    let weights: Vec<u64> = f
        .timeline
        .points
        .iter()
        .map(|p| p.weight_bytes)
        .filter(|&w| w > 0)
        .collect();
    let weights_flat = weights.iter().min() == weights.iter().max();
    let baseline_grows = growth::live_baseline(&f.timeline).is_some_and(|t| t.leaks());
    if !weights_flat || baseline_grows {
        return None;
    }
    let trig = trigger::decide(f, v).map(|(t, _)| t);
    let rising = matches!(
        trig,
        Some(TriggerKind::ConcurrencyDependent | TriggerKind::SizeDependent)
    );
    let failed_at_tokens = if x.context.active_tokens > 0 {
        x.context.active_tokens
    } else {
        fit.max_tokens
    };
    let mut evidence = vec![format!(
        "live bytes track active tokens: {} per token (Theil–Sen over {} readings in requests, R² {:.2}), fixed {} (weights and buffers)",
        bytes_short(fit.bytes_per_token.round() as u64),
        fit.points,
        fit.r2,
        bytes_short(fit.fixed_bytes as u64)
    )];
    if let Some(w) = weights.first() {
        evidence.push(format!("weights flat at {}", bytes_short(*w)));
    }
    let seqs = x.context.active_sequences;
    evidence.push(if x.context.active_tokens > 0 {
        format!(
            "the failure came at {failed_at_tokens} active tokens{} (the most seen before it: {} tokens, {} sequences)",
            if seqs > 0 { format!(" in {seqs} sequences") } else { String::new() },
            fit.max_tokens,
            fit.max_sequences
        )
    } else {
        format!(
            "the failure came past the most seen: {} tokens in {} sequences",
            fit.max_tokens, fit.max_sequences
        )
    });
    if fit.transient_per_sequence > 0.0 {
        evidence.push(format!(
            "each sequence also needs about {} of activations and workspace (peak − live)",
            bytes_short(fit.transient_per_sequence as u64)
        ));
    }
    let mut metrics = vec![
        ("bytes_per_token", fit.bytes_per_token.round()),
        ("failed_at_active_tokens", failed_at_tokens as f64),
        ("fixed_bytes", fit.fixed_bytes.round()),
        (
            "overhead_bytes_per_sequence",
            fit.overhead_per_sequence().round(),
        ),
    ];
    if seqs > 0 {
        metrics.push(("failed_at_active_sequences", seqs as f64));
    }
    let mut confidence = if rising { 0.85 } else { 0.55 };
    if fit.r2 < GOOD_FIT_R2 {
        confidence -= 0.2;
    }
    Some(cause(CauseKind::KvGrowth, confidence, evidence, &metrics))
}
