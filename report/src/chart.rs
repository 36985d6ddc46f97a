//! Inline SVG line charts of bytes over time, with request, phase and OOM
//! markers. Pure string building: no scripts, no external resources.

use std::fmt::Write;

use oomscope_analysis::units::bytes_short;

use super::escape::html;

/// Drawing size in SVG user units; the page scales it to its width.
const WIDTH: f64 = 1100.0;
const HEIGHT: f64 = 300.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 46.0;
const BOTTOM: f64 = 40.0;
/// A series longer than this is reduced to per-bucket minima and maxima, which
/// keeps its peaks and keeps the page small whatever the timeline's length.
pub const MAX_BUCKETS: usize = 600;
/// At most this many request markers are drawn (evenly thinned beyond it).
pub const MAX_REQUEST_MARKERS: usize = 200;

pub struct Series {
    pub name: String,
    /// A CSS colour.
    pub color: &'static str,
    /// (time in ns, bytes), in time order.
    pub points: Vec<(i64, u64)>,
    /// Limits and caps are dashed.
    pub dashed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkerKind {
    Request,
    Phase,
    Oom,
}

pub struct Marker {
    pub time_ns: i64,
    pub kind: MarkerKind,
    pub label: String,
}

pub struct Chart {
    /// A short key for the page's scripts and tests (`data-chart`).
    pub key: String,
    pub title: String,
    pub series: Vec<Series>,
    pub markers: Vec<Marker>,
    /// The time axis: the whole timeline, so every chart lines up.
    pub t0_ns: i64,
    pub t1_ns: i64,
}

/// Colours of the markers.
pub const OOM_COLOR: &str = "#d62728";
const REQUEST_COLOR: &str = "#b8b8b8";
const PHASE_COLOR: &str = "#4a6fa5";

/// The chart as an `<svg>` element.
pub fn svg(c: &Chart) -> String {
    let t0 = c.t0_ns;
    let span = (c.t1_ns - t0).max(1_000_000) as f64;
    let max = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .max()
        .unwrap_or(0)
        .max(1);
    let (step, unit) = y_step(max);
    let top_value = (max as f64 / step).ceil() * step;
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |t: i64| LEFT + ((t - t0) as f64 / span).clamp(0.0, 1.0) * plot_w;
    let y = |b: u64| TOP + plot_h - (b as f64 / top_value).min(1.0) * plot_h;

    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg class="chart" data-chart="{key}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img"><title>{title}</title>"#,
        key = html(&c.key),
        title = html(&c.title),
    );
    let _ = write!(
        out,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fbfbfd" stroke="#ccc"/>"##
    );
    let _ = write!(
        out,
        r##"<text x="{LEFT}" y="18" font-size="15" font-weight="bold" fill="#222">{}</text>"##,
        html(&c.title)
    );

    // Y grid and labels.
    let mut v = 0.0;
    while v <= top_value + step / 2.0 {
        let py = TOP + plot_h - v / top_value * plot_h;
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end" fill="#555">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            py + 4.0,
            html(&y_label(v, unit))
        );
        v += step;
    }
    // X ticks in seconds since the timeline began.
    let x_step = nice_step(span / 1e9 / 8.0);
    let mut s = 0.0;
    while s <= span / 1e9 + 1e-9 {
        let px = LEFT + s * 1e9 / span * plot_w;
        let _ = write!(
            out,
            r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#999"/><text x="{px:.1}" y="{:.1}" font-size="11" text-anchor="middle" fill="#555">{}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 5.0,
            TOP + plot_h + 18.0,
            seconds_label(s, x_step)
        );
        s += x_step;
    }
    let _ = write!(
        out,
        r##"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle" fill="#555">seconds since the timeline began</text>"##,
        LEFT + plot_w / 2.0,
        HEIGHT - 4.0
    );

    // Markers under the lines: requests, then phases, then OOMs on top.
    let requests: Vec<&Marker> = c
        .markers
        .iter()
        .filter(|m| m.kind == MarkerKind::Request)
        .collect();
    let stride = requests.len().div_ceil(MAX_REQUEST_MARKERS).max(1);
    for m in requests.iter().step_by(stride) {
        let px = x(m.time_ns);
        let _ = write!(
            out,
            r#"<line class="marker-request" x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="{REQUEST_COLOR}" stroke-width="1"><title>{}</title></line>"#,
            TOP + plot_h,
            html(&m.label)
        );
    }
    for (i, m) in c
        .markers
        .iter()
        .filter(|m| m.kind == MarkerKind::Phase)
        .enumerate()
    {
        let px = x(m.time_ns);
        // Alternate label heights: a load's start and end are often close.
        let label_y = TOP + plot_h - 4.0 - 13.0 * (i % 2) as f64;
        let right_half = px > LEFT + plot_w / 2.0;
        let _ = write!(
            out,
            r#"<line class="marker-phase" x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="{PHASE_COLOR}" stroke-dasharray="3 3"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="{}" fill="{PHASE_COLOR}">{}</text>"#,
            TOP + plot_h,
            if right_half { px - 3.0 } else { px + 3.0 },
            label_y,
            if right_half { "end" } else { "start" },
            html(&m.label)
        );
    }

    for s in &c.series {
        let pts = downsample(&s.points, MAX_BUCKETS);
        if pts.is_empty() {
            continue;
        }
        let mut path = String::new();
        for (i, (t, b)) in pts.iter().enumerate() {
            let _ = write!(
                path,
                "{}{:.1} {:.1}",
                if i == 0 { "M" } else { " L" },
                x(*t),
                y(*b)
            );
        }
        if pts.len() == 1 {
            // One reading: draw it as a dot so it shows.
            let (t, b) = pts[0];
            let _ = write!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                x(t),
                y(b),
                s.color
            );
        }
        let _ = write!(
            out,
            r#"<path class="series" data-series="{}" d="{path}" fill="none" stroke="{}" stroke-width="2.5"{}/>"#,
            html(&s.name),
            s.color,
            if s.dashed {
                r#" stroke-dasharray="8 5""#
            } else {
                ""
            }
        );
    }

    for m in c.markers.iter().filter(|m| m.kind == MarkerKind::Oom) {
        let px = x(m.time_ns);
        let _ = write!(
            out,
            r#"<line class="marker-oom" x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="{OOM_COLOR}" stroke-width="2.5"/><text x="{:.1}" y="{:.1}" font-size="12" font-weight="bold" text-anchor="end" fill="{OOM_COLOR}">{}</text>"#,
            TOP + plot_h,
            px - 4.0,
            TOP + 14.0,
            html(&m.label)
        );
    }

    // Legend along the top.
    let mut lx = LEFT;
    for s in &c.series {
        let _ = write!(
            out,
            r##"<rect x="{lx:.1}" y="28" width="14" height="4" fill="{}"/><text x="{:.1}" y="34" font-size="12" fill="#333">{}</text>"##,
            s.color,
            lx + 18.0,
            html(&s.name)
        );
        lx += 30.0 + 7.0 * s.name.chars().count() as f64;
    }
    out.push_str("</svg>");
    out
}

/// The page's key to the charts: one phrase per kind of marker (and for
/// dashed limits) that some chart draws, none for what no chart has.
pub fn legend(charts: &[Chart]) -> Vec<&'static str> {
    let has = |k: MarkerKind| charts.iter().any(|c| c.markers.iter().any(|m| m.kind == k));
    let mut out = Vec::new();
    if has(MarkerKind::Oom) {
        out.push("Red line: the failure.");
    }
    if has(MarkerKind::Request) {
        out.push("Grey ticks: requests.");
    }
    if has(MarkerKind::Phase) {
        out.push("Blue dashes: model load.");
    }
    if charts.iter().any(|c| c.series.iter().any(|s| s.dashed)) {
        out.push("Dashed lines: limits and caps.");
    }
    out
}

/// A grid step in bytes (1, 2 or 5 times a power of ten of a binary unit) and
/// the unit it is labelled in.
fn y_step(max: u64) -> (f64, u64) {
    let mut unit = 1u64;
    while unit < (1 << 40) && max / unit >= 1024 {
        unit <<= 10;
    }
    let in_unit = max as f64 / unit as f64;
    (nice_step(in_unit / 5.0) * unit as f64, unit)
}

/// The smallest of 1, 2, 5 × 10^k that is at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let pow = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * pow)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * pow)
}

fn y_label(v: f64, unit: u64) -> String {
    let name = match unit {
        1 => "B",
        0x400 => "KiB",
        0x10_0000 => "MiB",
        0x4000_0000 => "GiB",
        _ => "TiB",
    };
    let n = v / unit as f64;
    if n.fract().abs() < 1e-9 {
        format!("{n:.0} {name}")
    } else {
        format!("{n:.1} {name}")
    }
}

fn seconds_label(s: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{s:.0}")
    } else {
        let digits = (-step.log10()).ceil().max(1.0) as usize;
        format!("{s:.digits$}")
    }
}

/// At most `2 * buckets` points: each time bucket's minimum and maximum, in
/// time order, so that peaks survive.
pub fn downsample(points: &[(i64, u64)], buckets: usize) -> Vec<(i64, u64)> {
    if points.len() <= 2 * buckets || buckets == 0 {
        return points.to_vec();
    }
    let (t0, t1) = (points[0].0, points[points.len() - 1].0);
    let span = (t1 - t0).max(1) as f64;
    let mut out = Vec::with_capacity(2 * buckets);
    let mut i = 0;
    while i < points.len() {
        let b = (((points[i].0 - t0) as f64 / span) * buckets as f64) as usize;
        let mut j = i;
        let (mut lo, mut hi) = (points[i], points[i]);
        while j < points.len()
            && (((points[j].0 - t0) as f64 / span) * buckets as f64) as usize == b
        {
            if points[j].1 < lo.1 {
                lo = points[j];
            }
            if points[j].1 > hi.1 {
                hi = points[j];
            }
            j += 1;
        }
        if lo.0 <= hi.0 {
            out.push(lo);
            if hi != lo {
                out.push(hi);
            }
        } else {
            out.push(hi);
            out.push(lo);
        }
        i = j;
    }
    out
}

/// "96.0 MiB" for a marker or legend.
pub fn short(bytes: u64) -> String {
    bytes_short(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downsampling_keeps_the_peak_and_bounds_the_size() {
        let mut pts: Vec<(i64, u64)> = (0..10_000).map(|i| (i as i64, 100)).collect();
        pts[4321].1 = 9_999;
        let d = downsample(&pts, 100);
        assert!(d.len() <= 200, "{}", d.len());
        assert!(d.contains(&(4321, 9_999)));
        assert!(d.windows(2).all(|w| w[0].0 <= w[1].0), "time order");
    }

    #[test]
    fn steps_are_round_in_binary_units() {
        assert_eq!(y_step(2 << 30), (0.5 * (1u64 << 30) as f64, 1 << 30));
        assert_eq!(y_step(800 << 20), (200.0 * (1u64 << 20) as f64, 1 << 20));
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(7.0), 10.0);
    }

    #[test]
    fn the_legend_names_only_what_is_drawn() {
        let chart = |markers: Vec<Marker>, dashed: bool| Chart {
            key: "k".into(),
            title: "t".into(),
            series: vec![Series {
                name: "rss".into(),
                color: "#000",
                points: vec![(0, 1)],
                dashed,
            }],
            markers,
            t0_ns: 0,
            t1_ns: 10,
        };
        let failure = || Marker {
            time_ns: 5,
            kind: MarkerKind::Oom,
            label: "failure".into(),
        };
        assert_eq!(
            legend(&[chart(vec![failure()], false)]),
            ["Red line: the failure."]
        );
        assert!(legend(&[chart(vec![], false)]).is_empty());
        let both = legend(&[
            chart(vec![], true),
            chart(
                vec![Marker {
                    time_ns: 1,
                    kind: MarkerKind::Request,
                    label: "r".into(),
                }],
                false,
            ),
        ]);
        assert_eq!(
            both,
            ["Grey ticks: requests.", "Dashed lines: limits and caps."]
        );
    }

    #[test]
    fn labels_are_escaped() {
        let c = Chart {
            key: "k".into(),
            title: "<script>alert(1)</script>".into(),
            series: vec![Series {
                name: "a&b".into(),
                color: "#000",
                points: vec![(0, 1), (10, 2)],
                dashed: false,
            }],
            markers: vec![Marker {
                time_ns: 5,
                kind: MarkerKind::Oom,
                label: "\"x\"".into(),
            }],
            t0_ns: 0,
            t1_ns: 10,
        };
        let s = svg(&c);
        assert!(!s.contains("<script>"));
        assert!(s.contains("&lt;script&gt;"));
        assert!(s.contains("a&amp;b"));
        assert!(s.contains("&quot;x&quot;"));
    }
}
