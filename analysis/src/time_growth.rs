//! Growth against time, for a process with no request marks: no in-process
//! agent counting requests, no request boundaries, no probe's requests (a C++
//! runtime or any non-Python server under `oomscope run`). Growth per
//! request cannot be read there, so its host memory (RSS, the process tree's
//! PSS, a limited cgroup's usage) is fitted against seconds instead, with
//! the same trend test (`growth::trend`: Theil–Sen, Mann–Kendall, and the
//! later half still rising), and its runway is in time to the limit that
//! bounds it.
//!
//! `repeated_requests` is the trigger of growth per request and
//! `growth_over_time` of this: a timeline with any request mark is never
//! read here, so the two never both stand.

use crate::evidence::Evidence;
use crate::findings::Findings;
use crate::growth::{self, Trend};
use crate::pb;
use crate::pb::event::Kind;
use crate::runway::{duration_text, RUNWAY_PREFIX};
use crate::timeline::Point;
use crate::units::bytes_short;

const NS_PER_S: f64 = 1e9;

/// A process's first 30 seconds are its start: imports, a runtime's arenas,
/// caches and pools filling. They are left out of the fit...
pub const WARMUP_NS: i64 = 30_000_000_000;

/// ...or its first third of life where that is shorter: a process that
/// fills its limit within a minute still has its growth judged on the later
/// two thirds, and the persistence test (its later half rising at half the
/// overall rate) still turns away a warm-up that levels off.
pub const WARMUP_MAX_SHARE_OF_LIFE: f64 = 1.0 / 3.0;

/// Growth that takes longer than this to fill its limit is `slow_growth`,
/// not `host_growth`: a server's allocator drift over days is no leak to
/// hunt today (it stays on record with its runway), and without requests
/// there is no per-request share to judge it by instead. The same day as
/// growth per request is judged by (`runway::URGENT_RUNWAY_S`).
pub const SLOW_TIME_RUNWAY_S: f64 = crate::runway::URGENT_RUNWAY_S;

pub const HOST_RSS: &str = "host RSS";
pub const TREE_PSS: &str = "the process tree's PSS";
pub const CGROUP_USAGE: &str = "cgroup usage";

/// The metric of a growth fitted against time: a cause carrying it counted
/// no work.
pub const PER_SECOND_METRIC: &str = "bytes_per_second";

/// A growth against time that stands (as `host_growth`, and as the
/// `growth_over_time` trigger).
#[derive(Clone, Debug, PartialEq)]
pub struct TimeGrowth {
    /// The series that grew: [`HOST_RSS`], [`TREE_PSS`] or [`CGROUP_USAGE`].
    pub what: &'static str,
    /// Bytes against seconds since the process started: the slope is bytes/s.
    pub trend: Trend,
    /// The start of life left out of the fit, in seconds.
    pub excluded_s: f64,
    /// The fitted window, in seconds since the start.
    pub from_s: f64,
    pub to_s: f64,
    pub runway: Option<TimeRunway>,
}

impl TimeGrowth {
    pub fn bytes_per_second(&self) -> f64 {
        self.trend.line.slope
    }

    /// Its limit lasts longer than [`SLOW_TIME_RUNWAY_S`].
    pub fn is_slow(&self) -> bool {
        self.runway
            .is_some_and(|r| r.seconds_left() > SLOW_TIME_RUNWAY_S)
    }

    /// "host RSS rose from A to B between 2.0 s and 6.1 s after the start: 30.0 MiB/s (...)"
    pub fn rise_line(&self) -> String {
        let t = &self.trend;
        format!(
            "without request marks, {} rose from {} to {} between {:.1} s and {:.1} s after the start: {}/s (Theil–Sen over {} readings against time; Mann–Kendall p = {:.1e}; still rising in the later half)",
            self.what,
            bytes_short(t.first_bytes.max(0.0) as u64),
            bytes_short(t.last_bytes.max(0.0) as u64),
            self.from_s,
            self.to_s,
            bytes_short(self.bytes_per_second().max(0.0).round() as u64),
            t.points,
            t.p_value
        )
    }

    /// Why the first seconds are not in the fit.
    pub fn warmup_line(&self) -> String {
        format!(
            "the first {:.1} s of the process's life are left out as warm-up (its first {} s or first third, whichever is shorter), and so are load phases",
            self.excluded_s,
            WARMUP_NS / 1_000_000_000
        )
    }

    /// The trigger's line.
    pub fn trigger_line(&self) -> String {
        format!(
            "with no request marks, {} grew {}/s over {:.1} s",
            self.what,
            bytes_short(self.bytes_per_second().max(0.0).round() as u64),
            self.to_s - self.from_s
        )
    }
}

/// A growth's way to the limit that bounds it, in time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeRunway {
    pub limit: u64,
    /// "the cgroup limit", "CommitLimit", "MemAvailable"
    pub limit_name: &'static str,
    /// What is left under the limit at the newest reading.
    pub headroom: u64,
    pub bytes_per_s: f64,
}

impl TimeRunway {
    pub fn seconds_left(&self) -> f64 {
        if self.bytes_per_s <= 0.0 {
            return f64::INFINITY;
        }
        self.headroom as f64 / self.bytes_per_s
    }

    /// "runway: at 30.0 MiB/s, the 300.0 MiB of the cgroup limit (120.0 MiB
    /// left) is gone in about 4 seconds"
    pub fn line(&self) -> String {
        format!(
            "{RUNWAY_PREFIX}at {}/s, the {} of {} ({} left) is gone in {}",
            bytes_short(self.bytes_per_s.max(0.0).round() as u64),
            bytes_short(self.limit),
            self.limit_name,
            bytes_short(self.headroom),
            duration_text(self.seconds_left())
        )
    }

    /// seconds_to_limit and limit_bytes (the runway's metrics, which an
    /// ended process's verdict strips).
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("seconds_to_limit", self.seconds_left()),
            ("limit_bytes", self.limit as f64),
        ]
    }
}

/// Whether anything in the evidence counts work: a request context, a
/// reading inside a request, a request boundary, or a runtime's engine
/// steps (a vLLM instance's, joined from its API server: a member's growth
/// is then read per step, `members`).
pub fn has_request_marks(f: &Findings) -> bool {
    f.timeline
        .points
        .iter()
        .any(|p| p.requests_done > 0 || p.in_request())
        || f.evidence
            .events
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::Request(_))))
        || f.evidence.samples.iter().any(|s| {
            s.context.as_ref().is_some_and(|c| {
                c.numbers
                    .get(crate::evidence::ENGINE_STEPS)
                    .is_some_and(|&n| n > 0.0)
            })
        })
}

/// A server that died while starting: the failure came before the
/// instance served anything, in a known serving runtime (vLLM, SGLang, ...)
/// whose in-process agent reports its work (a request context in its
/// samples or its members'), and nothing counted a request, a running
/// sequence or an engine step before it. Its whole life was its start
/// (imports, weights, a KV pool being filled), the span [`WARMUP_NS`]
/// leaves out of a fit; with nothing after it, its rise is loading, not
/// growth, and stands as no `host_growth` (a member's neither: `members`).
/// A process with no agent that counts (a C++ server under `oomscope run`)
/// is never read so: its serving cannot be told from its start.
pub fn died_starting(f: &Findings) -> bool {
    if !f.failed || f.runtime().is_none() {
        return false;
    }
    let e = f.evidence;
    let Some(end) = f
        .kernel
        .map(|(t, _)| t)
        .or(f.exit.map(|(t, _)| t))
        .or_else(|| e.death_time())
    else {
        return false;
    };
    let instance = || std::iter::once(e).chain(&e.members);
    let reports = instance().any(|m| m.samples.iter().any(|s| s.context.is_some()));
    let worked = instance().any(|m| {
        crate::kv_pool_figures::served_before(m, end)
            || m.samples.iter().filter(|s| s.time_ns < end).any(|s| {
                s.context.as_ref().is_some_and(|c| {
                    c.numbers
                        .get(crate::evidence::ENGINE_STEPS)
                        .is_some_and(|&n| n > 0.0)
                })
            })
    });
    reports && !worked
}

/// The growth against time that stands as `host_growth`, or None: the
/// process has request marks (growth is then per request), no series grows
/// for certain past the host's grain, or it is slow.
pub fn standing(f: &Findings) -> Option<TimeGrowth> {
    fit(f).filter(|g| !g.is_slow())
}

/// Growth against time whose runway is longer than [`SLOW_TIME_RUNWAY_S`]:
/// `slow_growth`'s, reported with its runway, never as a leak.
pub fn slow(f: &Findings) -> Option<TimeGrowth> {
    fit(f).filter(TimeGrowth::is_slow)
}

/// The certain growth against time of a process with no request marks.
fn fit(f: &Findings) -> Option<TimeGrowth> {
    if has_request_marks(f) || died_starting(f) {
        return None;
    }
    let points: Vec<&Point> = f.timeline.points.iter().collect();
    let (born, end) = life(f.evidence, &points, f.exit.map(|(t, _)| t))?;
    let excluded = ((end - born) as f64 * WARMUP_MAX_SHARE_OF_LIFE).min(WARMUP_NS as f64) as i64;
    let window: Vec<&Point> = points
        .iter()
        .copied()
        .filter(|p| p.time_ns >= born + excluded && p.time_ns <= end && !p.is_load())
        .collect();
    let secs = |t: i64| (t - born) as f64 / NS_PER_S;
    let series = |v: &dyn Fn(&Point) -> Option<u64>| {
        let pts: Vec<(f64, f64)> = window
            .iter()
            .filter_map(|p| v(p).map(|b| (secs(p.time_ns), b as f64)))
            .collect();
        growth::trend(&pts).filter(|t| t.host_certain())
    };
    // The cgroup's usage only where a limit bounds it: an unlimited cgroup
    // is shared, and its growth is not this process's.
    let (what, trend) = [
        (
            HOST_RSS,
            &Point::server_rss as &dyn Fn(&Point) -> Option<u64>,
        ),
        (TREE_PSS, &|p: &Point| p.tree_pss),
        (CGROUP_USAGE, &|p: &Point| {
            p.cgroup_limit.and(p.server_cgroup_usage())
        }),
    ]
    .into_iter()
    .find_map(|(what, v)| series(v).map(|t| (what, t)))?;
    let runway = bounding_runway(f, &window, trend.line.slope);
    let (from_s, to_s) = window
        .iter()
        .map(|p| secs(p.time_ns))
        .fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(x), h.max(x)));
    Some(TimeGrowth {
        what,
        trend,
        excluded_s: excluded as f64 / NS_PER_S,
        from_s,
        to_s,
        runway,
    })
}

/// The process's life as the evidence shows it: from its (latest) start
/// to its end, else to the newest reading. The start is the latest child
/// start `oomscope run` recorded, else the agent's start, else the first
/// reading; the end is the child's exit within that life.
fn life(e: &Evidence, points: &[&Point], exit_ns: Option<i64>) -> Option<(i64, i64)> {
    let last = points.last()?.time_ns;
    let first = points.first()?.time_ns;
    let child_start = e
        .events
        .iter()
        .filter(|ev| matches!(ev.kind, Some(Kind::ChildStart(_))) && ev.time_ns <= last)
        .map(|ev| ev.time_ns)
        .max();
    let agent_start = e
        .hello
        .as_ref()
        .map(|h| h.start_time_ns)
        .filter(|&t| t > 0 && t <= first);
    let born = child_start.or(agent_start).unwrap_or(first);
    let end = exit_ns.filter(|&t| t >= born).unwrap_or(last).min(last);
    (end > born).then_some((born, end))
}

/// The runway to whichever limit comes first: the cgroup's (its limit less
/// its usage), strict overcommit's (CommitLimit less Committed_AS), the
/// host's (MemAvailable), each at its newest reading in the window.
fn bounding_runway(f: &Findings, window: &[&Point], bytes_per_s: f64) -> Option<TimeRunway> {
    let cgroup = window.iter().rev().find_map(|p| {
        let limit = p.cgroup_limit?;
        Some(TimeRunway {
            limit,
            limit_name: "the cgroup limit",
            headroom: limit.saturating_sub(p.cgroup_usage?),
            bytes_per_s,
        })
    });
    let (from, to) = (window.first()?.time_ns, window.last()?.time_ns);
    let system = f
        .evidence
        .samples
        .iter()
        .rev()
        .filter(|s| s.time_ns >= from && s.time_ns <= to)
        .find_map(|s| s.system.as_ref());
    let host = system.and_then(|s| host_runway(s, bytes_per_s));
    [cgroup, host]
        .into_iter()
        .flatten()
        .min_by(|a, b| a.seconds_left().total_cmp(&b.seconds_left()))
}

/// Strict overcommit bounds by the commit left, else MemAvailable does.
fn host_runway(s: &pb::SystemMemory, bytes_per_s: f64) -> Option<TimeRunway> {
    if s.overcommit_mode == 2 && s.commit_limit_bytes > 0 {
        return Some(TimeRunway {
            limit: s.commit_limit_bytes,
            limit_name: "CommitLimit",
            headroom: s.commit_limit_bytes.saturating_sub(s.committed_as_bytes),
            bytes_per_s,
        });
    }
    (s.mem_total_bytes > 0).then_some(TimeRunway {
        limit: s.mem_total_bytes,
        limit_name: "MemTotal",
        headroom: s.mem_available_bytes,
        bytes_per_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runway_line_says_rate_limit_headroom_and_time() {
        let r = TimeRunway {
            limit: 300 << 20,
            limit_name: "the cgroup limit",
            headroom: 120 << 20,
            bytes_per_s: (30u64 << 20) as f64,
        };
        assert_eq!(r.seconds_left(), 4.0);
        assert_eq!(
            r.line(),
            "runway: at 30.0 MiB/s, the 300.0 MiB of the cgroup limit (120.0 MiB left) is gone in about 4 seconds"
        );
        assert!(r.metrics().contains(&("seconds_to_limit", 4.0)));
    }
}
