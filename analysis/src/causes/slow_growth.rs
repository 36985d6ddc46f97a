//! Slow growth: certain growth between requests that takes less than
//! `runway::SLOW_GROWTH_SHARE` of its limit per request (the host's, or the
//! device's live bytes under the leak floor). Not a leak: it is reported
//! with its runway, so that a limit gone in months is not hunted like one
//! gone in an hour, yet is not hidden either.

use super::cause;
use super::host_growth::host_trend;
use crate::census::{self, HeapVerdict};
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth::{self, Trend};
use crate::pb;
use crate::runway::{self, Runway, SLOW_GROWTH_SHARE};
use crate::time_growth;
use crate::warmup::Stage;
use oomscope_proto::CauseKind;

/// Far below every leak and host growth (0.6 to 0.9): slow growth explains
/// no failure on its own.
pub const SLOW_GROWTH_CONFIDENCE: f64 = 0.3;

pub fn slow_growth(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let Some((what, t, runway)) = device_slow(f).or_else(|| host_slow(f)) else {
        return slow_over_time(f);
    };
    let evidence = vec![
        runway.line(),
        t.rise_line(what),
        format!(
            "slow growth, not a leak: {:.5} % of the limit per request, under the {:.3} % that a leak takes",
            100.0 * runway.share_per_request(),
            100.0 * SLOW_GROWTH_SHARE
        ),
    ];
    let mut metrics = vec![
        ("bytes_per_request", t.bytes_per_request().round()),
        ("p_value", t.p_value),
    ];
    metrics.extend(runway.metrics());
    Some(cause(
        CauseKind::SlowGrowth,
        SLOW_GROWTH_CONFIDENCE,
        evidence,
        &metrics,
    ))
}

/// The device's live bytes grow for certain, but under the leak floors
/// (growth::Trend::leaks), towards the device's capacity.
fn device_slow(f: &Findings) -> Option<(&'static str, Trend, Runway<'static>)> {
    let t = growth::live_baseline(&f.timeline).filter(|t| t.certain() && !t.leaks())?;
    let last = f.timeline.baseline().last()?;
    (f.device_limit > 0).then(|| {
        let runway = Runway {
            limit: f.device_limit,
            limit_name: "the device's memory",
            used: last.reserved.max(last.allocated),
            per_request: t.bytes_per_request(),
            rate: runway::serving_rate(&f.timeline),
        };
        ("live bytes (allocated)", t, runway)
    })
}

/// The host grows for certain past warm-up, under the slow share, and no
/// heap census names a retained type (that would be a leak, however slow).
fn host_slow(f: &Findings) -> Option<(&'static str, Trend, Runway<'static>)> {
    let h = host_trend(f).filter(|h| h.stage == Stage::Growing)?;
    let (what, t) = (h.what, h.trend);
    let runway = h.runway.filter(|r| r.is_slow())?;
    let heap_grows = matches!(census::verdict(f), Some(HeapVerdict::Growing(_)));
    (!heap_grows).then_some((what, t, runway))
}

/// Growth against time (no request marks) whose limit lasts longer than
/// `time_growth::SLOW_TIME_RUNWAY_S`.
fn slow_over_time(f: &Findings) -> Option<pb::Cause> {
    let g = time_growth::slow(f)?;
    let runway = g.runway?;
    let evidence = vec![
        runway.line(),
        g.rise_line(),
        format!(
            "slow growth, not a leak: its limit lasts more than {} at this rate",
            runway::duration_text(time_growth::SLOW_TIME_RUNWAY_S)
        ),
    ];
    let mut metrics = vec![
        ("bytes_per_second", g.bytes_per_second().round()),
        ("p_value", g.trend.p_value),
    ];
    metrics.extend(runway.metrics());
    Some(cause(
        CauseKind::SlowGrowth,
        SLOW_GROWTH_CONFIDENCE,
        evidence,
        &metrics,
    ))
}
