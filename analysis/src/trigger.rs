//! What set the failure off, from the pattern of growth before it, tested in
//! this order: a failure at start-up (immediate), concurrency, size (from
//! the memory's series, then from the requests of a probe that drove the
//! instance: `probe`), repeated requests, growth over time (no request
//! marks), immediate, unknown.
//!
//! Peak stats are cumulative, so growth inside requests is read from the live
//! bytes of readings taken during them (`decode`); the between-request
//! readings of a server that frees its KV cache after each request stay flat.

use crate::causes::{host_growth, startup_failure};
use crate::census::{self, HeapVerdict};
use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::growth;
use crate::pb;
use crate::stats;
use crate::time_growth;
use crate::timeline::Point;
use crate::units::bytes_short;
use oomscope_proto::TriggerKind;

mod host;
pub mod probe;

/// Growth smaller than this between the lowest and highest load is noise.
pub const MIN_RISE_BYTES: f64 = (16u64 << 20) as f64;
/// Mann–Kendall significance for "bytes rise with the prompt/context".
pub const SIZE_P_VALUE: f64 = 0.01;

/// The trigger and the line that says why. Without a failure only repeated
/// requests can be read (a leak hunt); no pattern then means no trigger.
/// `v` is the domain verdict: a failure without a device allocator record is
/// immediate only where memory ran out on the host side.
pub fn decide(f: &Findings, v: &DomainVerdict) -> Option<(TriggerKind, String)> {
    // A process that failed while starting failed before any load.
    if let Some(s) = startup_failure::read(f, v) {
        return Some((TriggerKind::Immediate, startup_failure::trigger_line(&s)));
    }
    // A failure read from the error text alone has no allocator series
    // behind it: the host's readings speak for its trigger.
    let device_failure = f.failure.as_ref().filter(|x| !x.from_text);
    // A death while the probe drove the instance: its requests name the
    // step, where the memory's own series does not.
    let during_probe = || {
        f.failed
            .then(|| host::failed_at(f))
            .flatten()
            .and_then(|t| probe::decide(f.evidence, t))
    };
    if device_failure.is_some() {
        if let Some(line) = concurrency(f) {
            return Some((TriggerKind::ConcurrencyDependent, line));
        }
        if let Some(line) = size(f) {
            return Some((TriggerKind::SizeDependent, line));
        }
        if let Some(t) = during_probe() {
            return Some(t);
        }
    } else if f.failed {
        if let Some(line) = host::concurrency(f) {
            return Some((TriggerKind::ConcurrencyDependent, line));
        }
        if let Some(line) = host::size(f) {
            return Some((TriggerKind::SizeDependent, line));
        }
        // Memory a runtime reserved up front need not rise with the load:
        // the probe's step past what was served still names the trigger.
        if let Some(t) = during_probe() {
            return Some(t);
        }
    }
    if let Some(t) = growth::live_baseline(&f.timeline).filter(|t| t.leaks()) {
        let line = format!(
            "between requests live bytes grew {} per request over {} requests",
            bytes_short(t.bytes_per_request() as u64),
            t.span
        );
        return Some((TriggerKind::RepeatedRequests, line));
    }
    if let Some(line) = heap_growth(f) {
        return Some((TriggerKind::RepeatedRequests, line));
    }
    // The host growth that stands as a cause (with or without a limit to
    // run to) is growth across repeated requests: the trigger says so too.
    if let Some(g) = host_growth::standing(f) {
        let line = format!(
            "between requests {} grew {} per request over {} requests",
            g.what,
            bytes_short(g.trend.bytes_per_request().max(0.0) as u64),
            g.trend.span
        );
        return Some((TriggerKind::RepeatedRequests, line));
    }
    // With no request marks the same growth is read against time (host_growth
    // reports it too); a timeline with marks never reaches this. The host's
    // growth sets off no failure on a device.
    // Before a failure it must also rise past the floor under which the
    // failure is `immediate` (host_immediate), so the two never disagree.
    let on_device = v.failed && v.domain == Domain::GpuVram;
    let sets_off = |g: &time_growth::TimeGrowth| {
        !on_device && (!v.failed || g.bytes_per_second() * g.trend.span >= MIN_RISE_BYTES)
    };
    if let Some(g) = time_growth::standing(f).filter(sets_off) {
        return Some((TriggerKind::GrowthOverTime, g.trigger_line()));
    }
    let unknown = || {
        (
            TriggerKind::Unknown,
            "no growth pattern before the failure".to_string(),
        )
    };
    let Some(failure) = device_failure else {
        if !f.failed {
            return None;
        }
        return Some(
            host_immediate(f, v)
                .map(|line| (TriggerKind::Immediate, line))
                .unwrap_or_else(unknown),
        );
    };
    if failure.in_load {
        return Some((
            TriggerKind::Immediate,
            "the failure came while loading weights, before any request".into(),
        ));
    }
    let before: Vec<&Point> = f
        .timeline
        .device()
        .filter(|p| p.time_ns <= failure.time_ns)
        .collect();
    if before.iter().all(|p| p.allocated == 0) {
        return Some((
            TriggerKind::Immediate,
            "the failure came at the first allocations, with no growth before it".into(),
        ));
    }
    Some(unknown())
}

/// A host-side memory failure (no device allocator record of it) is
/// immediate when nothing before it shows the process growing: no reading at
/// all (killed before the first sample), or readings that stay within
/// `MIN_RISE_BYTES` of the first, with no device bytes allocated and no
/// request done. Readings that do show growth, or none that say anything
/// about the process's memory, leave it unknown.
fn host_immediate(f: &Findings, v: &DomainVerdict) -> Option<String> {
    let memory_ran_out = matches!(
        v.domain,
        Domain::HostRam | Domain::Cgroup | Domain::AddressSpace | Domain::Shm
    );
    if !memory_ran_out {
        return None;
    }
    let at = f
        .exit
        .map(|(t, _)| t)
        .or_else(|| f.evidence.incident.as_ref().map(|i| i.time_ns))?;
    let before: Vec<&Point> = f
        .timeline
        .points
        .iter()
        .filter(|p| p.time_ns <= at)
        .collect();
    if before.is_empty() {
        return Some(
            "the failure came before any reading of the process, with no growth before it".into(),
        );
    }
    let readings: Vec<&Point> = before
        .iter()
        .copied()
        .filter(|p| p.rss.is_some() || p.cgroup_usage.is_some() || p.has_allocator)
        .collect();
    let rose = |v: fn(&Point) -> Option<u64>| {
        let mut vals = readings.iter().filter_map(|p| v(p));
        let first = vals.next().unwrap_or(0);
        vals.any(|b| b as f64 - first as f64 >= MIN_RISE_BYTES)
    };
    let grew = readings
        .iter()
        .any(|p| (p.has_allocator && p.allocated > 0) || p.requests_done > 0)
        || rose(|p| p.rss)
        || rose(|p| p.cgroup_usage);
    if readings.is_empty() || grew {
        return None;
    }
    Some(format!(
        "the failure came with no growth before it: the {} reading(s) before it stayed within {} of the first",
        readings.len(),
        bytes_short(MIN_RISE_BYTES as u64)
    ))
}

/// Live bytes rise with active sequences, and the failure came at (or past)
/// the highest concurrency seen.
fn concurrency(f: &Findings) -> Option<String> {
    let failure = f.failure.as_ref()?;
    let mut levels: Vec<(u64, u64)> = Vec::new(); // (sequences, max live)
    for p in f.timeline.active().filter(|p| p.active_sequences > 0) {
        match levels.iter_mut().find(|(s, _)| *s == p.active_sequences) {
            Some(l) => l.1 = l.1.max(p.allocated),
            None => levels.push((p.active_sequences, p.allocated)),
        }
    }
    if levels.len() < 2 {
        return None;
    }
    levels.sort_unstable();
    let (lo, hi) = (levels[0], levels[levels.len() - 1]);
    let rising = if levels.len() >= 3 {
        let pts: Vec<(f64, f64)> = levels.iter().map(|&(s, b)| (s as f64, b as f64)).collect();
        stats::mann_kendall(&pts).is_some_and(|mk| mk.tau > 0.5)
    } else {
        true
    };
    if !rising || (hi.1 as f64 - lo.1 as f64) < MIN_RISE_BYTES {
        return None;
    }
    let at = failure.context.active_sequences;
    let burst_began_at = burst_start_sequences(f, failure.time_ns);
    let max_live = levels.iter().map(|l| l.1).max().unwrap_or(0);
    let at_highest = if at > 0 {
        at >= hi.0 || burst_began_at >= hi.0
    } else {
        // The failure's own context is unknown: it needed more than any load seen.
        failure.allocated_bytes + failure.requested_bytes > max_live
    };
    if !at_highest {
        return None;
    }
    let when = if at > 0 && at < hi.0 {
        format!(
            "the failure came at {at} active sequences, in a burst of OOMs that began at {burst_began_at} (the most seen: {})",
            hi.0
        )
    } else if at > 0 {
        format!(
            "the failure came at {at} active sequences (the most seen: {})",
            hi.0
        )
    } else {
        "the failure came above the live bytes of every load seen".to_string()
    };
    Some(format!(
        "live bytes rose with active sequences: {} at {} sequence(s), {} at {}; {when}",
        bytes_short(lo.1),
        lo.0,
        bytes_short(hi.1),
        hi.0
    ))
}

/// Device OOMs this close before a failure are one burst with it: the
/// sequences that failed first leave, so later failures in the burst see
/// fewer active sequences than the load that set it off.
pub const OOM_BURST_NS: i64 = 30 * 1_000_000_000;

/// The most active sequences at an earlier device OOM of the burst that
/// ends at `failed_at_ns` (0 when it is the burst's first).
fn burst_start_sequences(f: &Findings, failed_at_ns: i64) -> u64 {
    f.evidence
        .events
        .iter()
        .filter(|e| e.time_ns < failed_at_ns && e.time_ns >= failed_at_ns - OOM_BURST_NS)
        .filter_map(|e| match &e.kind {
            Some(pb::event::Kind::Oom(o)) => o.context.as_ref().map(|c| c.active_sequences),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// Bytes that rise with tokens for certain over `pts` (tokens, bytes):
/// (bytes per token, fewest tokens, most tokens). None for noise, or for a
/// rise under [`MIN_RISE_BYTES`] across the tokens seen.
fn rise_per_token(pts: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let pts = growth::thin(pts, growth::MAX_FIT_POINTS);
    let mk = stats::mann_kendall(&pts)?;
    let line = stats::theil_sen(&pts)?;
    let (min_t, max_t) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), p| (l.min(p.0), h.max(p.0)));
    if mk.p_increasing >= SIZE_P_VALUE || line.slope * (max_t - min_t) < MIN_RISE_BYTES {
        return None;
    }
    Some((line.slope.max(0.0), min_t, max_t))
}

/// At one sequence, live bytes rise with its tokens (or its prompt), and the
/// failure came at (or past) the longest seen.
fn size(f: &Findings) -> Option<String> {
    let failure = f.failure.as_ref()?;
    let single: Vec<&Point> = f
        .timeline
        .device()
        .filter(|p| p.active_sequences <= 1 && p.tokens() > 0 && !p.is_load())
        .collect();
    let pts: Vec<(f64, f64)> = single
        .iter()
        .map(|p| (p.tokens() as f64, p.allocated as f64))
        .collect();
    let (slope, min_t, max_t) = rise_per_token(&pts)?;
    let at = if failure.context.active_tokens > 0 {
        failure.context.active_tokens
    } else {
        failure.context.prompt_tokens
    };
    let max_live = single.iter().map(|p| p.allocated).max().unwrap_or(0);
    let at_longest = if at > 0 {
        at as f64 >= max_t
    } else {
        failure.allocated_bytes + failure.requested_bytes > max_live
    };
    at_longest.then(|| {
        format!(
            "at one sequence live bytes rose {} per token from {min_t} to {max_t} tokens; the failure came at {}",
            bytes_short(slope as u64),
            if at > 0 { format!("{at} tokens") } else { "a longer context".to_string() }
        )
    })
}

/// Without a device allocator, the heap census is the live baseline: growth
/// of a retained type across censuses (collected later or not) is growth
/// across repeated requests.
fn heap_growth(f: &Findings) -> Option<String> {
    if f.timeline.device().next().is_some() {
        return None;
    }
    let g = match census::verdict(f)? {
        HeapVerdict::Growing(g) => g,
        HeapVerdict::Retained(r) => r.growth,
    };
    Some(format!(
        "between requests the Python heap's {} grew {} per request over {} requests",
        g.top.name,
        bytes_short(g.top.bytes_per_request().max(0.0) as u64),
        g.requests()
    ))
}
