//! Cache retention: the caching allocator keeps freed blocks reserved for
//! reuse, so reserved grows while live bytes between requests stay flat.
//! Harmless on its own: before raising OOM the allocator frees its cached
//! blocks and retries. It matters to other processes sharing the GPU.

use super::cause;
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth;
use crate::pb;
use crate::units::bytes_short;
use oomscope_proto::CauseKind;

/// Reserved must grow at least this much to be worth a line.
pub const MIN_CACHE_GROWTH_BYTES: u64 = 64 << 20;
/// ...and this many times more than live bytes did.
pub const CACHE_OVER_LIVE: f64 = 4.0;

pub fn cache_retention(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let live = growth::live_baseline(&f.timeline);
    if live.is_some_and(|t| t.leaks()) {
        return None;
    }
    let base: Vec<_> = f.timeline.baseline().collect();
    let (first, last) = (base.first()?, base.last()?);
    let reserved_peak = base.iter().map(|p| p.reserved).max()?;
    let reserved_low = base.iter().map(|p| p.reserved).min()?;
    let live_min = base.iter().map(|p| p.allocated).min()?;
    let live_max = base.iter().map(|p| p.allocated).max()?;
    let reserved_growth = reserved_peak - reserved_low;
    // Live drift by the robust slope: one sample's temporaries must not decide.
    let live_growth = live.map_or(0.0, |t| (t.line.slope * t.span).max(0.0));
    if reserved_growth < MIN_CACHE_GROWTH_BYTES
        || (reserved_growth as f64) < CACHE_OVER_LIVE * live_growth
    {
        return None;
    }
    let mut evidence = vec![format!(
        "between requests reserved grew from {} to {} while live bytes stayed at {}-{}",
        bytes_short(reserved_low.min(first.reserved)),
        bytes_short(reserved_peak),
        bytes_short(live_min),
        bytes_short(live_max)
    )];
    let mut metrics = vec![
        ("reserved_growth_bytes", reserved_growth as f64),
        ("reserved_peak_bytes", reserved_peak as f64),
        ("live_bytes", last.allocated as f64),
    ];
    if let Some((before, after)) = released(f, last.time_ns) {
        evidence.push(format!(
            "empty_cache returned it: reserved {} -> {}; the cache held no live tensors",
            bytes_short(before),
            bytes_short(after)
        ));
        metrics.push(("released_bytes", before.saturating_sub(after) as f64));
    }
    evidence.push(
        "harmless on its own: the allocator reuses cached blocks and frees them before it reports an OOM; it only crowds other processes on the same GPU"
            .to_string(),
    );
    let confidence = if f.failed { 0.2 } else { 0.6 };
    Some(cause(
        CauseKind::CacheRetention,
        confidence,
        evidence,
        &metrics,
    ))
}

/// Reserved before and after the first cache release after `since`: a
/// CacheRelease event, or a reading taken after `empty_cache`.
fn released(f: &Findings, since: i64) -> Option<(u64, u64)> {
    if let Some(&(_, before, after)) = f
        .timeline
        .cache_releases
        .iter()
        .find(|(t, _, _)| *t >= since)
    {
        return Some((before, after));
    }
    let pts: Vec<_> = f.timeline.device().collect();
    pts.windows(2)
        .find(|w| w[1].is_after_cache_release() && w[1].time_ns >= since)
        .map(|w| (w[0].reserved, w[1].reserved))
}
