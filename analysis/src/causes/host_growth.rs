//! Host growth: the process's RSS (or its cgroup's usage) rises with completed
//! requests while the device's live bytes stay flat.

use super::cause;
use super::leak::growth_line;
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::growth;
use crate::pb;
use crate::timeline::Point;
use crate::trigger::{MIN_LEAK_BYTES_PER_REQUEST, MIN_LEAK_GROWTH_BYTES};
use crate::units::bytes_short;

/// Host memory moves in pages and arenas: less than this per request is not
/// worth a verdict...
pub const MIN_HOST_BYTES_PER_REQUEST: f64 = (1u64 << 20) as f64;
/// ...nor less than this over the readings seen.
pub const MIN_HOST_GROWTH_BYTES: f64 = (32u64 << 20) as f64;

pub fn host_growth(f: &Findings, _: &DomainVerdict) -> Option<pb::Cause> {
    let gpu_grows = growth::live_baseline(&f.timeline)
        .is_some_and(|t| t.grows(MIN_LEAK_BYTES_PER_REQUEST, MIN_LEAK_GROWTH_BYTES));
    if gpu_grows {
        return None;
    }
    let series = |v: fn(&Point) -> Option<u64>| {
        growth::trend(&host_series(f, v))
            .filter(|t| t.grows(MIN_HOST_BYTES_PER_REQUEST, MIN_HOST_GROWTH_BYTES))
    };
    let (what, t, limit) = if let Some(t) = series(|p| p.rss) {
        let limit = host_limit(f);
        ("host RSS", t, limit)
    } else {
        let t = series(|p| p.cgroup_usage)?;
        ("cgroup usage", t, host_limit(f))
    };
    let mut evidence = vec![growth_line(what, &t)];
    if f.timeline.device().next().is_some() {
        evidence.push("device live bytes between requests stayed flat".to_string());
    }
    let mut metrics = vec![
        ("bytes_per_request", t.bytes_per_request().round()),
        ("p_value", t.p_value),
    ];
    if let Some((limit, name)) = limit {
        let left =
            limit.saturating_sub(t.last_bytes.max(0.0) as u64) as f64 / t.bytes_per_request();
        evidence.push(format!(
            "at this rate {name} ({}) is reached in about {} more requests",
            bytes_short(limit),
            left.floor()
        ));
        metrics.push(("requests_to_limit", left.floor()));
        metrics.push(("limit_bytes", limit as f64));
    }
    evidence.push(
        "find what the process keeps on the host (a heap census, tracemalloc, growing Python lists or caches); more swap only slows the failure down"
            .to_string(),
    );
    let confidence = if f.failed { 0.7 } else { 0.6 };
    Some(cause("host_growth", confidence, evidence, &metrics))
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

/// The host limit that growth runs into: the tightest cgroup limit, else MemTotal.
fn host_limit(f: &Findings) -> Option<(u64, &'static str)> {
    if let Some(l) = f.timeline.points.iter().rev().find_map(|p| p.cgroup_limit) {
        return Some((l, "the cgroup limit"));
    }
    f.evidence
        .last_system()
        .map(|s| s.mem_total_bytes)
        .filter(|&t| t > 0)
        .map(|t| (t, "MemTotal"))
}
