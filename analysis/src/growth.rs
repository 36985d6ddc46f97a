//! Does a series grow with completed requests? The test behind leak,
//! host_growth, gc_retained and the repeated_requests trigger.
//!
//! Growth is a Theil–Sen slope (robust to one request's temporaries caught by
//! a sample), judged by Mann–Kendall (order only, so allocator steps do not
//! fool it), and it must persist: the later half of the requests must still
//! grow at half the overall rate, and at an eighth of the earlier half's.
//! Warm-up growth that plateaus (caches filling, first-call workspaces), or
//! settles into a creep many times slower than its start, fails that check.

use crate::stats::{self, Line};
use crate::timeline::{Point, Timeline};
use crate::units::bytes_short;

/// Fewer between-request readings than this say nothing about a trend: with
/// 8 points even a perfect rise only just reaches the significance level.
pub const MIN_TREND_POINTS: usize = 8;

/// One-sided Mann–Kendall significance for "it grows". Small, because a
/// false leak verdict sends people hunting for nothing: on noise alone about
/// one timeline in two thousand passes, before the effect-size, noise and
/// persistence checks cut that further.
pub const TREND_P_VALUE: f64 = 5e-4;

/// The later half of the requests must grow at least this share of the
/// overall slope; a warm-up that levels off does not.
pub const PERSISTENCE: f64 = 0.5;

/// ...and at least this share of the earlier half's slope. A series whose
/// first half rose more than eight times faster than its later half is
/// settling, though it still creeps up: a clean Python loop's RSS rises
/// 30 to 55 KiB a request over its first 200 requests (warm-up, then the
/// first heap census's scratch, kept by the allocator), then 0 to 3 KiB
/// (a later half/earlier half ratio of 0.04 to 0.08 in real runs). A
/// steady leak keeps a ratio near 1; behind a warm-up as steep as the
/// property tests' (up to 40 requests at twelve times the leak), 0.18 or
/// more at 200 requests.
pub const MIN_LATER_SHARE_OF_EARLIER: f64 = 0.125;

/// The growth over the window must be at least this many times the scatter
/// of the readings around the line (a robust sigma, from the median absolute
/// residual): a significant but small drift inside wide noise is no verdict.
pub const MIN_SIGNAL_TO_NOISE: f64 = 3.0;

/// A leak worth naming grows at least this much per request...
pub const MIN_LEAK_BYTES_PER_REQUEST: f64 = (64u64 << 10) as f64;
/// ...and at least this much over the readings seen.
pub const MIN_LEAK_GROWTH_BYTES: f64 = (16u64 << 20) as f64;

/// A host reading (RSS, a cgroup's usage) must grow at least this much over
/// its window to be any verdict. Below it, growth is the allocators' grain
/// rather than the server's: glibc pads its heap by 128 KiB, pymalloc takes
/// 1 MiB arenas, and a clean torch loop's RSS creeps 1 to 2 MiB over 400
/// requests after its warm-up (measured, `test_slow_leak.py`), in steps
/// with equal readings between them, so their scatter is no guard. A real
/// slow leak crosses it in time: 2 KiB a request within 2,000 requests.
pub const MIN_HOST_GROWTH_BYTES: f64 = (4u64 << 20) as f64;

/// A collection gave back growth when it freed at least this share of what
/// the baseline had gained: then the growth was garbage, not a leak.
pub const RECLAIMED_SHARE: f64 = 0.5;

/// Pairwise statistics are O(n²): longer series are thinned evenly to this
/// many points first (200k pairs), which keeps a long leak hunt fast and
/// bounded in memory without moving a robust slope.
pub const MAX_FIT_POINTS: usize = 640;

/// A fitted trend of bytes against completed requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Trend {
    pub points: usize,
    /// Requests between the first and last reading.
    pub span: f64,
    pub line: Line,
    pub p_value: f64,
    /// The Theil–Sen slope over the later half of the requests.
    pub later_slope: f64,
    /// The Theil–Sen slope over the earlier half of the requests.
    pub earlier_slope: f64,
    pub first_bytes: f64,
    pub last_bytes: f64,
    /// 1.4826 × the median absolute residual: the noise's sigma, robustly.
    pub residual_sigma: f64,
}

impl Trend {
    pub fn bytes_per_request(&self) -> f64 {
        self.line.slope
    }

    /// Significant, persistent, and at least the given effect: `min_slope`
    /// bytes per request and `min_growth` bytes over the window.
    pub fn grows(&self, min_slope: f64, min_growth: f64) -> bool {
        self.points >= MIN_TREND_POINTS
            && self.p_value < TREND_P_VALUE
            && self.line.slope >= min_slope
            && self.line.slope * self.span >= min_growth
            && self.line.slope * self.span >= MIN_SIGNAL_TO_NOISE * self.residual_sigma
            && self.later_slope >= PERSISTENCE * self.line.slope
            && self.later_slope >= MIN_LATER_SHARE_OF_EARLIER * self.earlier_slope
    }

    /// Certain growth of any size: significant, above the noise, still
    /// rising in the later half and not settling. Whether it matters is the runway's call.
    pub fn certain(&self) -> bool {
        self.grows(f64::MIN_POSITIVE, 0.0)
    }

    /// Certain, and past the host's grain (`MIN_HOST_GROWTH_BYTES`).
    pub fn host_certain(&self) -> bool {
        self.grows(f64::MIN_POSITIVE, MIN_HOST_GROWTH_BYTES)
    }

    /// Grows enough to be named a leak (the device's live bytes, or a trigger).
    pub fn leaks(&self) -> bool {
        self.grows(MIN_LEAK_BYTES_PER_REQUEST, MIN_LEAK_GROWTH_BYTES)
    }

    /// "between requests {what} rose from A to B over N requests: ..."
    pub fn rise_line(&self, what: &str) -> String {
        format!(
            "between requests {what} rose from {} to {} over {} requests: {} per request (Theil–Sen over {} readings; Mann–Kendall p = {:.1e}; still rising in the later half)",
            bytes_short(self.first_bytes.max(0.0) as u64),
            bytes_short(self.last_bytes.max(0.0) as u64),
            self.span,
            bytes_short(self.bytes_per_request().max(0.0).round() as u64),
            self.points,
            self.p_value
        )
    }
}

/// The trend of `(requests_done, bytes)` points. None with too few distinct
/// request counts to fit.
pub fn trend(points: &[(f64, f64)]) -> Option<Trend> {
    let pts = thin(points, MAX_FIT_POINTS);
    let line = stats::theil_sen(&pts)?;
    let mk = stats::mann_kendall(&pts)?;
    let xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    let (lo, hi) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    let mid = stats::median(&xs)?;
    let later: Vec<(f64, f64)> = pts.iter().copied().filter(|p| p.0 >= mid).collect();
    let later_slope = stats::theil_sen(&later).map_or(0.0, |l| l.slope);
    let earlier: Vec<(f64, f64)> = pts.iter().copied().filter(|p| p.0 <= mid).collect();
    let earlier_slope = stats::theil_sen(&earlier).map_or(0.0, |l| l.slope);
    let residuals: Vec<f64> = pts.iter().map(|p| (p.1 - line.at(p.0)).abs()).collect();
    // 1.4826: the median absolute deviation of a normal is 0.6745 sigma.
    let residual_sigma = 1.4826 * stats::median(&residuals)?;
    Some(Trend {
        points: pts.len(),
        span: hi - lo,
        line,
        p_value: mk.p_increasing,
        later_slope,
        earlier_slope,
        first_bytes: pts.first()?.1,
        last_bytes: pts.last()?.1,
        residual_sigma,
    })
}

/// Between-request readings of one quantity against completed requests,
/// stopping at the first collection (what a collection frees is judged by
/// gc_retained, not here).
pub fn baseline_series(tl: &Timeline, value: impl Fn(&Point) -> Option<u64>) -> Vec<(f64, f64)> {
    let stop = first_collection(tl);
    tl.points
        .iter()
        .filter(|p| p.is_baseline() && stop.is_none_or(|t| p.time_ns < t))
        .filter_map(|p| value(p).map(|v| (p.requests_done as f64, v as f64)))
        .collect()
}

/// The live (allocated) bytes between requests.
pub fn live_baseline(tl: &Timeline) -> Option<Trend> {
    trend(&baseline_series(tl, |p| {
        p.has_allocator.then_some(p.allocated)
    }))
}

/// This process's device memory as NVML lists it, between requests: the
/// device's series where no allocator is read (`Point::device_used`).
pub fn nvml_baseline(tl: &Timeline) -> Option<Trend> {
    trend(&baseline_series(tl, |p| p.device_used))
}

/// When the first garbage collection was seen: a GcCollection event that
/// collected something, or an `after_gc_collect` reading.
pub fn first_collection(tl: &Timeline) -> Option<i64> {
    let from_samples = tl
        .points
        .iter()
        .find(|p| p.is_after_gc())
        .map(|p| p.time_ns);
    tl.gc_times.iter().copied().chain(from_samples).min()
}

/// Every k-th point so at most `max` remain (the last always kept).
pub fn thin(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 2 {
        return points.to_vec();
    }
    let step = points.len().div_ceil(max);
    let mut out: Vec<(f64, f64)> = points.iter().copied().step_by(step).collect();
    if out.last() != points.last() {
        out.push(*points.last().unwrap_or(&(0.0, 0.0)));
    }
    out
}
