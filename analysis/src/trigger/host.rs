//! The trigger of a failure on the host side (a cgroup or the host ran out;
//! no device allocator record): read from the host memory of the process
//! against the requests it was serving. A server with no in-process agent
//! has no request context of its own; `oomscope probe` supplies it (the
//! collector joins the probe's requests to the server's samples).

use super::{rise_per_token, MIN_RISE_BYTES};
use crate::findings::Findings;
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

/// When the failure came: the kernel's record of the kill, the exit, else
/// the incident's time.
pub(super) fn failed_at(f: &Findings) -> Option<i64> {
    f.kernel.map(|(t, _)| t).or(f.exit.map(|(t, _)| t)).or(f
        .evidence
        .incident
        .as_ref()
        .map(|i| i.time_ns))
}

/// What was in service when it failed: the newest reading before the
/// failure, if it was taken inside a request and recently enough to say so.
fn in_service_at<'a>(before: &[&'a Point], end: i64) -> Option<&'a Point> {
    before
        .last()
        .copied()
        .filter(|p| p.in_request() && end - p.time_ns <= FAILURE_CONTEXT_MAX_AGE_NS)
}

/// The readings up to the failure (past the weights' load), and its time.
fn before_failure<'a>(f: &'a Findings) -> Option<(i64, Vec<&'a Point>)> {
    let end = failed_at(f)?;
    let before = f
        .timeline
        .points
        .iter()
        .filter(|p| p.time_ns <= end && !p.is_load())
        .collect();
    Some((end, before))
}

/// At one sequence, host memory rose with the tokens in service, and the
/// failure came while serving at least the longest of them.
pub fn size(f: &Findings) -> Option<String> {
    let (end, before) = before_failure(f)?;
    let single: Vec<(f64, f64)> = before
        .iter()
        .filter(|p| p.active_sequences == 1 && p.tokens() > 0)
        .filter_map(|p| Some((p.tokens() as f64, usage(p)? as f64)))
        .collect();
    let (slope, min_t, max_t) = rise_per_token(&single)?;
    let at = in_service_at(&before, end)?.tokens();
    ((at as f64) >= max_t).then(|| {
        format!(
            "at one sequence host memory rose {} per token from {min_t} to {max_t} tokens; the failure came at {at} tokens",
            bytes_short(slope as u64),
        )
    })
}

/// Host memory rose with the sequences in service, and the failure came at
/// (or past) the most seen.
pub fn concurrency(f: &Findings) -> Option<String> {
    let (end, before) = before_failure(f)?;
    let mut levels: Vec<(u64, u64)> = Vec::new(); // (sequences, max usage)
    for p in before.iter().filter(|p| p.active_sequences > 0) {
        let Some(u) = usage(p) else { continue };
        match levels.iter_mut().find(|(s, _)| *s == p.active_sequences) {
            Some(l) => l.1 = l.1.max(u),
            None => levels.push((p.active_sequences, u)),
        }
    }
    if levels.len() < 3 {
        return None;
    }
    levels.sort_unstable();
    let pts: Vec<(f64, f64)> = levels.iter().map(|&(s, b)| (s as f64, b as f64)).collect();
    let (lo, hi) = (levels[0], levels[levels.len() - 1]);
    let rising = stats::mann_kendall(&pts).is_some_and(|mk| mk.tau > 0.5);
    if !rising || (hi.1 as f64 - lo.1 as f64) < MIN_RISE_BYTES {
        return None;
    }
    let last = in_service_at(&before, end)?;
    if last.active_sequences < hi.0 || hi.0 < 2 {
        return None;
    }
    Some(format!(
        "host memory rose with sequences in service: {} at {} sequence(s), {} at {}; the failure came at {} sequences",
        bytes_short(lo.1),
        lo.0,
        bytes_short(hi.1),
        hi.0,
        last.active_sequences
    ))
}
