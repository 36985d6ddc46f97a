//! When a heap census is worth its cost: cheap signals read at every
//! request boundary (the interpreter's allocated blocks, the process's RSS)
//! are watched for growth across requests, with the same trend test the
//! diagnosis uses (analysis's `growth::Trend::grows`, past a floor of
//! [`MIN_SUSPICIOUS_BLOCKS`] or the diagnosis's host grain). A full census runs
//! when one of them grows for certain since the last census, plus a rare
//! baseline; a server that does not grow pays for the baselines only, and
//! those obey the duty cycle too, so a short run pays for none.
//!
//! No Python here: the sampler feeds readings in and asks when to census.

use std::time::{Duration, Instant};

use oomscope_analysis::growth;

/// A baseline census after these many completed requests: the first gives
/// later censuses something to grow from, the second a shape after warm-up.
pub const BASELINE_AT: [u64; 2] = [10, 50];

/// Fewer requests than this since the last census prove nothing new: a
/// census every few requests would cost more than it tells.
pub const MIN_REQUESTS_BETWEEN: u64 = 10;

/// Censuses (baselines included) take at most this share of wall time: a
/// census that cost 100 ms (of the agent thread's CPU) is followed by another
/// no sooner than 1 s later.
/// A leak keeps the suspicion up, so censuses come as fast as this allows.
pub const DEFAULT_DUTY: f64 = 0.1;

/// The first census has no measured cost to space it by: it is estimated
/// as this much per allocated block (`sys.getallocatedblocks()`, read by
/// the sampler anyway) and waits that over the duty cycle since the agent
/// started. A census walking 157k objects (torch imported, ~550k blocks)
/// took 80 to 86 ms of CPU on the 2-core VM at load 5, ~0.15 µs a block;
/// rounded up, so with torch the first census comes no sooner than ~0.9 s
/// after the start. Without torch (~10k blocks) it waits ~16 ms.
pub const FIRST_CENSUS_COST_PER_BLOCK: Duration = Duration::from_nanos(160);

/// Allocated blocks must grow at least this many since the last census to
/// raise suspicion: a clean server's interpreter keeps a few hundred more
/// blocks as it warms (caches, interned strings, the agent's own objects),
/// certain but no leak; a leak of small objects (100 KiB of dicts of
/// strings a request, ~300 blocks) crosses it within 15 requests. RSS must
/// grow what the diagnosis calls host growth (`growth::MIN_HOST_GROWTH_BYTES`):
/// less would name a type for a growth no verdict reports.
pub const MIN_SUSPICIOUS_BLOCKS: f64 = 4096.0;

/// The readings kept since the last census; past this, every other one is
/// dropped (bounded memory, and the window still spans every request since).
/// The trend test is O(n²): 64 readings cost tens of microseconds.
pub const MAX_READINGS: usize = 64;

/// The trend is tested once every this many new readings, not at each.
pub const TEST_EVERY: usize = 4;

/// Each census on suspicion doubles the requests the next one waits for
/// (from [`MIN_REQUESTS_BETWEEN`] up to this), so growth that never stops
/// but never kills (a cache filling for days) costs censuses that thin out
/// logarithmically; a look that finds the signals flat starts over.
pub const MAX_REQUESTS_BETWEEN: u64 = 10_000;

/// Drops every other reading (the first kept): a bounded list that still
/// spans every request since it started.
pub fn halve<T>(readings: &mut Vec<T>) {
    let mut i = 0;
    readings.retain(|_| {
        i += 1;
        i % 2 == 1
    });
}

/// One boundary's cheap signals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    pub requests_done: u64,
    /// `sys.getallocatedblocks()`; 0 when not read (a request end reads it
    /// only so often, see `Agent::read_blocks`) or unreadable.
    pub blocks: u64,
    /// Resident bytes; 0 when not read.
    pub rss: u64,
}

/// Why a census is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Baseline,
    /// Allocated blocks grew for certain since the last census.
    Blocks,
    /// RSS grew for certain since the last census.
    Rss,
    /// The last census itself found a type grown by [`MIN_CENSUS_FOUND_BYTES`]
    /// or more since the one before: the next looks whether it goes on.
    Census,
}

/// What a census must find grown (its top type's bytes, since the census
/// before) for the next to be due without the cheap signals' say-so: the
/// host grain the RSS suspicion uses. The readings start over at each
/// census, so after a census that ran late (held by the duty cycle) the
/// requests left in a burst may be too few to show growth again: a leak of
/// 256 KiB a request in vLLM's API server, 100 requests at 45 a second, had
/// its baselines at requests 10 and 82 and no third census.
pub const MIN_CENSUS_FOUND_BYTES: u64 = growth::MIN_HOST_GROWTH_BYTES as u64;

/// No reading for this long after a census that found growth: the burst
/// has ended, and the confirming census runs on whatever requests came
/// since (one is enough: census bytes are exact), not [`MIN_REQUESTS_BETWEEN`].
/// In vLLM's suite the late baseline came at request 95 of 100, and no
/// tenth request followed it.
pub const QUIET_AFTER_BURST: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct Suspicion {
    readings: Vec<Reading>,
    baselines_left: Vec<u64>,
    last_census_requests: Option<u64>,
    /// Requests the next census on suspicion waits for since the last census.
    between: u64,
    /// Readings since the trend was last tested.
    untested: usize,
    /// No census before this (the duty cycle); None until the first census,
    /// whose cost is estimated from `started` (see [`Suspicion::not_before`]).
    not_before: Option<Instant>,
    /// When the agent started: the wall time the first census is paid from.
    started: Instant,
    duty: f64,
    /// The last census found a type grown by [`MIN_CENSUS_FOUND_BYTES`].
    found: bool,
    /// When the latest reading came.
    last_reading: Option<Instant>,
}

impl Default for Suspicion {
    fn default() -> Self {
        Suspicion::new(DEFAULT_DUTY, Instant::now())
    }
}

impl Suspicion {
    pub fn new(duty: f64, started: Instant) -> Suspicion {
        Suspicion {
            readings: Vec::new(),
            baselines_left: BASELINE_AT.to_vec(),
            last_census_requests: None,
            between: MIN_REQUESTS_BETWEEN,
            untested: 0,
            not_before: None,
            started,
            duty: duty.clamp(1e-6, 1.0),
            found: false,
            last_reading: None,
        }
    }

    /// No census before this: the last census's cost over the duty cycle,
    /// or before any, the first one's estimate from the latest allocated
    /// blocks read ([`FIRST_CENSUS_COST_PER_BLOCK`]; none when unread).
    fn not_before(&self) -> Option<Instant> {
        self.not_before.or_else(|| {
            let blocks = self.readings.iter().rev().find(|r| r.blocks > 0)?.blocks;
            let cost = FIRST_CENSUS_COST_PER_BLOCK.mul_f64(blocks as f64);
            Some(self.started + cost.div_f64(self.duty))
        })
    }

    /// One boundary's readings, taken at `now` (the clock `due` is asked
    /// with).
    pub fn observe(&mut self, r: Reading, now: Instant) {
        if self.readings.len() >= MAX_READINGS {
            halve(&mut self.readings);
        }
        self.readings.push(r);
        self.untested += 1;
        self.last_reading = Some(now);
    }

    /// Whether a census is due now, and why.
    pub fn due(&mut self, now: Instant) -> Option<Reason> {
        let done = self.readings.last()?.requests_done;
        if self.not_before().is_some_and(|t| now < t) {
            return None;
        }
        if self.baselines_left.first().is_some_and(|&at| done >= at) {
            return Some(Reason::Baseline);
        }
        let since = done.saturating_sub(self.last_census_requests.unwrap_or(0));
        let quiet = self
            .last_reading
            .is_some_and(|t| now.saturating_duration_since(t) >= QUIET_AFTER_BURST);
        if self.found && quiet && since > 0 {
            self.untested = 0;
            return Some(Reason::Census);
        }
        if since < self.between || self.untested < TEST_EVERY {
            return None;
        }
        self.untested = 0;
        if self.found {
            return Some(Reason::Census);
        }
        let grows = |v: fn(&Reading) -> u64, floor: f64| {
            let pts: Vec<(f64, f64)> = self
                .readings
                .iter()
                .filter(|r| v(r) > 0)
                .map(|r| (r.requests_done as f64, v(r) as f64))
                .collect();
            growth::trend(&pts).is_some_and(|t| t.grows(f64::MIN_POSITIVE, floor))
        };
        let reason = if grows(|r| r.blocks, MIN_SUSPICIOUS_BLOCKS) {
            Some(Reason::Blocks)
        } else if grows(|r| r.rss, growth::MIN_HOST_GROWTH_BYTES) {
            Some(Reason::Rss)
        } else {
            None
        };
        if reason.is_none() {
            self.between = MIN_REQUESTS_BETWEEN;
        }
        reason
    }

    /// A census ran at `requests_done`, cost `cost` and found its top type
    /// grown by `grown` bytes since the census before: the readings start
    /// over (growth must show again since it, unless the census found
    /// [`MIN_CENSUS_FOUND_BYTES`]), and the next census on suspicion waits
    /// `cost / duty`.
    pub fn censused(&mut self, requests_done: u64, cost: Duration, grown: u64, now: Instant) {
        self.found = grown >= MIN_CENSUS_FOUND_BYTES;
        self.readings.clear();
        self.untested = 0;
        let baseline = self
            .baselines_left
            .first()
            .is_some_and(|&at| requests_done >= at);
        if !baseline && self.last_census_requests.is_some() {
            self.between = (2 * self.between).min(MAX_REQUESTS_BETWEEN);
        }
        self.baselines_left.retain(|&at| at > requests_done);
        self.last_census_requests = Some(requests_done);
        self.not_before = Some(now + cost.div_f64(self.duty));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(s: &mut Suspicion, from: u64, to: u64, blocks: impl Fn(u64) -> u64) {
        // Stamped at the start: the tests' clock is what `due` is asked.
        let at = s.started;
        for i in from..=to {
            s.observe(
                Reading {
                    requests_done: i,
                    blocks: blocks(i),
                    rss: 500 << 20,
                },
                at,
            );
        }
    }

    /// Allocated blocks with torch imported: a first census estimated at
    /// 88 ms, so held until 0.88 s after the start at 10 % duty.
    const TORCH_BLOCKS: u64 = 550_000;

    fn secs(t: f64) -> Duration {
        Duration::from_secs_f64(t)
    }

    #[test]
    fn baselines_come_at_10_and_50_requests_within_the_duty_cycle() {
        let t0 = Instant::now();
        let mut s = Suspicion::new(DEFAULT_DUTY, t0);
        feed(&mut s, 1, 9, |_| TORCH_BLOCKS);
        assert_eq!(s.due(t0 + secs(3600.0)), None, "9 requests");
        feed(&mut s, 10, 10, |_| TORCH_BLOCKS);
        assert_eq!(
            s.due(t0 + secs(0.85)),
            None,
            "the first census's estimated cost holds it back"
        );
        assert_eq!(s.due(t0 + secs(1.2)), Some(Reason::Baseline));
        s.censused(10, Duration::from_millis(100), 0, t0 + secs(1.2));
        feed(&mut s, 11, 49, |i| TORCH_BLOCKS + (i * 7919 % 13));
        assert_eq!(
            s.due(t0 + secs(3600.0)),
            None,
            "flat signals are no suspicion"
        );
        feed(&mut s, 50, 50, |_| TORCH_BLOCKS);
        assert_eq!(
            s.due(t0 + secs(2.1)),
            None,
            "the duty cycle holds back a baseline too: 100 ms at 10 %"
        );
        assert_eq!(s.due(t0 + secs(2.3)), Some(Reason::Baseline));
        s.censused(50, Duration::from_millis(100), 0, t0 + secs(2.3));
        for i in 51..=400 {
            feed(&mut s, i, i, |i| TORCH_BLOCKS + (i * 7919 % 13));
            assert_eq!(s.due(t0 + secs(3600.0)), None, "request {i}");
        }
    }

    #[test]
    fn the_first_census_waits_for_its_estimated_cost_from_the_start() {
        let t0 = Instant::now();
        let small = 10_000;
        let mut s = Suspicion::new(DEFAULT_DUTY, t0);
        feed(&mut s, 1, 10, |_| small);
        let wait = FIRST_CENSUS_COST_PER_BLOCK.mul_f64(small as f64 / DEFAULT_DUTY);
        assert_eq!(s.due(t0 + wait.mul_f64(0.9)), None);
        assert_eq!(s.due(t0 + wait.mul_f64(1.1)), Some(Reason::Baseline));
        // Blocks never read: nothing to estimate from, nothing held back.
        let mut unread = Suspicion::new(DEFAULT_DUTY, t0);
        feed(&mut unread, 1, 10, |_| 0);
        assert_eq!(unread.due(t0), Some(Reason::Baseline));
    }

    #[test]
    fn a_short_run_pays_for_one_baseline_at_most() {
        let t0 = Instant::now();
        let mut s = Suspicion::new(DEFAULT_DUTY, t0);
        // 60 requests of 10 ms: the first baseline is held past request 50.
        for i in 1..=60u64 {
            feed(&mut s, i, i, |_| TORCH_BLOCKS);
            let now = t0 + Duration::from_millis(10 * i);
            assert_eq!(s.due(now), None, "request {i}");
        }
        let late = t0 + secs(1.2);
        assert_eq!(s.due(late), Some(Reason::Baseline));
        s.censused(60, Duration::from_millis(100), 0, late);
        feed(&mut s, 61, 400, |i| TORCH_BLOCKS + (i * 7919 % 13));
        assert_eq!(
            s.due(late + secs(3600.0)),
            None,
            "the late census was both baselines"
        );
    }

    #[test]
    fn steady_growth_asks_for_a_census_within_the_duty_cycle() {
        let t0 = Instant::now();
        let mut s = Suspicion::new(DEFAULT_DUTY, t0);
        feed(&mut s, 1, 10, |i| 1000 + 1000 * i);
        s.censused(10, Duration::from_millis(100), 0, t0);
        feed(&mut s, 11, 19, |i| 1000 + 1000 * i + (i % 3));
        assert_eq!(s.due(t0 + Duration::from_secs(5)), None, "9 requests since");
        feed(&mut s, 20, 20, |i| 1000 + 1000 * i);
        assert_eq!(
            s.due(t0 + Duration::from_millis(500)),
            None,
            "100 ms at 10 % duty"
        );
        assert_eq!(s.due(t0 + Duration::from_secs(1)), Some(Reason::Blocks));
        // Growth that goes on: the next census waits twice as many requests.
        s.censused(
            20,
            Duration::from_millis(100),
            0,
            t0 + Duration::from_secs(1),
        );
        let t1 = t0 + Duration::from_secs(60);
        feed(&mut s, 21, 39, |i| 1000 + 1000 * i);
        assert_eq!(s.due(t1), None, "19 requests since, 20 needed");
        feed(&mut s, 40, 43, |i| 1000 + 1000 * i);
        assert_eq!(s.due(t1), Some(Reason::Blocks));
    }

    #[test]
    fn growth_a_census_found_asks_for_the_next_after_a_burst() {
        // A late baseline at request 82 of a 100-request burst: 18 readings
        // since, too few to show 4 MiB of RSS again; what the census found
        // is enough, once the duty cycle allows, at the next tick.
        let t0 = Instant::now();
        let mut s = Suspicion::new(DEFAULT_DUTY, t0);
        feed(&mut s, 1, 10, |_| TORCH_BLOCKS);
        s.censused(10, Duration::from_millis(100), 0, t0);
        s.censused(82, Duration::from_millis(100), 18 << 20, t0 + secs(1.5));
        feed(&mut s, 83, 100, |_| TORCH_BLOCKS);
        assert_eq!(s.due(t0 + secs(2.0)), None, "the duty cycle first");
        assert_eq!(s.due(t0 + secs(2.6)), Some(Reason::Census));
        // A late census near a burst's end: once no reading came for a
        // while, one request since is enough.
        let mut late = Suspicion::new(DEFAULT_DUTY, t0);
        feed(&mut late, 1, 10, |_| TORCH_BLOCKS);
        late.censused(10, Duration::from_millis(1), 0, t0);
        late.censused(95, Duration::from_millis(1), 20 << 20, t0);
        feed(&mut late, 96, 100, |_| TORCH_BLOCKS);
        assert_eq!(late.due(t0 + secs(0.5)), None, "the burst may go on");
        assert_eq!(late.due(t0 + secs(1.5)), Some(Reason::Census));
        // That census found nothing more: the signals decide again.
        s.censused(100, Duration::from_millis(100), 1 << 20, t0 + secs(2.6));
        feed(&mut s, 101, 200, |_| TORCH_BLOCKS);
        assert_eq!(s.due(t0 + secs(3600.0)), None);
    }

    #[test]
    fn a_clean_servers_creep_is_no_suspicion() {
        // Certain growth, but a few blocks and a few KiB of RSS a request:
        // what a clean interpreter keeps as it warms.
        let t0 = Instant::now();
        let mut s = Suspicion::new(DEFAULT_DUTY, t0);
        feed(&mut s, 1, 50, |_| TORCH_BLOCKS);
        s.censused(10, Duration::from_millis(10), 0, t0);
        s.censused(50, Duration::from_millis(10), 0, t0);
        for i in 51..=400u64 {
            s.observe(
                Reading {
                    requests_done: i,
                    blocks: TORCH_BLOCKS + 5 * i,
                    rss: (1 << 30) + i * 4096,
                },
                t0,
            );
            assert_eq!(s.due(t0 + secs(3600.0)), None, "request {i}");
        }
    }

    #[test]
    fn rss_alone_raises_suspicion() {
        let t0 = Instant::now();
        let mut s = Suspicion::new(DEFAULT_DUTY, t0);
        for i in 1..=10 {
            s.observe(
                Reading {
                    requests_done: i,
                    blocks: 0,
                    rss: 1 << 30,
                },
                t0,
            );
        }
        s.censused(10, Duration::from_millis(10), 0, t0);
        for i in 11..=30 {
            s.observe(
                Reading {
                    requests_done: i,
                    blocks: 0,
                    rss: (1 << 30) + i * 550_000,
                },
                t0,
            );
        }
        assert_eq!(s.due(t0 + Duration::from_secs(1)), Some(Reason::Rss));
    }

    #[test]
    fn readings_stay_bounded() {
        let mut s = Suspicion::default();
        feed(&mut s, 1, 10_000, |i| 1000 + i);
        assert!(s.readings.len() <= MAX_READINGS);
        assert_eq!(s.readings.first().map(|r| r.requests_done), Some(1));
        assert_eq!(s.readings.last().map(|r| r.requests_done), Some(10_000));
    }
}
