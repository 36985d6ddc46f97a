//! How many sequences of the longest context seen fit under the limit.
//!
//! per sequence = context_tokens × bytes_per_token + overhead (its live
//! non-KV bytes and its peak − live workspace); what sequences may use = the
//! limit − the fixed bytes (weights and buffers) − the bytes the allocator
//! held but could not hand out at the failure. The estimate is shrunk by its
//! uncertainty before it is floored, so a claim errs on the safe side.

use serde::Serialize;

use crate::devices::Devices;
use crate::evidence::Evidence;
use crate::failure::AtFailure;
use crate::kv_fit::{self, TokenFit};
use crate::stats;
use crate::timeline::Timeline;

/// The least relative uncertainty claimed: the allocator rounds blocks (to 2
/// MiB in the large pool) and samples fall between peaks.
pub const MIN_UNCERTAINTY: f64 = 0.05;
/// Beyond this the fit is too loose to size anything by; it is reported as is.
pub const MAX_UNCERTAINTY: f64 = 0.5;
/// A run that did not fail must have completed at least this many requests:
/// a single passing request proves nothing about capacity.
pub const MIN_PASSING_REQUESTS: u64 = 2;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Capacity {
    pub limit_bytes: u64,
    pub weights_bytes: u64,
    pub bytes_per_token: u64,
    pub overhead_bytes_per_sequence: u64,
    /// Active tokens that fit across `safe_sequences` sequences (one, when
    /// not even one full-context sequence fits).
    pub safe_active_tokens: u64,
    pub context_tokens: u64,
    pub safe_sequences: u64,
    /// Relative (0.05 = ±5%).
    pub uncertainty: f64,
}

/// The estimate from one agent's evidence, or None where it would be a guess:
/// no limit, no reading inside requests that fits, or one passing request.
pub fn capacity(e: &Evidence) -> Option<Capacity> {
    let devices = Devices::of(e);
    let tl = Timeline::of_device(e, devices.failing_key().as_ref());
    let failure = AtFailure::from_evidence(e, e.oom(), &tl, &devices);
    estimate(e, &tl, failure.as_ref())
}

pub(crate) fn estimate(
    e: &Evidence,
    tl: &Timeline,
    failure: Option<&AtFailure>,
) -> Option<Capacity> {
    let fit = kv_fit::fit(tl)?;
    if failure.is_none() && tl.requests_done() < MIN_PASSING_REQUESTS {
        return None;
    }
    let limit_bytes = failure
        .map(|f| f.limit_bytes)
        .filter(|&l| l > 0)
        .unwrap_or_else(|| Devices::of(e).limit_bytes());
    if limit_bytes == 0 {
        return None;
    }
    let weights_bytes = weights_bytes(e, tl, &fit);
    let fixed = fit.fixed_bytes.max(weights_bytes as f64);
    let held = held_unusable(tl, failure);
    let context_tokens = failure
        .map(|f| {
            f.context
                .active_tokens
                .div_ceil(f.context.active_sequences.max(1))
        })
        .unwrap_or(0)
        .max(fit.context_tokens);
    let fit = TokenFit {
        context_tokens,
        ..fit
    };
    let uncertainty = fit.spread.clamp(MIN_UNCERTAINTY, MAX_UNCERTAINTY);
    let usable = ((limit_bytes as f64 - fixed - held) * (1.0 - uncertainty)).max(0.0);
    let overhead = fit.overhead_per_sequence();
    let safe_sequences = (usable / fit.per_sequence_bytes()).floor().max(0.0) as u64;
    let safe_active_tokens = ((usable - overhead * safe_sequences.max(1) as f64)
        / fit.bytes_per_token)
        .floor()
        .max(0.0) as u64;
    let (safe_active_tokens, safe_sequences) =
        below_failures(safe_active_tokens, safe_sequences, &failures(e, failure));
    Some(Capacity {
        limit_bytes,
        weights_bytes,
        bytes_per_token: fit.bytes_per_token.round() as u64,
        overhead_bytes_per_sequence: overhead.round() as u64,
        safe_active_tokens,
        context_tokens,
        safe_sequences,
        uncertainty: (uncertainty * 1000.0).round() / 1000.0,
    })
}

/// The (active tokens, active sequences) at each failure the evidence
/// holds: the one diagnosed and every device OOM's context (threads that
/// failed together each sent one).
fn failures(e: &Evidence, failure: Option<&AtFailure>) -> Vec<(u64, u64)> {
    let at = failure.map(|f| (f.context.active_tokens, f.context.active_sequences));
    let ooms = e.events.iter().filter_map(|ev| match &ev.kind {
        Some(crate::pb::event::Kind::Oom(o)) => o
            .context
            .as_ref()
            .map(|c| (c.active_tokens, c.active_sequences)),
        _ => None,
    });
    at.into_iter().chain(ooms).collect()
}

/// A safe figure is below the smallest load that failed: the fit's
/// estimate, capped one under the fewest tokens and the fewest sequences
/// any failure came at (a failure with 0 of either did not say).
fn below_failures(tokens: u64, sequences: u64, failures: &[(u64, u64)]) -> (u64, u64) {
    let least = |v: fn(&(u64, u64)) -> u64| failures.iter().map(v).filter(|&n| n > 0).min();
    let cap = |safe: u64, failed: Option<u64>| failed.map_or(safe, |f| safe.min(f - 1));
    (cap(tokens, least(|f| f.0)), cap(sequences, least(|f| f.1)))
}

/// The weights: as the runtime reports them, else the live bytes at the end
/// of the load, else the fixed bytes of the fit.
fn weights_bytes(e: &Evidence, tl: &Timeline, fit: &TokenFit) -> u64 {
    let reported = tl.points.iter().map(|p| p.weight_bytes).max().unwrap_or(0);
    if reported > 0 {
        return reported;
    }
    let load_end = e.events.iter().rev().find_map(|ev| match &ev.kind {
        Some(crate::pb::event::Kind::Phase(p))
            if p.name.starts_with("load") && !p.start && p.error.is_empty() =>
        {
            Some(p.allocated_bytes)
        }
        _ => None,
    });
    load_end
        .filter(|&b| b > 0)
        .unwrap_or(fit.fixed_bytes.round() as u64)
}

/// Bytes reserved but not handed out: at the failure (fragments and cache
/// the allocator could not use), else the median over readings in requests.
fn held_unusable(tl: &Timeline, failure: Option<&AtFailure>) -> f64 {
    if let Some(f) = failure {
        return f.reserved_unallocated_bytes() as f64;
    }
    let gaps: Vec<f64> = tl
        .active()
        .map(|p| p.reserved.saturating_sub(p.allocated) as f64)
        .collect();
    stats::median(&gaps).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::below_failures;

    #[test]
    fn a_safe_figure_is_below_every_failure_in_the_evidence() {
        // The case: the fit said 3891 tokens and 8 sequences; the
        // run failed at 3840 tokens in 8 sequences.
        assert_eq!(below_failures(3891, 8, &[(3840, 8)]), (3839, 7));
        // Several failures: the smallest of each.
        assert_eq!(below_failures(5000, 10, &[(4096, 8), (3000, 9)]), (2999, 7));
        // Already below: unchanged; failures that said nothing cap nothing.
        assert_eq!(below_failures(1000, 2, &[(3840, 8)]), (1000, 2));
        assert_eq!(below_failures(1000, 2, &[(0, 0)]), (1000, 2));
        assert_eq!(below_failures(1000, 2, &[]), (1000, 2));
    }
}
