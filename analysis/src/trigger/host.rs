//! The trigger of a failure on the host side (a cgroup or the host ran out;
//! no device allocator record): read from the host memory of the process
//! against the requests it was serving. A server with no in-process agent
//! has no request context of its own; `oomscope probe` supplies it (the
//! collector joins the probe's requests to the server's samples).

use super::{MIN_RISE_BYTES, SIZE_P_VALUE};
use crate::findings::Findings;
use crate::growth;
use crate::stats;
use crate::timeline::Point;
use crate::units::bytes_short;

/// A request context older than this at the failure says nothing about
/// what the server was doing when it failed.
pub const FAILURE_CONTEXT_MAX_AGE_NS: i64 = 5_000_000_000;

/// The memory of the domain that bounds the process: its cgroup's usage
/// where a limit is set, else its resident set.
fn usage(p: &Point) -> Option<u64> {
    match p.cgroup_limit {
        Some(_) => p.cgroup_usage,
        None => p.rss,
    }
}

/// The tokens a reading was taken at: those in service, else the prompt's.
fn tokens(p: &Point) -> u64 {
    if p.active_tokens > 0 {
        p.active_tokens
    } else {
        p.prompt_tokens
    }
}

/// When the failure came: the kernel's record of the kill, the exit, else
/// the incident's time.
fn failed_at(f: &Findings) -> Option<i64> {
    f.kernel.map(|(t, _)| t).or(f.exit.map(|(t, _)| t)).or(f
        .evidence
        .incident
        .as_ref()
        .map(|i| i.time_ns))
}

/// At one sequence, host memory rose with the tokens in service, and the
/// failure came while serving at least the longest of them.
pub fn size(f: &Findings) -> Option<String> {
    let end = failed_at(f)?;
    let before: Vec<&Point> = f
        .timeline
        .points
        .iter()
        .filter(|p| p.time_ns <= end && !p.is_load())
        .collect();
    let single: Vec<(f64, f64)> = before
        .iter()
        .filter(|p| p.active_sequences == 1 && tokens(p) > 0)
        .filter_map(|p| Some((tokens(p) as f64, usage(p)? as f64)))
        .collect();
    let pts = growth::thin(&single, growth::MAX_FIT_POINTS);
    let mk = stats::mann_kendall(&pts)?;
    let line = stats::theil_sen(&pts)?;
    let (min_t, max_t) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), p| (l.min(p.0), h.max(p.0)));
    if mk.p_increasing >= SIZE_P_VALUE || line.slope * (max_t - min_t) < MIN_RISE_BYTES {
        return None;
    }
    // What was in service when it failed: the newest reading's context.
    let last = before.iter().rev().find(|p| p.in_request())?;
    let at = tokens(last);
    if end - last.time_ns > FAILURE_CONTEXT_MAX_AGE_NS || (at as f64) < max_t {
        return None;
    }
    Some(format!(
        "at one sequence host memory rose {} per token from {min_t} to {max_t} tokens; the failure came at {at} tokens",
        bytes_short(line.slope.max(0.0) as u64),
    ))
}
