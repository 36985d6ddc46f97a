//! How long a growth has before it fills its limit: requests, and time at the
//! request rate the timeline shows. The runway is what makes a growth
//! urgent, whatever its size per request: 550 KB a request is an hour at
//! 100 requests/s and a month at one a minute.

use crate::stats;
use crate::timeline::{Point, Timeline};
use crate::units::bytes_short;

/// Growth under this share of its limit per request (0.001 %) is "slow
/// growth": reported with its runway, never as a leak. At that share a limit
/// lasts 100,000 more requests; allocator arenas, caches that fill over days
/// and interned strings grow like that without anything being wrong.
pub const SLOW_GROWTH_SHARE: f64 = 1e-5;

/// A growth that fills its limit within this at the observed request rate is
/// urgent however small its share per request: a large host's limit gone by
/// tomorrow is a leak to hunt today, never "slow growth". Slow growth is for
/// runways of days or more.
pub const URGENT_RUNWAY_S: f64 = 86_400.0;

/// Every runway line starts with this, so the diagnosis can lift the
/// runway of its first growth cause to its own first lines.
pub const RUNWAY_PREFIX: &str = "runway: ";

/// The line of a growth with no limit in the evidence to run to (no cgroup
/// limit, no MemTotal, no device capacity): the growth still stands, only
/// its urgency is unknown.
pub const RUNWAY_UNKNOWN: &str = "runway unknown: no limit in the evidence";

/// A growth's way to its limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Runway<'a> {
    pub limit: u64,
    /// "MemTotal", "the cgroup limit", "the device's memory"
    pub limit_name: &'a str,
    /// Bytes in use now.
    pub used: u64,
    /// Growth per completed request (> 0).
    pub per_request: f64,
    /// The request rate while serving (`serving_rate`), when the timeline
    /// shows one.
    pub rate: Option<ServingRate>,
}

impl Runway<'_> {
    /// Requests left before the limit (0 when already over it).
    pub fn requests_left(&self) -> f64 {
        if self.per_request <= 0.0 {
            return f64::INFINITY;
        }
        (self.limit.saturating_sub(self.used) as f64 / self.per_request).floor()
    }

    /// Completed requests per second while serving.
    pub fn requests_per_s(&self) -> Option<f64> {
        self.rate.map(|r| r.per_s)
    }

    /// Seconds left at the observed request rate.
    pub fn seconds_left(&self) -> Option<f64> {
        self.requests_per_s()
            .filter(|r| *r > 0.0)
            .map(|r| self.requests_left() / r)
    }

    /// The limit's share that each request takes.
    pub fn share_per_request(&self) -> f64 {
        self.per_request / self.limit.max(1) as f64
    }

    /// Under [`SLOW_GROWTH_SHARE`] of the limit per request, and not gone
    /// within [`URGENT_RUNWAY_S`] at the observed rate.
    pub fn is_slow(&self) -> bool {
        self.share_per_request() < SLOW_GROWTH_SHARE
            && self.seconds_left().is_none_or(|s| s >= URGENT_RUNWAY_S)
    }

    /// "runway: at 100 requests/s while serving, the 23.5 GiB of
    /// MemTotal is gone in about 4 hours (about 1440000 more requests at
    /// 550.0 KiB each)"
    pub fn line(&self) -> String {
        let limit = format!("the {} of {}", bytes_short(self.limit), self.limit_name);
        let requests = format!(
            "about {} more requests at {} each",
            self.requests_left(),
            bytes_short(self.per_request.max(0.0).round() as u64)
        );
        match (self.requests_per_s(), self.seconds_left()) {
            (Some(rate), Some(secs)) => format!(
                "{RUNWAY_PREFIX}at {} while serving, {limit} is gone in {} ({requests})",
                rate_text(rate),
                duration_text(secs)
            ),
            _ => format!("{RUNWAY_PREFIX}{limit} is gone in {requests}"),
        }
    }

    /// requests_to_limit, limit_bytes, limit_share_per_request, and
    /// seconds_to_limit with requests_per_s where the rate is known.
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        let mut m = vec![
            ("requests_to_limit", self.requests_left()),
            ("limit_bytes", self.limit as f64),
            ("limit_share_per_request", self.share_per_request()),
        ];
        if let (Some(rate), Some(secs)) = (self.requests_per_s(), self.seconds_left()) {
            m.push(("requests_per_s", rate));
            m.push(("seconds_to_limit", secs));
        }
        m
    }
}

/// A stretch with no request completed and none in flight at either end is
/// idle, not serving, when it lasts this many times the typical time per
/// request...
pub const IDLE_FACTOR: f64 = 10.0;

/// ...and at least this long: a client's think time between requests (a
/// person reading a reply, a batch job's pause) is part of serving, never
/// left out of the rate.
pub const MIN_IDLE_S: f64 = 10.0;

/// The request rate while serving: completed requests over the time the
/// server was serving, idle stretches left out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ServingRate {
    pub per_s: f64,
    /// The seconds the rate is taken over.
    pub serving_s: f64,
    /// The idle stretches left out, in seconds.
    pub idle_s: f64,
}

impl ServingRate {
    /// "the runway's rate is 36 requests/s while serving: 199 requests
    /// completed over 5.5 s of serving; 1 hour idle ... left out", None where
    /// nothing was left out (the runway line says the rate).
    pub fn idle_line(&self) -> Option<String> {
        (self.idle_s > 0.0).then(|| {
            format!(
                "the runway's rate is {} while serving: {:.0} requests completed over {:.1} s of serving; {} idle (no request in flight or completed) left out",
                rate_text(self.per_s),
                self.per_s * self.serving_s,
                self.serving_s,
                duration_text(self.idle_s).trim_start_matches("about ")
            )
        })
    }
}

/// Completed requests per second while serving, between the first reading
/// that counts requests and the first that shows the last count (readings
/// of an idle server after its last request do not slow the rate), with the
/// time it is taken over; None without two such readings apart in time.
/// Idle stretches inside
/// the span are left out: consecutive readings with the request count
/// unchanged and nothing in flight at either end, together longer than
/// [`MIN_IDLE_S`] and [`IDLE_FACTOR`] times the typical time per request (a
/// server idle for an hour between two bursts must not get a runway a
/// hundred times too long). Think time between requests never reaches that.
pub fn serving_rate(tl: &Timeline) -> Option<ServingRate> {
    let counted: Vec<&Point> = tl.points.iter().filter(|p| p.requests_done > 0).collect();
    let first = *counted.first()?;
    let most = counted.iter().map(|p| p.requests_done).max()?;
    let end = counted.iter().position(|p| p.requests_done == most)?;
    let span = &counted[..=end];
    let secs = |a: &Point, b: &Point| (b.time_ns - a.time_ns) as f64 / 1e9;
    // The typical time per request: the median over completed requests of
    // the time between the readings that counted them.
    let per_request: Vec<(f64, u64)> = span
        .windows(2)
        .filter(|w| w[1].requests_done > w[0].requests_done)
        .map(|w| {
            let n = w[1].requests_done - w[0].requests_done;
            (secs(w[0], w[1]) / n as f64, n)
        })
        .collect();
    let typical = stats::weighted_median(per_request).unwrap_or(0.0);
    let threshold = MIN_IDLE_S.max(IDLE_FACTOR * typical);
    let (mut idle, mut stretch) = (0.0, 0.0);
    for w in span.windows(2) {
        let quiet =
            w[1].requests_done == w[0].requests_done && !w[0].in_request() && !w[1].in_request();
        if quiet {
            stretch += secs(w[0], w[1]);
            continue;
        }
        if stretch > threshold {
            idle += stretch;
        }
        stretch = 0.0;
    }
    if stretch > threshold {
        idle += stretch;
    }
    let serving_s = secs(first, span[end]) - idle;
    let requests = most.checked_sub(first.requests_done)? as f64;
    (serving_s > 0.0 && requests > 0.0).then(|| ServingRate {
        per_s: requests / serving_s,
        serving_s,
        idle_s: idle,
    })
}

/// "100 requests/s", "2.5 requests/s", "12 requests/min"
pub fn rate_text(per_s: f64) -> String {
    if per_s >= 10.0 {
        format!("{per_s:.0} requests/s")
    } else if per_s >= 1.0 {
        format!("{per_s:.1} requests/s")
    } else {
        format!("{:.1} requests/min", per_s * 60.0)
    }
}

/// "about 40 seconds", "about 4 hours", "about 3 days", "about 2 years"
pub fn duration_text(secs: f64) -> String {
    const UNITS: [(&str, f64); 6] = [
        ("seconds", 1.0),
        ("minutes", 60.0),
        ("hours", 3600.0),
        ("days", 86_400.0),
        ("weeks", 7.0 * 86_400.0),
        ("years", 365.25 * 86_400.0),
    ];
    if !secs.is_finite() {
        return "never at this rate".to_string();
    }
    // The largest unit that gives at least 1.5 of it (90 s stays seconds).
    let (name, size) = UNITS
        .iter()
        .rev()
        .find(|(_, size)| secs >= 1.5 * size)
        .copied()
        .unwrap_or(UNITS[0]);
    format!("about {:.0} {name}", (secs / size).round())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn at(per_s: f64) -> ServingRate {
        ServingRate {
            per_s,
            serving_s: 60.0,
            idle_s: 0.0,
        }
    }

    fn runway(rate: Option<f64>) -> Runway<'static> {
        Runway {
            limit: 47 * GIB / 2,
            limit_name: "MemTotal",
            used: GIB,
            per_request: 550_000.0,
            rate: rate.map(at),
        }
    }

    #[test]
    fn the_line_says_time_at_the_observed_rate_and_requests() {
        let r = runway(Some(100.0));
        // (23.5 - 1) GiB / 550 kB = 43,925 requests, 439 s at 100/s.
        assert_eq!(r.requests_left(), 43_925.0);
        assert!((r.seconds_left().unwrap() - 439.25).abs() < 1e-9);
        assert_eq!(
            r.line(),
            "runway: at 100 requests/s while serving, the 23.5 GiB of MemTotal is gone in about 7 minutes (about 43925 more requests at 537.1 KiB each)"
        );
        let m = r.metrics();
        assert!(m.contains(&("seconds_to_limit", 439.25)));
        assert!(m.contains(&("requests_per_s", 100.0)));
    }

    #[test]
    fn without_a_rate_the_runway_is_in_requests() {
        let r = runway(None);
        assert_eq!(
            r.line(),
            "runway: the 23.5 GiB of MemTotal is gone in about 43925 more requests at 537.1 KiB each"
        );
        assert!(r.metrics().iter().all(|(k, _)| *k != "seconds_to_limit"));
    }

    #[test]
    fn slow_growth_is_under_a_thousandth_of_a_percent_per_request() {
        let mut r = runway(None);
        r.per_request = 1e-5 * r.limit as f64 * 0.99;
        assert!(r.is_slow());
        r.per_request = 1e-5 * r.limit as f64 * 1.01;
        assert!(!r.is_slow());
    }

    #[test]
    fn a_small_share_gone_within_a_day_at_the_observed_rate_is_not_slow() {
        let mut r = runway(Some(1.0));
        r.per_request = 1e-5 * r.limit as f64 * 0.99;
        // About 100,000 requests left: over a day at 1 request/s, ...
        assert!(r.seconds_left().unwrap() > URGENT_RUNWAY_S);
        assert!(r.is_slow());
        // ... about 17 minutes at 100.
        r.rate = Some(at(100.0));
        assert!(r.seconds_left().unwrap() < URGENT_RUNWAY_S);
        assert!(!r.is_slow());
    }

    #[test]
    fn durations_read_in_the_largest_unit_that_fits() {
        assert_eq!(duration_text(40.0), "about 40 seconds");
        assert_eq!(duration_text(4.0 * 3600.0 + 100.0), "about 4 hours");
        assert_eq!(duration_text(3.0 * 86_400.0), "about 3 days");
        assert_eq!(duration_text(800.0 * 86_400.0), "about 2 years");
        assert_eq!(rate_text(0.5), "30.0 requests/min");
        assert_eq!(rate_text(2.54), "2.5 requests/s");
    }
}
