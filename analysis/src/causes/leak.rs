//! A leak: the between-requests baseline of live bytes rises with completed
//! requests, persistently, and no collection gives it back.
//!
//! Live bytes are the device allocator's where there is one. A process on a
//! GPU whose allocator no agent reads (candle's tensors through cudarc) has
//! NVML's figure for it, read at each request end and sample. A process
//! without a device (a CPU server) has only its heap census: there the
//! census's retained type is the live bytes, and the host readings prove
//! the trend.

use super::{cause, gc_retained};
use crate::census::{self, HeapGrowth, HeapVerdict};
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth::{self, Trend};
use crate::pb;
use crate::pb::event::Kind;
use crate::runtime_kind;
use crate::runway::{self, Runway, RUNWAY_UNKNOWN};
use crate::units::bytes_short;
use crate::warmup::{
    self, Assessed, Stage, Window, STOPPED_METRIC, WARMUP_CONFIDENCE, WARMUP_METRIC,
};
use oomscope_proto::CauseKind;

pub fn leak(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    if f.timeline.device().next().is_some() {
        return device_leak(f, Live::Allocator);
    }
    // A device leak outside any allocator read; else the host's census.
    if let Some(c) = device_leak(f, Live::Nvml) {
        return Some(c);
    }
    match census::verdict(f)? {
        HeapVerdict::Growing(g) => Some(heap_leak(f, &g)),
        HeapVerdict::Retained(_) => None,
    }
}

/// Which reading of the device's memory a leak is read from.
#[derive(Clone, Copy, PartialEq)]
enum Live {
    /// The device allocator's live (allocated) bytes.
    Allocator,
    /// NVML's figure for this process: no allocator reading, so what the
    /// framework holds, its caches and the CUDA context included.
    Nvml,
}

/// Live memory on the device, between requests.
fn device_leak(f: &Findings, source: Live) -> Option<pb::Cause> {
    let window = Window::of(f.evidence, &f.timeline);
    let (live, window_of, what) = match source {
        // No warm-up window on the device's live bytes (see
        // `warmup::assess`): a device leak is named with its runway from
        // its first requests.
        Live::Allocator => (
            growth::baseline_series(&f.timeline, |p| p.has_allocator.then_some(p.allocated)),
            None,
            "live bytes (allocated)",
        ),
        // NVML's figure holds what a warm-up fills (workspaces, a caching
        // pool's reserve): it gets the window host readings get.
        Live::Nvml => (
            growth::baseline_series(&f.timeline, |p| p.device_used),
            Some(&window),
            "this process's device memory (NVML)",
        ),
    };
    let Assessed { trend: t, stage } = warmup::assess(&live, window_of, Trend::leaks)?;
    // Growth that a collection gave back is gc_retained, not a leak.
    if gc_retained::reclaim(f).is_some_and(|r| r.gave_back_growth()) {
        return None;
    }
    let per_request = t.bytes_per_request();
    let used = match source {
        Live::Allocator => {
            let last = f.timeline.baseline().last()?;
            last.reserved.max(last.allocated)
        }
        Live::Nvml => live.last()?.1 as u64,
    };
    let mut evidence = vec![t.rise_line(what)];
    let mut metrics = vec![
        ("bytes_per_request", per_request.round()),
        ("p_value", t.p_value),
        ("requests_seen", t.span),
    ];
    if let Some(line) = stage_line(f, &window, stage, &t, &mut metrics) {
        evidence.insert(0, line);
    } else if f.device_limit > 0 {
        let runway = Runway {
            limit: f.device_limit,
            limit_name: limit_name(f),
            used,
            per_request,
            rate: runway::serving_rate(&f.timeline),
        };
        evidence.insert(0, runway.line());
        metrics.extend(runway.metrics());
    } else {
        evidence.insert(0, RUNWAY_UNKNOWN.to_string());
    }
    if let Some(line) = live_tensors_line(f) {
        evidence.push(line.0);
        metrics.push(("live_tensors_per_request", line.1));
    }
    if let Some((line, type_bytes)) = heap_census_line(f) {
        evidence.push(line);
        metrics.push(("retained_type_bytes_per_request", type_bytes));
    }
    let rk = runtime_kind::of(f.evidence);
    evidence.push(
        match source {
            Live::Allocator => runtime_kind::live_bytes_line(&rk),
            Live::Nvml => runtime_kind::unread_device_line(&rk),
        }
        .to_string(),
    );
    if source == Live::Nvml {
        metrics.push(("device_used_bytes", used as f64));
    }
    let confidence = match stage {
        Stage::Growing if t.p_value < 1e-6 => 0.9,
        Stage::Growing => 0.75,
        Stage::PossibleWarmUp | Stage::Stopped(_) => WARMUP_CONFIDENCE,
    };
    Some(cause(CauseKind::Leak, confidence, evidence, &metrics))
}

/// The first line of a leak not past warm-up, or stopped (with its metric),
/// in place of a runway; None for a growing leak, which states its runway.
fn stage_line(
    f: &Findings,
    window: &Window,
    stage: Stage,
    t: &Trend,
    metrics: &mut Vec<(&'static str, f64)>,
) -> Option<String> {
    match stage {
        Stage::Growing => None,
        Stage::PossibleWarmUp => {
            metrics.push((WARMUP_METRIC, 1.0));
            Some(window.warmup_line())
        }
        Stage::Stopped(s) => {
            metrics.push((STOPPED_METRIC, s.at_requests));
            Some(window.stopped_line(&f.timeline, &s, t))
        }
    }
}

/// Live Python objects on the host, from the heap censuses.
fn heap_leak(f: &Findings, g: &HeapGrowth) -> pb::Cause {
    let per_request = g.top.bytes_per_request();
    let mut evidence = vec![g.growth_line(), g.significance_line(), g.objects_line()];
    evidence.extend(g.chain_line());
    let mut metrics = vec![
        ("bytes_per_request", per_request.round()),
        ("p_value", g.significance.p_value),
        ("requests_seen", g.requests()),
        ("retained_type_bytes_per_request", per_request.round()),
        ("retained_objects_per_request", g.top.objects_per_request()),
    ];
    // Possible warm-up while the newest reading is inside the window.
    let window = Window::of(f.evidence, &f.timeline);
    let in_warmup = f.timeline.requests_done() <= window.requests;
    if in_warmup {
        metrics.push((WARMUP_METRIC, 1.0));
        evidence.insert(0, window.warmup_line());
    } else if let Some(((limit, limit_name), used)) = f.host_limit().zip(last_host_usage(f)) {
        let runway = Runway {
            limit,
            limit_name,
            used,
            per_request,
            rate: runway::serving_rate(&f.timeline),
        };
        evidence.insert(0, runway.line());
        metrics.extend(runway.metrics());
    } else {
        evidence.insert(0, RUNWAY_UNKNOWN.to_string());
    }
    evidence.push(
        "no device allocator here: these are live Python objects on the host that no collection freed; drop the references after each request (the chain shows who holds them)"
            .to_string(),
    );
    let confidence = if in_warmup {
        WARMUP_CONFIDENCE
    } else if g.significance.p_value < 1e-6 {
        0.9
    } else {
        0.75
    };
    cause(CauseKind::Leak, confidence, evidence, &metrics)
}

/// The process's latest host reading: RSS, else its cgroup's usage.
fn last_host_usage(f: &Findings) -> Option<u64> {
    let pts = &f.timeline.points;
    pts.iter()
        .rev()
        .find_map(|p| p.rss)
        .or_else(|| pts.iter().rev().find_map(|p| p.cgroup_usage))
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
