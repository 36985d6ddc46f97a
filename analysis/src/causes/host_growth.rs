//! Host growth: the process's RSS (or its cgroup's usage) rises with completed
//! requests while the device's live bytes stay flat (or there is no device).
//! A heap census that finds the retaining Python type is joined in; its exact
//! bytes also let a smaller growth through than RSS alone would.

use super::{cause, gc_retained};
use crate::census::{self, HeapGrowth, HeapVerdict};
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth::{self, Trend};
use crate::pb;
use crate::runtime_kind;
use crate::runway::{self, Runway, RUNWAY_UNKNOWN};
use crate::time_growth;
use crate::timeline::Point;
use crate::units::bytes_short;
use crate::warmup::{self, Stage, Window, STOPPED_METRIC, WARMUP_CONFIDENCE, WARMUP_METRIC};
use oomscope_proto::CauseKind;

// No floor in bytes: any growth that is certain (growth::Trend::certain) is
// reported; its runway says how much it matters, and growth under
// runway::SLOW_GROWTH_SHARE of the limit per request is slow_growth's, not
// this. Without a limit in the evidence the runway is unknown, not the
// growth: a certain rise is still a finding.

/// What a growth read from the cgroup's usage (where RSS did not grow) is
/// named, and the metric that marks such a cause.
const CGROUP_USAGE: &str = "cgroup usage";
pub const CGROUP_SERIES_METRIC: &str = "measured_on_cgroup_usage";

/// A host growth that stands as a cause: the trend, its runway where the
/// evidence has a limit, and the heap census's retaining type where one grows.
pub struct Standing<'a> {
    pub what: &'static str,
    pub trend: Trend,
    pub runway: Option<Runway<'static>>,
    pub heap: Option<HeapGrowth<'a>>,
    /// Growing, possible warm-up, or stopped (`warmup`).
    pub stage: Stage,
}

/// The host's certain growth between requests, where it stands against
/// the warm-up window, and its runway to the host limit.
pub struct HostTrend {
    pub what: &'static str,
    /// Over the whole series, or up to where it stopped.
    pub trend: Trend,
    /// None without a limit in the evidence. Computed in every stage (slow
    /// growth is judged by it); only a growth past warm-up states it.
    pub runway: Option<Runway<'static>>,
    pub stage: Stage,
}

/// The host growth that host_growth reports, or None; the trigger reads the
/// same, so that the two never disagree.
pub fn standing<'a>(f: &Findings<'a>) -> Option<Standing<'a>> {
    let HostTrend {
        what,
        trend,
        runway,
        stage,
    } = host_trend(f)?;
    // Growth a collection gave back does not corroborate anything.
    let heap = match census::verdict(f) {
        Some(HeapVerdict::Growing(g)) => Some(g),
        _ => None,
    };
    if heap.is_none() && runway.is_some_and(|r| r.is_slow()) {
        return None;
    }
    Some(Standing {
        what,
        trend,
        runway,
        heap,
        stage,
    })
}

pub fn host_growth(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let Some(Standing {
        what,
        trend: t,
        runway,
        heap,
        stage,
    }) = standing(f)
    else {
        return over_time(f);
    };
    let window = Window::of(f.evidence, &f.timeline);
    // Only a growth past warm-up has a runway to state.
    let runway = runway.filter(|_| stage == Stage::Growing);
    let first_line = match stage {
        Stage::Growing => runway.map_or_else(|| RUNWAY_UNKNOWN.to_string(), |r| r.line()),
        Stage::PossibleWarmUp => window.warmup_line(),
        Stage::Stopped(s) => window.stopped_line(&f.timeline, &s, &t),
    };
    let mut evidence = vec![first_line, t.rise_line(what)];
    if f.timeline.device().next().is_some() {
        evidence.push("device live bytes between requests stayed flat".to_string());
    } else if let Some(nvml) = growth::nvml_baseline(&f.timeline) {
        // No allocator read, but NVML's figure for the process was.
        evidence.push(match nvml.leaks() {
            true => format!(
                "this process's device memory (NVML) grew too, {} per request (the leak)",
                bytes_short(nvml.bytes_per_request().max(0.0).round() as u64)
            ),
            false => "this process's device memory (NVML) between requests stayed flat".to_string(),
        });
    } else {
        evidence.push("no device allocator readings: no GPU memory grew".to_string());
    }
    let mut metrics = vec![
        ("bytes_per_request", t.bytes_per_request().round()),
        ("p_value", t.p_value),
    ];
    if what == CGROUP_USAGE {
        // The whole cgroup grew, not this process alone: another process's
        // verdict must not take it for this one's (see `members`).
        metrics.push((CGROUP_SERIES_METRIC, 1.0));
    }
    if let Some(g) = &heap {
        evidence.push(census_line(g, t.bytes_per_request()));
        evidence.extend(g.chain_line());
        metrics.push((
            "retained_type_bytes_per_request",
            g.top.bytes_per_request().round(),
        ));
    } else if let Some(n) = census::named_growth(&census::points(&f.evidence.events, &f.timeline)) {
        // Too few censuses for the heap's own verdict: they still name
        // and size what the host readings proved grows.
        evidence.push(n.line(t.bytes_per_request()));
        evidence.extend(n.chain_line());
        metrics.push((
            "retained_type_bytes_per_request",
            n.bytes_per_request.round(),
        ));
        metrics.push(("retained_objects_per_request", n.objects_per_request));
    }
    metrics.extend(runway.iter().flat_map(|r| r.metrics()));
    if let Some(line) = runway.and_then(|r| r.rate).and_then(|r| r.idle_line()) {
        evidence.push(line);
    }
    match stage {
        Stage::PossibleWarmUp => metrics.push((WARMUP_METRIC, 1.0)),
        Stage::Stopped(s) => metrics.push((STOPPED_METRIC, s.at_requests)),
        Stage::Growing => {}
    }
    evidence.push(format!(
        "find what the process keeps on the host ({}); more swap only slows the failure down",
        runtime_kind::host_holder_hint(&runtime_kind::of(f.evidence))
    ));
    let confidence = match stage {
        Stage::Growing if f.failed => 0.7,
        Stage::Growing => 0.6,
        Stage::PossibleWarmUp | Stage::Stopped(_) => WARMUP_CONFIDENCE,
    };
    Some(cause(CauseKind::HostGrowth, confidence, evidence, &metrics))
}

/// The host's certain growth between requests (RSS, else the usage of a
/// limited cgroup), while the device's live bytes do not leak, placed
/// against the warm-up window, and its runway to the host limit (None
/// without a limit in the evidence).
pub fn host_trend(f: &Findings) -> Option<HostTrend> {
    if growth::live_baseline(&f.timeline).is_some_and(|t| t.leaks()) {
        return None;
    }
    // Growth that a collection gave back is gc_retained's, though the
    // allocator may keep the pages (RSS rarely falls).
    let gave_back = gc_retained::reclaim(f).is_some_and(|r| r.gave_back_growth());
    if gave_back || matches!(census::verdict(f), Some(HeapVerdict::Retained(_))) {
        return None;
    }
    let window = Window::of(f.evidence, &f.timeline);
    let series = |v: fn(&Point) -> Option<u64>| {
        warmup::assess(&host_series(f, v), Some(&window), Trend::host_certain)
    };
    // The cgroup's usage only where its limit bounds the process: an
    // unlimited cgroup is shared (a collector's page cache, a neighbour),
    // and its growth is not this process's.
    // The server's own memory: the agent's heap is not its growth.
    let (what, a) = match series(Point::server_rss) {
        Some(t) => ("host RSS", t),
        None => (
            CGROUP_USAGE,
            series(|p| p.cgroup_limit.and(p.server_cgroup_usage()))?,
        ),
    };
    // The runway starts from what the limit sees, the agent's heap included.
    let agent_heap = f.timeline.points.last().map_or(0, |p| p.agent_heap);
    let t = a.trend;
    let runway = f.host_limit().map(|(limit, limit_name)| Runway {
        limit,
        limit_name,
        used: t.last_bytes.max(0.0) as u64 + agent_heap,
        per_request: t.bytes_per_request(),
        rate: runway::serving_rate(&f.timeline),
    });
    Some(HostTrend {
        what,
        trend: t,
        runway,
        stage: a.stage,
    })
}

/// Growth against time of a process with no request marks (see
/// `time_growth`): the same cause, its rate in bytes per second and its
/// runway in time.
fn over_time(f: &Findings) -> Option<pb::Cause> {
    let g = time_growth::standing(f)?;
    let runway_line = g
        .runway
        .map_or_else(|| RUNWAY_UNKNOWN.to_string(), |r| r.line());
    let evidence = vec![
        runway_line,
        g.rise_line(),
        g.warmup_line(),
        "no request marks (no in-process agent counting requests, no request boundaries): growth is fitted against time, not requests".to_string(),
        "find what the process keeps on the host (its allocator's heap profile, growing caches or queues); more swap only slows the failure down".to_string(),
    ];
    let mut metrics = vec![
        (time_growth::PER_SECOND_METRIC, g.bytes_per_second().round()),
        ("p_value", g.trend.p_value),
        ("fitted_seconds", g.to_s - g.from_s),
    ];
    if g.what == time_growth::CGROUP_USAGE {
        metrics.push((CGROUP_SERIES_METRIC, 1.0));
    }
    metrics.extend(g.runway.iter().flat_map(|r| r.metrics()));
    let confidence = if f.failed { 0.7 } else { 0.6 };
    Some(cause(CauseKind::HostGrowth, confidence, evidence, &metrics))
}

/// "the heap census names the retaining type: torch.Tensor[cpu] +250 KiB per request (49% of the host growth) ..."
fn census_line(g: &HeapGrowth, host_per_request: f64) -> String {
    let per_request = g.top.bytes_per_request();
    format!(
        "the heap census names the retaining type: {} grew {} per request ({:.0}% of the host growth) over {} censuses, requests {} to {}; {}",
        g.top.name,
        bytes_short(per_request.max(0.0).round() as u64),
        100.0 * per_request / host_per_request,
        g.censuses(),
        g.first.requests_done,
        g.last.requests_done,
        g.objects_line()
    )
}

/// Host readings between requests (device or not) against completed requests.
fn host_series(f: &Findings, v: fn(&Point) -> Option<u64>) -> Vec<(f64, f64)> {
    f.timeline
        .points
        .iter()
        .filter(|p| p.is_baseline() && p.requests_done > 0)
        .filter_map(|p| v(p).map(|b| (p.requests_done as f64, b as f64)))
        .collect()
}
