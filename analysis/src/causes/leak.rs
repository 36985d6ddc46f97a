//! A leak: the between-requests baseline of live bytes rises with completed
//! requests, persistently, and no collection gives it back.

use super::{cause, gc_retained};
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth::{self, Trend};
use crate::pb;
use crate::pb::event::Kind;
use crate::trigger::{MIN_LEAK_BYTES_PER_REQUEST, MIN_LEAK_GROWTH_BYTES};
use crate::units::bytes_short;

pub fn leak(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let t = growth::live_baseline(&f.timeline)
        .filter(|t| t.grows(MIN_LEAK_BYTES_PER_REQUEST, MIN_LEAK_GROWTH_BYTES))?;
    // Growth that a collection gave back is gc_retained, not a leak.
    if gc_retained::reclaim(f).is_some_and(|r| r.gave_back_growth()) {
        return None;
    }
    let per_request = t.bytes_per_request();
    let last = f.timeline.baseline().last()?;
    let mut evidence = vec![growth_line("live bytes (allocated)", &t)];
    let mut metrics = vec![
        ("bytes_per_request", per_request.round()),
        ("p_value", t.p_value),
        ("requests_seen", t.span),
    ];
    if f.device_limit > 0 {
        let used = last.reserved.max(last.allocated);
        let left = f.device_limit.saturating_sub(used) as f64 / per_request;
        evidence.push(format!(
            "at this rate {} ({}) is reached in about {} more requests",
            bytes_short(f.device_limit),
            limit_name(f),
            left.floor()
        ));
        metrics.push(("requests_to_limit", left.floor()));
        metrics.push(("limit_bytes", f.device_limit as f64));
    }
    if let Some(line) = live_tensors_line(f) {
        evidence.push(line.0);
        metrics.push(("live_tensors_per_request", line.1));
    }
    if let Some((line, type_bytes)) = heap_census_line(f) {
        evidence.push(line);
        metrics.push(("retained_type_bytes_per_request", type_bytes));
    }
    evidence.push(
        "these bytes are live tensors: empty_cache cannot return them; find what holds them (allocation site, Python type)"
            .to_string(),
    );
    let confidence = if t.p_value < 1e-6 { 0.9 } else { 0.75 };
    Some(cause("leak", confidence, evidence, &metrics))
}

pub(crate) fn growth_line(what: &str, t: &Trend) -> String {
    format!(
        "between requests {what} rose from {} to {} over {} requests: {} per request (Theil–Sen over {} readings; Mann–Kendall p = {:.1e}; still rising in the later half)",
        bytes_short(t.first_bytes.max(0.0) as u64),
        bytes_short(t.last_bytes.max(0.0) as u64),
        t.span,
        bytes_short(t.bytes_per_request().max(0.0).round() as u64),
        t.points,
        t.p_value
    )
}

fn limit_name(f: &Findings) -> &'static str {
    f.failure
        .as_ref()
        .map_or("the device's memory", |x| x.limit_source)
}

/// Live tensors per request, where the runtime counts them.
fn live_tensors_line(f: &Findings) -> Option<(String, f64)> {
    let pts: Vec<(f64, f64)> = growth::baseline_series(&f.timeline, |p| {
        (p.live_tensors > 0).then_some(p.live_tensors)
    });
    let t = growth::trend(&pts)?;
    (t.line.slope > 0.0 && t.p_value < growth::TREND_P_VALUE).then(|| {
        (
            format!(
                "live CUDA tensors +{:.1} per request ({} -> {})",
                t.line.slope, t.first_bytes, t.last_bytes
            ),
            t.line.slope,
        )
    })
}

/// The retained Python type with the largest growth per request between the
/// first and last heap census.
fn heap_census_line(f: &Findings) -> Option<(String, f64)> {
    let censuses: Vec<(i64, &pb::HeapCensus)> = f
        .evidence
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::HeapCensus(h)) => Some((e.time_ns, h)),
            _ => None,
        })
        .collect();
    let (first, last) = (censuses.first()?, censuses.last()?);
    let requests_at = |t: i64| {
        f.timeline
            .points
            .iter()
            .filter(|p| p.time_ns <= t)
            .map(|p| p.requests_done)
            .max()
            .unwrap_or(0)
    };
    let requests = requests_at(last.0).saturating_sub(requests_at(first.0));
    if requests == 0 {
        return None;
    }
    let before = |name: &str| first.1.types.iter().find(|t| t.type_name == name);
    let (name, dbytes, dcount) = last
        .1
        .types
        .iter()
        .map(|t| {
            let b = before(&t.type_name);
            (
                t.type_name.as_str(),
                t.bytes as f64 - b.map_or(0.0, |b| b.bytes as f64),
                t.count as f64 - b.map_or(0.0, |b| b.count as f64),
            )
        })
        .filter(|(_, db, dc)| *db > 0.0 || *dc > 0.0)
        .max_by(|a, b| {
            (a.1, a.2)
                .partial_cmp(&(b.1, b.2))
                .unwrap_or(std::cmp::Ordering::Equal)
        })?;
    let n = requests as f64;
    let mut line = format!(
        "Python heap: {name} grew most, +{:.1} objects ({}) per request between heap censuses {requests} requests apart",
        dcount / n,
        bytes_short((dbytes / n).max(0.0) as u64)
    );
    if !last.1.referrer_chain.is_empty() {
        line.push_str(&format!("; held by {}", last.1.referrer_chain.join(" -> ")));
    }
    Some((line, (dbytes / n).max(0.0)))
}
