//! Warm-up is not an alarm, and a verdict stays put while its growth does.
//!
//! A process's first requests fill caches, arenas and first-call
//! workspaces. Growth read while the newest reading is still inside that
//! window keeps its kind (`host_growth`, `leak`) but with low confidence,
//! labelled possible warm-up, and without a runway. Past the window the
//! usual rules apply over the whole series, and the growth must also show in
//! the readings past the window before it gets its runway. Growth that has
//! stopped (a plateau over the recent requests) is warm-up when it never
//! showed past the window; when it did, the verdict stays and says where it
//! stopped, instead of vanishing as soon as the fit over the whole series
//! gives up.
//!
//! The plateau is read over many requests (at least [`MIN_PLATEAU_REQUESTS`]),
//! never from the newest few: a leak that keeps one request in ten is flat
//! for nine requests at a time and must not be withdrawn in between.

use crate::evidence::Evidence;
use crate::growth::{self, Trend, MAX_FIT_POINTS, MIN_TREND_POINTS, PERSISTENCE};
use crate::stats;
use crate::timeline::Timeline;
use crate::units::bytes_short;

/// The warm-up window's length in requests: a server's first-call
/// workspaces, caches and arenas fill over its first tens of requests (a
/// clean Python loop's RSS rises over its first 10 to 40). Short enough
/// that a leak at 36 requests/s is named with its runway within 100.
pub const WARMUP_REQUESTS: u64 = 50;

/// ...or in time, whichever ends first: a slow server's start is its first
/// 30 seconds (the window growth against time leaves out, for the same
/// imports and pools), however few requests it served in them.
pub const WARMUP_NS: i64 = crate::time_growth::WARMUP_NS;

/// A plateau is read over at least this many requests: twice the gap
/// between the leaking requests of a 1-in-10 leak, so its flat stretches
/// between steps never read as growth that stopped...
pub const MIN_PLATEAU_REQUESTS: f64 = 20.0;

/// ...and over at least this share of the requests seen: a long growth
/// must stay flat for a while before it is called stopped.
pub const PLATEAU_SHARE_OF_SPAN: f64 = 0.25;

/// Flat: the recent requests grow at most this share of the growth before
/// them (Theil–Sen slopes); the noise of a flat series' slope stays well
/// under it, a leak's steps well over it.
pub const PLATEAU_SLOPE_SHARE: f64 = 0.2;

/// The readings past the window must rise at this one-sided Mann–Kendall
/// level: loose, since the whole series already passed the trend's level
/// (`growth::TREND_P_VALUE`); a flat stretch past a warm-up does not.
pub const PAST_P_VALUE: f64 = 0.01;

/// A growth that may be warm-up, or that stopped, explains little: far
/// below a standing growth's 0.6 to 0.9, level with slow growth.
pub const WARMUP_CONFIDENCE: f64 = 0.3;

/// What a growth in warm-up is labelled; its evidence line starts with it.
pub const POSSIBLE_WARMUP: &str = "possible warm-up";

/// What a growth that stopped says first.
pub const GROWTH_STOPPED: &str = "the growth stopped";

/// The metric that marks a growth that may be warm-up (1) ...
pub const WARMUP_METRIC: &str = "possible_warmup";
/// ...and the request count at which a growth stopped.
pub const STOPPED_METRIC: &str = "stopped_at_request";

/// Where a growth stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stage {
    /// The newest reading is inside the warm-up window, or the growth has
    /// not yet shown in the readings past it.
    PossibleWarmUp,
    /// Grows past the window: the usual verdict, with its runway.
    Growing,
    /// Grew past the window, then levelled off.
    Stopped(Stop),
}

/// Where a growth stopped, and how flat it has been since.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stop {
    /// The first reading at the plateau's level (its median).
    pub at_requests: f64,
    /// The requests the plateau was read over.
    pub flat_requests: f64,
    /// Their Theil–Sen slope, bytes per request.
    pub flat_slope: f64,
}

/// The process's warm-up window: its first [`WARMUP_REQUESTS`] requests or
/// its first [`WARMUP_NS`], whichever ends first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    /// Requests completed when the window ended (or now, inside it).
    pub requests: u64,
    /// The process's start: the agent's, else the first reading.
    pub start_ns: i64,
}

impl Window {
    pub fn of(e: &Evidence, tl: &Timeline) -> Window {
        let first = tl.points.first().map_or(0, |p| p.time_ns);
        let start_ns = e
            .hello
            .as_ref()
            .map(|h| h.start_time_ns)
            .filter(|&t| t > 0 && t <= first)
            .unwrap_or(first);
        let by_time = tl
            .points
            .iter()
            .filter(|p| p.time_ns <= start_ns.saturating_add(WARMUP_NS))
            .map(|p| p.requests_done)
            .max()
            .unwrap_or(0);
        Window {
            requests: WARMUP_REQUESTS.min(by_time),
            start_ns,
        }
    }

    /// Seconds after the start when the timeline first counted `requests`.
    pub fn seconds_at(&self, tl: &Timeline, requests: f64) -> Option<f64> {
        tl.points
            .iter()
            .find(|p| p.requests_done as f64 >= requests)
            .map(|p| (p.time_ns - self.start_ns) as f64 / 1e9)
    }

    /// "possible warm-up: ..." for a growth in [`Stage::PossibleWarmUp`].
    pub fn warmup_line(&self) -> String {
        format!(
            "{POSSIBLE_WARMUP}: the warm-up window ended at request {} (the first {WARMUP_REQUESTS} requests or {} s, whichever ends first), and the growth does not yet show in the readings past it; no runway until it does",
            self.requests,
            WARMUP_NS / 1_000_000_000
        )
    }

    /// "the growth stopped at about request 150 (4.2 s after the start): ..."
    pub fn stopped_line(&self, tl: &Timeline, s: &Stop, before: &Trend) -> String {
        let when = self
            .seconds_at(tl, s.at_requests)
            .map_or(String::new(), |t| format!(" ({t:.1} s after the start)"));
        format!(
            "{GROWTH_STOPPED} at about request {}{when}: flat over the last {:.0} requests ({} per request, against {} before); no runway while it stays flat",
            s.at_requests,
            s.flat_requests,
            signed_bytes(s.flat_slope),
            bytes_short(before.bytes_per_request().max(0.0).round() as u64),
        )
    }
}

fn signed_bytes(b: f64) -> String {
    let sign = if b < 0.0 { "-" } else { "+" };
    format!("{sign}{}", bytes_short(b.abs().round() as u64))
}

/// A growth's trend and stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Assessed {
    /// Over the whole series, or up to where it stopped.
    pub trend: Trend,
    pub stage: Stage,
}

/// The growth of `(requests_done, bytes)` readings as `accept` (the cause's
/// own test: `Trend::host_certain`, `Trend::leaks`) judges it, placed
/// against the warm-up window; None where nothing grows, or where a growth
/// that never showed past the window has levelled off (warm-up).
///
/// `window` None: a series with no warm-up to allow for (the device's live
/// tensors between requests, which a warm-up does not raise: a runtime's
/// caches and workspaces fill the reserved bytes, not the allocated ones),
/// read as before, but said to have stopped once it levels off after
/// growing for more than [`WARMUP_REQUESTS`].
pub fn assess(
    series: &[(f64, f64)],
    window: Option<&Window>,
    accept: impl Fn(&Trend) -> bool,
) -> Option<Assessed> {
    let last = series.last()?.0;
    let whole = growth::trend(series).filter(&accept);
    let Some(window) = window else {
        // Stopped only after growing longer than any warm-up lasts; a
        // shorter rise that levelled off is read as before.
        let first = series.first()?.0;
        let stopped = plateau(series, &accept)
            .filter(|(_, stop)| stop.at_requests - first > WARMUP_REQUESTS as f64);
        if let Some((trend, stop)) = stopped {
            return Some(Assessed {
                trend,
                stage: Stage::Stopped(stop),
            });
        }
        return whole.map(|trend| Assessed {
            trend,
            stage: Stage::Growing,
        });
    };
    if last <= window.requests as f64 {
        return whole
            .or_else(|| held_since(series, &accept))
            .map(|trend| Assessed {
                trend,
                stage: Stage::PossibleWarmUp,
            });
    }
    if let Some((before, stop)) = plateau(series, &accept) {
        let upto: Vec<(f64, f64)> = series
            .iter()
            .copied()
            .filter(|p| p.0 <= stop.at_requests)
            .collect();
        return shown_past(&upto, window, &before).then_some(Assessed {
            trend: before,
            stage: Stage::Stopped(stop),
        });
    }
    let trend = whole?;
    let stage = if shown_past(series, window, &trend) {
        Stage::Growing
    } else {
        Stage::PossibleWarmUp
    };
    Some(Assessed { trend, stage })
}

/// A growth `accept` took over an earlier part of `series` whose level the
/// readings since have kept: a step leak's flat stretch between two steps
/// (nine requests of a 1-in-10 leak) weakens the whole trend, but takes
/// nothing back, so the growth said at request 27 is still said at 28.
/// Readings that fell back below it (memory given back) end it.
fn held_since(series: &[(f64, f64)], accept: &impl Fn(&Trend) -> bool) -> Option<Trend> {
    let series = growth::thin(series, MAX_FIT_POINTS);
    (MIN_TREND_POINTS..series.len()).rev().find_map(|end| {
        let trend = growth::trend(&series[..end]).filter(accept)?;
        let reached: Vec<f64> = series[end.saturating_sub(MIN_TREND_POINTS)..end]
            .iter()
            .map(|p| p.1)
            .collect();
        let since: Vec<f64> = series[end..].iter().map(|p| p.1).collect();
        (stats::median(&since)? >= stats::median(&reached)?).then_some(trend)
    })
}

/// A plateau over the recent requests after a growth `accept` takes: the
/// growth's trend up to the plateau's level, and the plateau.
fn plateau(series: &[(f64, f64)], accept: &impl Fn(&Trend) -> bool) -> Option<(Trend, Stop)> {
    let (first, last) = (series.first()?.0, series.last()?.0);
    let flat_requests = MIN_PLATEAU_REQUESTS.max(PLATEAU_SHARE_OF_SPAN * (last - first));
    let tail: Vec<(f64, f64)> = series
        .iter()
        .copied()
        .filter(|p| p.0 >= last - flat_requests)
        .collect();
    if tail.len() < MIN_TREND_POINTS || tail.len() == series.len() {
        return None;
    }
    let tail = growth::thin(&tail, MAX_FIT_POINTS);
    let levels: Vec<f64> = tail.iter().map(|p| p.1).collect();
    let level = stats::median(&levels)?;
    let at_requests = series.iter().find(|p| p.1 >= level)?.0;
    let before: Vec<(f64, f64)> = series
        .iter()
        .copied()
        .filter(|p| p.0 <= at_requests)
        .collect();
    let before = growth::trend(&before).filter(accept)?;
    let flat_slope = stats::theil_sen(&tail)?.slope;
    (flat_slope <= PLATEAU_SLOPE_SHARE * before.line.slope).then_some((
        before,
        Stop {
            at_requests,
            flat_requests,
            flat_slope,
        },
    ))
}

/// The readings past the warm-up window grow on their own: over at least
/// [`MIN_PLATEAU_REQUESTS`] requests (a 1-in-10 leak shows two steps in
/// them), rising by Mann–Kendall at [`PAST_P_VALUE`], at least
/// [`PERSISTENCE`] of the whole trend's slope. The whole series is already
/// significant at the trend's level: this asks only that the growth goes on.
fn shown_past(series: &[(f64, f64)], window: &Window, trend: &Trend) -> bool {
    let past: Vec<(f64, f64)> = series
        .iter()
        .copied()
        .filter(|p| p.0 > window.requests as f64)
        .collect();
    let past = growth::thin(&past, MAX_FIT_POINTS);
    let span = past.last().map_or(0.0, |p| p.0 - window.requests as f64);
    if past.len() < MIN_TREND_POINTS || span < MIN_PLATEAU_REQUESTS {
        return false;
    }
    let (Some(mk), Some(line)) = (stats::mann_kendall(&past), stats::theil_sen(&past)) else {
        return false;
    };
    mk.p_increasing < PAST_P_VALUE && line.slope >= PERSISTENCE * trend.line.slope
}
