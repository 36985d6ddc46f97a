//! One chart per memory domain the timeline has readings for: each GPU's
//! allocator and driver view, the process's RSS, its cgroup against the
//! limit, and system RAM and swap. All share the time axis and the markers.

use crate::pb;
use crate::pb::event::Kind;

use super::chart::{short, Chart, Marker, MarkerKind, Series};

const ALLOCATED: &str = "#1f77b4";
const RESERVED: &str = "#ff7f0e";
const DRIVER_USED: &str = "#7f7f7f";
const KV: &str = "#2ca02c";
const LIMIT: &str = "#d62728";
const RSS: &str = "#9467bd";
const CGROUP: &str = "#8c564b";
const SYSTEM_USED: &str = "#17becf";
const SWAP: &str = "#bcbd22";

/// The charts, in domain order (GPU first); none for a domain without readings.
pub fn charts(t: &pb::TimelineResponse, failure: Option<&pb::Failure>) -> Vec<Chart> {
    let hello = t.hello.clone().unwrap_or_default();
    let readings: Vec<&pb::Sample> = t.samples.iter().filter_map(|s| s.sample.as_ref()).collect();
    // What the lines go through: each reading, and where it stands for a
    // stretch of thinned history, that stretch's lowest and highest figures
    // at the same time (a vertical stroke), so no spike falls between points.
    let samples: Vec<&pb::Sample> = t
        .samples
        .iter()
        .flat_map(|s| [s.low.as_ref(), s.sample.as_ref(), s.high.as_ref()])
        .flatten()
        .collect();
    let events: Vec<&pb::Event> = t.events.iter().filter_map(|e| e.event.as_ref()).collect();
    let times = readings
        .iter()
        .map(|s| s.time_ns)
        .chain(events.iter().map(|e| e.time_ns))
        .chain(failure.map(|f| f.time_ns));
    let (t0, t1) = times.fold((i64::MAX, i64::MIN), |(lo, hi), t| (lo.min(t), hi.max(t)));
    if t0 > t1 {
        return Vec::new();
    }
    let markers = || markers(&readings, &events, failure);
    let chart = |key: String, title: String, series: Vec<Series>| Chart {
        key,
        title,
        series,
        markers: markers(),
        t0_ns: t0,
        t1_ns: t1,
    };
    let mut out = Vec::new();

    let mut devices: Vec<i32> = samples
        .iter()
        .flat_map(|s| s.allocator.iter().map(|a| a.device))
        .collect();
    devices.sort_unstable();
    devices.dedup();
    for dev in devices {
        let stats = |f: fn(&pb::AllocatorStats) -> u64| -> Vec<(i64, u64)> {
            samples
                .iter()
                .filter_map(|s| {
                    let a = s.allocator.iter().find(|a| a.device == dev)?;
                    Some((s.time_ns, f(a)))
                })
                .collect()
        };
        let mut series = vec![
            line("allocated", ALLOCATED, stats(|a| a.allocated_bytes)),
            line("reserved", RESERVED, stats(|a| a.reserved_bytes)),
        ];
        let driver: Vec<(i64, u64)> = samples
            .iter()
            .filter_map(|s| {
                let a = s.allocator.iter().find(|a| a.device == dev)?;
                (a.driver_total_bytes > 0).then(|| {
                    (
                        s.time_ns,
                        a.driver_total_bytes.saturating_sub(a.driver_free_bytes),
                    )
                })
            })
            .collect();
        let kv: Vec<(i64, u64)> = samples
            .iter()
            .filter_map(|s| Some((s.time_ns, s.context.as_ref()?.kv_cache_bytes)))
            .filter(|p| p.1 > 0)
            .collect();
        if !kv.is_empty() {
            series.push(line("KV cache", KV, kv));
        }
        let cap = hello
            .gpus
            .iter()
            .find(|g| g.index == dev)
            .map(|g| g.cap_bytes)
            .filter(|&c| c > 0);
        // The device total dwarfs a small cap: plot the driver's view only
        // when no cap is set, or when it is within sight of the cap.
        let driver_max = driver.iter().map(|p| p.1).max().unwrap_or(0);
        if !driver.is_empty() && cap.is_none_or(|c| driver_max <= c.saturating_mul(2)) {
            series.push(line("driver used (all processes)", DRIVER_USED, driver));
        }
        if let Some(c) = cap {
            series.push(limit("per-process cap", c, t0, t1));
        }
        out.push(chart(
            format!("gpu{dev}"),
            format!("GPU {dev}: PyTorch allocator and driver"),
            series,
        ));
    }

    let rss: Vec<(i64, u64)> = samples
        .iter()
        .filter_map(|s| Some((s.time_ns, s.process.as_ref()?.vm_rss_bytes)))
        .filter(|p| p.1 > 0)
        .collect();
    if !rss.is_empty() {
        out.push(chart(
            "host_rss".into(),
            "Process: host RSS".into(),
            vec![line("host RSS", RSS, rss)],
        ));
    }

    let usage: Vec<(i64, u64)> = samples
        .iter()
        .filter_map(|s| Some((s.time_ns, s.cgroup.first()?.usage_bytes)))
        .collect();
    if !usage.is_empty() {
        let tightest = samples
            .iter()
            .flat_map(|s| s.cgroup.iter().map(|c| c.limit_bytes))
            .chain(hello.cgroup.as_ref().map(|c| c.limit_bytes))
            .filter(|&l| oomscope_analysis::is_finite_limit(l))
            .min();
        let mut series = vec![line("cgroup usage", CGROUP, usage)];
        if let Some(l) = tightest {
            series.push(limit("cgroup limit", l, t0, t1));
        }
        out.push(chart(
            "cgroup".into(),
            "Cgroup: usage against its limit".into(),
            series,
        ));
    }

    let system: Vec<&pb::Sample> = samples
        .iter()
        .copied()
        .filter(|s| s.system.as_ref().is_some_and(|m| m.mem_total_bytes > 0))
        .collect();
    if !system.is_empty() {
        let get = |f: fn(&pb::SystemMemory) -> u64| -> Vec<(i64, u64)> {
            system
                .iter()
                .filter_map(|s| Some((s.time_ns, f(s.system.as_ref()?))))
                .collect()
        };
        let mut series = vec![line(
            "RAM used (total − available)",
            SYSTEM_USED,
            get(|m| m.mem_total_bytes.saturating_sub(m.mem_available_bytes)),
        )];
        let swap = get(|m| m.swap_total_bytes.saturating_sub(m.swap_free_bytes));
        if swap.iter().any(|p| p.1 > 0) {
            series.push(line("swap used", SWAP, swap));
        }
        let total = system
            .last()
            .and_then(|s| s.system.as_ref())
            .map_or(0, |m| m.mem_total_bytes);
        series.push(limit("RAM total", total, t0, t1));
        out.push(chart(
            "system".into(),
            "System: RAM and swap".into(),
            series,
        ));
    }
    out
}

fn line(name: &str, color: &'static str, points: Vec<(i64, u64)>) -> Series {
    Series {
        name: name.into(),
        color,
        points,
        dashed: false,
    }
}

fn limit(name: &str, bytes: u64, t0: i64, t1: i64) -> Series {
    Series {
        name: format!("{name} {}", short(bytes)),
        color: LIMIT,
        points: vec![(t0, bytes), (t1, bytes)],
        dashed: true,
    }
}

/// OOMs and the failure, load phases, and requests: boundary events where the
/// agent sent them, else each rise of the context's `requests_done`.
fn markers(
    samples: &[&pb::Sample],
    events: &[&pb::Event],
    failure: Option<&pb::Failure>,
) -> Vec<Marker> {
    let mut out = Vec::new();
    let mut boundaries = false;
    for e in events {
        match &e.kind {
            Some(Kind::Oom(o)) => out.push(Marker {
                time_ns: e.time_ns,
                kind: MarkerKind::Oom,
                label: if o.requested_bytes > 0 {
                    format!("OOM: {} requested", short(o.requested_bytes))
                } else {
                    "OOM".into()
                },
            }),
            Some(Kind::Phase(p)) => out.push(Marker {
                time_ns: e.time_ns,
                kind: MarkerKind::Phase,
                label: format!("{} {}", p.name, if p.start { "start" } else { "end" }),
            }),
            Some(Kind::Request(r)) if r.start => {
                boundaries = true;
                out.push(Marker {
                    time_ns: e.time_ns,
                    kind: MarkerKind::Request,
                    label: format!("request {}", r.request_id),
                });
            }
            _ => {}
        }
    }
    // An OOM event has its marker above; any other failure gets one here.
    if let Some(f) = failure.filter(|f| f.oom_device.is_none()) {
        out.push(Marker {
            time_ns: f.time_ns,
            kind: MarkerKind::Oom,
            label: format!("failure ({})", f.kind),
        });
    }
    if !boundaries {
        let mut done = 0;
        for s in samples {
            let n = s.context.as_ref().map_or(0, |c| c.requests_done);
            if n > done {
                out.push(Marker {
                    time_ns: s.time_ns,
                    kind: MarkerKind::Request,
                    label: format!("{n} requests done"),
                });
                done = n;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rss(t: i64, mib: u64) -> pb::Sample {
        pb::Sample {
            time_ns: t,
            process: Some(pb::ProcessMemory {
                vm_rss_bytes: mib << 20,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_thinned_points_envelope_is_drawn_at_its_time() {
        let point = |t: i64, low: u64, high: u64| pb::TimedSample {
            seq: t as u64,
            sample: Some(rss(t, 100)),
            low: Some(rss(t, low)),
            high: Some(rss(t, high)),
        };
        let t = pb::TimelineResponse {
            samples: vec![point(1, 100, 100), point(2, 40, 900), point(3, 100, 100)],
            ..Default::default()
        };
        let charts = charts(&t, None);
        let host = charts.iter().find(|c| c.key == "host_rss").unwrap();
        let points = &host.series[0].points;
        assert!(points.contains(&(2, 900 << 20)), "{points:?}");
        assert!(points.contains(&(2, 40 << 20)), "{points:?}");
        // Only real readings set the time axis and the markers.
        assert_eq!((host.t0_ns, host.t1_ns), (1, 3));
    }
}
