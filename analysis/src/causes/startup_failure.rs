//! A process that failed at start-up, for a reason of its own: it exited
//! within [`STARTUP_WINDOW_NS`] of starting, before serving anything, and no
//! memory domain explains it (no limit hit, no OOM text, no kill). Its
//! stderr names the error (a wrong model path, a bad flag); a restart policy
//! only repeats it. Such a failure has no memory domain, and host-wide
//! pressure or other processes' memory around it are context, not causes.

use super::cause;
use crate::domain::{Domain, DomainVerdict};
use crate::error_line::{error_line, last_line};
use crate::findings::Findings;
use crate::pb;
use crate::pb::event::Kind;
use crate::units::seconds;
use oomscope_proto::CauseKind;

/// A process that ends this soon after it started failed while starting:
/// loading a model and binding a port take seconds; a server that failed
/// later had started.
pub const STARTUP_WINDOW_NS: i64 = 30 * 1_000_000_000;

/// The confidence of the verdict: the process said why it failed.
const NAMED_CONFIDENCE: f64 = 0.9;
/// Its stderr held no line shaped like an error: the failure is still at
/// start-up, but what failed is the operator's reading of the tail.
const UNNAMED_CONFIDENCE: f64 = 0.6;

/// A start-up failure, as read from the exit it is about.
pub struct Startup<'a> {
    pub exit: &'a pb::ChildExit,
    /// The error line of its stderr tail, if one looks like an error.
    pub error: Option<String>,
    /// The failed starts of the child in the evidence (restarts included).
    pub attempts: usize,
}

/// The start-up failure the evidence shows, if the failure is one: an exit
/// (a code, or a signal of its own such as SIGSEGV or SIGABRT; not SIGKILL,
/// not a passed-on stop) within the start-up window, before any request,
/// with no memory domain near a limit.
pub fn read<'a>(f: &Findings<'a>, v: &DomainVerdict) -> Option<Startup<'a>> {
    if !v.failed || f.oom.is_some() || f.kernel.is_some() || f.text.is_some() {
        return None;
    }
    let (t, exit) = f.exit?;
    let runtime = exit.runtime_ns as i64;
    if runtime <= 0 || runtime > STARTUP_WINDOW_NS || exit.stop_signal.is_some() {
        return None;
    }
    // A SIGKILL comes from outside (an OOM killer, an orchestrator), never
    // from the process's own error.
    if exit.signal == Some(crate::findings::SIGKILL) || !no_domain(f, v) {
        return None;
    }
    // A server that answered requests had started: its later failure is not this.
    let served = f
        .timeline
        .points
        .iter()
        .filter(|p| p.time_ns <= t)
        .any(|p| p.requests_done > 0 || p.active_sequences > 0);
    if served {
        return None;
    }
    let attempts = f
        .evidence
        .events
        .iter()
        .filter(|e| match &e.kind {
            Some(Kind::ChildExit(x)) => {
                x.member == exit.member
                    && x.stop_signal.is_none()
                    && (x.signal.is_some() || x.exit_code.unwrap_or(0) != 0)
                    && (x.runtime_ns as i64) <= STARTUP_WINDOW_NS
            }
            _ => false,
        })
        .count()
        .max(1);
    Some(Startup {
        exit,
        error: error_line(&exit.stderr_tail),
        attempts,
    })
}

/// No memory domain is near a limit: no cgroup level of the process moved
/// a counter or peaked at its limit, and the verdict found none, or only swap
/// thrash whose "own" part is the process's major faults, which a starting
/// process takes as it pages in its code and libraries (its cgroup neither
/// refaulted nor stalled).
fn no_domain(f: &Findings, v: &DomainVerdict) -> bool {
    // A cgroup level that hit its limit or counted a refusal was near it.
    let near_limit = f
        .counters
        .as_ref()
        .is_some_and(|c| c.levels().any(|l| l.any_moved() || l.peak_at_limit()));
    if near_limit {
        return false;
    }
    match v.domain {
        Domain::Unknown => true,
        Domain::SwapThrash => f.thrash.as_ref().is_some_and(|t| {
            !t.cgroup_stalled
                && t.cgroup_refaults < crate::thrash::THRASH_MIN_REFAULT_PAGES
                && t.cgroup_major_faults < crate::thrash::OWN_MIN_MAJOR_FAULTS
        }),
        _ => false,
    }
}

/// The line that says how it ended and why that is a start-up failure.
pub fn exit_line(s: &Startup) -> String {
    let x = s.exit;
    let how = match (x.signal, x.exit_code) {
        (Some(sig), _) => format!("was killed by signal {sig}"),
        (None, Some(c)) => format!("exited with code {c}"),
        (None, None) => "ended".to_string(),
    };
    let who = match x.member {
        true => format!("member pid {}", x.pid),
        false => format!("child pid {}", x.pid),
    };
    format!(
        "{who} {how} {} after it started, within the {} start-up window and before serving any request: it failed while starting",
        seconds(x.runtime_ns as i64),
        seconds(STARTUP_WINDOW_NS)
    )
}

/// The trigger's line: the failure came at start-up.
pub fn trigger_line(s: &Startup) -> String {
    format!(
        "the failure came at start-up, {} after the process started, before any request",
        seconds(s.exit.runtime_ns as i64)
    )
}

pub fn startup_failure(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let s = read(f, v)?;
    let mut evidence = vec![match &s.error {
        Some(line) => format!("stderr: {line}"),
        None => match last_line(&s.exit.stderr_tail) {
            Some(last) => {
                format!("no line of its stderr looks like an error; its last line: {last}")
            }
            None => "its stderr was empty: the error is in its own logs, if anywhere".to_string(),
        },
    }];
    evidence.push(exit_line(&s));
    if s.attempts > 1 {
        evidence.push(format!(
            "{} starts failed the same way: restarting repeats the failure until the error is fixed",
            s.attempts
        ));
    }
    evidence.push(format!(
        "no memory domain near a limit: {}; no kernel OOM record and no out-of-memory text",
        f.counters_line()
    ));
    if let Some(t) = f.thrash.as_ref().filter(|t| t.thrashing) {
        evidence.push(format!(
            "its own major faults (+{}) came while it was starting: a starting process pages in its code and libraries; its cgroup neither refaulted nor stalled",
            t.own_major_faults
        ));
    }
    let confidence = match s.error {
        Some(_) => NAMED_CONFIDENCE,
        None => UNNAMED_CONFIDENCE,
    };
    let ended = match (s.exit.signal, s.exit.exit_code) {
        (Some(sig), _) => ("signal", sig as f64), // vocab: a metric
        (None, code) => ("exit_code", code.unwrap_or(0) as f64),
    };
    Some(cause(
        CauseKind::StartupFailure,
        confidence,
        evidence,
        &[
            ("runtime_s", s.exit.runtime_ns as f64 / 1e9),
            ended,
            ("failed_starts", s.attempts as f64),
        ],
    ))
}
