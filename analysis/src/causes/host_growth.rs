//! Host growth: the process's RSS (or its cgroup's usage) rises with completed
//! requests while the device's live bytes stay flat (or there is no device).
//! A heap census that finds the retaining Python type is joined in; its exact
//! bytes also let a smaller growth through than RSS alone would.

use super::cause;
use crate::census::{
    self, HeapGrowth, HeapVerdict, MIN_CENSUS_BYTES_PER_REQUEST, MIN_CENSUS_GROWTH_BYTES,
};
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth::{self, runway};
use crate::pb;
use crate::timeline::Point;
use crate::units::bytes_short;

/// Host memory moves in pages and arenas: less than this per request is not
/// worth a verdict...
pub const MIN_HOST_BYTES_PER_REQUEST: f64 = (1u64 << 20) as f64;
/// ...nor less than this over the readings seen...
pub const MIN_HOST_GROWTH_BYTES: f64 = (32u64 << 20) as f64;
// ...unless a heap census shows live objects piling up over the same
// requests: then the census's own floors apply (MIN_CENSUS_*), since the
// growth is no longer arena noise but counted objects.

pub fn host_growth(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let gpu_grows = growth::live_baseline(&f.timeline).is_some_and(|t| t.leaks());
    if gpu_grows {
        return None;
    }
    // Growth a collection gave back does not corroborate anything.
    let heap = match census::verdict(f) {
        Some(HeapVerdict::Growing(g)) => Some(g),
        _ => None,
    };
    let (min_slope, min_growth) = if heap.is_some() {
        (MIN_CENSUS_BYTES_PER_REQUEST, MIN_CENSUS_GROWTH_BYTES)
    } else {
        (MIN_HOST_BYTES_PER_REQUEST, MIN_HOST_GROWTH_BYTES)
    };
    let series = |v: fn(&Point) -> Option<u64>| {
        growth::trend(&host_series(f, v)).filter(|t| t.grows(min_slope, min_growth))
    };
    let (what, t) = match series(|p| p.rss) {
        Some(t) => ("host RSS", t),
        None => ("cgroup usage", series(|p| p.cgroup_usage)?),
    };
    let mut evidence = vec![t.rise_line(what)];
    if f.timeline.device().next().is_some() {
        evidence.push("device live bytes between requests stayed flat".to_string());
    } else {
        evidence.push("no device allocator readings: no GPU memory grew".to_string());
    }
    let mut metrics = vec![
        ("bytes_per_request", t.bytes_per_request().round()),
        ("p_value", t.p_value),
    ];
    if let Some(g) = &heap {
        evidence.push(census_line(g, t.bytes_per_request()));
        evidence.extend(g.chain_line());
        metrics.push((
            "retained_type_bytes_per_request",
            g.top.bytes_per_request().round(),
        ));
    }
    if let Some((limit, name)) = f.host_limit() {
        let (line, m) = runway(
            &format!("{name} ({})", bytes_short(limit)),
            limit,
            t.last_bytes.max(0.0) as u64,
            t.bytes_per_request(),
        );
        evidence.push(line);
        metrics.extend(m);
    }
    evidence.push(
        "find what the process keeps on the host (a heap census, tracemalloc, growing Python lists or caches); more swap only slows the failure down"
            .to_string(),
    );
    let confidence = if f.failed { 0.7 } else { 0.6 };
    Some(cause("host_growth", confidence, evidence, &metrics))
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
