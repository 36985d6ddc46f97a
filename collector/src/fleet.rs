//! Incidents that no single agent shows: a crash loop (one service's agents
//! dying again and again) and a restart storm (many agents of one service
//! starting together, followed by a burst of requests: the thundering herd
//! after a power cut or a mass restart). Pure: the store gathers the facts.
//! The collector only records these; it never restarts or kills anything.

use std::time::Duration;

/// The defaults, each with its reason.
#[derive(Clone, Debug)]
pub struct FleetPolicy {
    /// Deaths of one service's agents within `crash_loop_window` that make a
    /// crash loop. Three: one death is an incident, two may be bad luck, a
    /// third in a few minutes is a pattern that a restart policy is feeding.
    pub crash_loop_deaths: usize,
    /// Five minutes spans the backoff of common restart policies (systemd's
    /// default 100 ms, Kubernetes' 10 s doubling to 5 min) for three deaths.
    pub crash_loop_window: Duration,
    /// Instances of one service starting within `storm_window` that count
    /// as restarting together. Three or more: one restart is routine. (The
    /// processes of one instance are one start.)
    pub storm_instances: usize,
    /// Thirty seconds: replicas restarted by one event come up within it.
    pub storm_window: Duration,
    /// How long after the first start the request burst is measured.
    pub burst_window: Duration,
    /// The burst's rate must be this many times the service's rate before
    /// the restarts (retried jobs arriving at once, not ordinary traffic).
    pub burst_factor: f64,
    /// And at least this many requests, so that a quiet service's first few
    /// requests are not a "burst".
    pub burst_min_requests: usize,
    /// The rate before the restarts is measured over this long.
    pub baseline_window: Duration,
}

impl Default for FleetPolicy {
    fn default() -> Self {
        FleetPolicy {
            crash_loop_deaths: 3,
            crash_loop_window: Duration::from_secs(300),
            storm_instances: 3,
            storm_window: Duration::from_secs(30),
            burst_window: Duration::from_secs(30),
            burst_factor: 3.0,
            burst_min_requests: 20,
            baseline_window: Duration::from_secs(300),
        }
    }
}

/// One agent of a service that ended badly.
#[derive(Clone, Debug)]
pub struct Death {
    pub agent_id: String,
    pub time_ns: i64,
    /// The incident kind that recorded it ("signal", "agent_lost", ...).
    pub kind: String,
}

/// One instance of a service that started: its first agent's Hello. The
/// processes of one instance (a vLLM's supervisor, API server, engine core
/// and workers) start together by design; only instances restart.
#[derive(Clone, Debug)]
pub struct Start {
    pub instance: String,
    pub time_ns: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub time_ns: i64,
    pub summary: String,
    pub evidence: Vec<String>,
}

fn secs(ns: i64) -> f64 {
    ns as f64 / 1e9
}

/// A policy window in nanoseconds; one longer than i64 holds (292 years)
/// means all of history, never a wrap.
pub(crate) fn nanos(d: std::time::Duration) -> i64 {
    oomscope_proto::duration_ns(d).unwrap_or(i64::MAX)
}

/// A crash loop: the newest `crash_loop_deaths` deaths (sorted by time) fall
/// within the window.
pub fn crash_loop(service: &str, deaths: &[Death], p: &FleetPolicy) -> Option<Finding> {
    let n = p.crash_loop_deaths.max(2);
    if deaths.len() < n {
        return None;
    }
    let mut d: Vec<&Death> = deaths.iter().collect();
    d.sort_by_key(|x| x.time_ns);
    let recent = &d[d.len() - n..];
    let span = recent[n - 1].time_ns - recent[0].time_ns;
    if span > nanos(p.crash_loop_window) {
        return None;
    }
    let agents: std::collections::BTreeSet<&str> =
        recent.iter().map(|x| x.agent_id.as_str()).collect();
    let mut evidence = vec![format!(
        "{n} deaths of service {service:?} within {:.1} s (window {:.0} s), across {} agent(s)",
        secs(span),
        p.crash_loop_window.as_secs_f64(),
        agents.len()
    )];
    evidence.extend(recent.iter().map(|x| {
        format!(
            "{} ended: {} at +{:.1} s",
            x.agent_id,
            x.kind,
            secs(x.time_ns - recent[0].time_ns)
        )
    }));
    evidence.push(
        "whatever restarts it keeps it failing: bound the restarts and fix the cause first".into(),
    );
    Some(Finding {
        time_ns: recent[n - 1].time_ns,
        summary: format!(
            "crash loop: service {service:?} died {n} times in {:.1} s",
            secs(span)
        ),
        evidence,
    })
}

/// A restart storm: `storm_instances` instance starts within `storm_window`,
/// followed by a request burst well above the service's rate before them. `requests` are
/// the times of the service's request starts, from any of its agents.
pub fn restart_storm(
    service: &str,
    starts: &[Start],
    requests: &[i64],
    p: &FleetPolicy,
) -> Option<Finding> {
    let n = p.storm_instances.max(2);
    if starts.len() < n {
        return None;
    }
    let mut s: Vec<&Start> = starts.iter().collect();
    s.sort_by_key(|x| x.time_ns);
    // The earliest group of n starts within the window.
    let window = nanos(p.storm_window);
    let first = (0..=s.len() - n).find(|&i| s[i + n - 1].time_ns - s[i].time_ns <= window)?;
    let group: Vec<&Start> = s[first..]
        .iter()
        .take_while(|x| x.time_ns - s[first].time_ns <= window)
        .copied()
        .collect();
    let t0 = group[0].time_ns;
    let burst_end = t0.saturating_add(nanos(p.burst_window));
    let base_start = t0.saturating_sub(nanos(p.baseline_window));
    let burst = requests
        .iter()
        .filter(|&&t| t >= t0 && t < burst_end)
        .count();
    let before = requests
        .iter()
        .filter(|&&t| t >= base_start && t < t0)
        .count();
    let burst_rate = burst as f64 / p.burst_window.as_secs_f64();
    let base_rate = before as f64 / p.baseline_window.as_secs_f64();
    if burst < p.burst_min_requests || burst_rate < p.burst_factor * base_rate {
        return None;
    }
    let spread = group.last().unwrap().time_ns - t0;
    let ratio = if base_rate > 0.0 {
        format!("{:.1}x", burst_rate / base_rate)
    } else {
        "from nothing".into()
    };
    Some(Finding {
        time_ns: group.last().unwrap().time_ns,
        summary: format!(
            "restart storm: {} instances of service {service:?} started within {:.1} s, then {burst} requests in {:.0} s",
            group.len(),
            secs(spread),
            p.burst_window.as_secs_f64()
        ),
        evidence: vec![
            format!("{} instances of {service:?} started within {:.1} s (window {:.0} s)", group.len(), secs(spread), p.storm_window.as_secs_f64()),
            format!(
                "{burst} requests in the {:.0} s after the first start ({burst_rate:.1}/s) vs {before} in the {:.0} s before ({base_rate:.2}/s): {ratio}",
                p.burst_window.as_secs_f64(),
                p.baseline_window.as_secs_f64()
            ),
            "retried work arrived at once: gate traffic on readiness, restore it gradually, deduplicate by idempotency key".into(),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn deaths(times: &[i64]) -> Vec<Death> {
        times
            .iter()
            .enumerate()
            .map(|(i, &t)| Death {
                agent_id: format!("a{i}"),
                time_ns: t * S,
                kind: "agent_lost".into(),
            })
            .collect()
    }

    #[test]
    fn three_deaths_in_the_window_are_a_loop_two_are_not() {
        let p = FleetPolicy::default();
        assert!(crash_loop("svc", &deaths(&[0, 10]), &p).is_none());
        let f = crash_loop("svc", &deaths(&[0, 10, 25]), &p).unwrap();
        assert!(f.summary.contains("3 times in 25.0 s"), "{}", f.summary);
        assert_eq!(f.time_ns, 25 * S);
        // Spread over more than five minutes: not a loop.
        assert!(crash_loop("svc", &deaths(&[0, 200, 400]), &p).is_none());
    }

    #[test]
    fn a_storm_needs_simultaneous_starts_and_a_burst() {
        let p = FleetPolicy::default();
        let starts: Vec<Start> = [100, 101, 103]
            .iter()
            .enumerate()
            .map(|(i, &t)| Start {
                instance: format!("i{i}"),
                time_ns: t * S,
            })
            .collect();
        // Steady 1 request / 10 s before, 60 in the 30 s after.
        let mut req: Vec<i64> = (0..10).map(|i| i * 10 * S).collect();
        req.extend((0..60).map(|i| 100 * S + i * S / 2));
        let f = restart_storm("svc", &starts, &req, &p).unwrap();
        assert!(f.evidence[1].contains("60 requests"), "{:?}", f.evidence);
        // Same starts, ordinary traffic: no storm.
        let calm: Vec<i64> = (0..40).map(|i| i * 5 * S).collect();
        assert!(restart_storm("svc", &starts, &calm, &p).is_none());
        // A burst but only one restart: no storm.
        assert!(restart_storm("svc", &starts[..1], &req, &p).is_none());
    }
}
