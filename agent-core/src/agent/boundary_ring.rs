//! Boundary readings, not boundary messages: a request's begin and end are
//! read on the request's own thread (the time, the request's facts, at an
//! end the process's RSS and the context) into a bounded ring, and the
//! sampler thread sends what gathered there as one sample at its own pace,
//! at most [`MAX_BATCHES_PER_S`] a second, whatever the request rate. The
//! request path wakes no thread per request: only the boundary that finds
//! the ring empty asks the sampler to come (once per batch at most).
//!
//! One batch keeps up to [`MAX_REQUESTS_PER_BATCH`] requests whole (their
//! begin and end readings); past that it keeps the extremes (the ends with
//! the lowest and highest RSS, the newest end, every failed one, with the
//! begins of those) and counts the rest as thinned, with their tokens and
//! span (`RequestReadings.thinned_*`). Begins of requests still in flight
//! are always kept: an OOM or a kill must find them started.
//!
//! No I/O but [`RssReader`], no Python: the Python agent (agent-python
//! `agent.rs`, `sampler.rs`) and the Rust agent can both fill and drain it.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::pb;

/// The most boundary messages an agent sends a second, at any request rate:
/// 20 agents' worth is what one collector ingested for one busy agent
/// before (6-8k samples/s saturate it; 409/s was one agent at 180
/// requests/s), and 50 ms still places an OOM's preceding requests finely.
pub const MAX_BATCHES_PER_S: u32 = 20;
/// The shortest spacing between two boundary messages (1 / [`MAX_BATCHES_PER_S`]).
pub const MIN_BATCH_SPACING: Duration = Duration::from_millis(1000 / MAX_BATCHES_PER_S as u64);
/// Requests one boundary message carries whole: 20 a second of them is
/// 4,000 requests/s in full, more than a Python server serves; a message
/// stays ~100 KB at most (a reading with its context is ~300-500 bytes).
pub const MAX_REQUESTS_PER_BATCH: usize = 200;
/// Readings held between two takes; past this the ring thins itself as a
/// batch would (the extremes kept, the rest counted), so a sampler that
/// falls behind costs bounded memory and still loses no count.
pub const MAX_RING_READINGS: usize = 4096;

/// An end finding this many readings thins the ring first: the quarter
/// left is room for begins, which cannot thin it themselves (they carry no
/// context to fold), so begins are refused only when requests begin by the
/// thousand without one ending.
const THIN_AT: usize = MAX_RING_READINGS / 4 * 3;

/// Merges the peaks of an `older` context (a thinned end's) into the
/// `newer` one kept: the runtime decides which of its numbers are peaks
/// (agent-python's `context::fold_peaks`).
pub type FoldPeaks = fn(newer: &mut pb::RequestContext, older: &pb::RequestContext);

/// The process's resident set from `/proc/self/statm`, one `pread` of an fd
/// kept open (~1-2 µs; `/proc/self/status`, which the sampler parses, is
/// ten times that). Opened per process: a forked child opens its own.
#[derive(Debug)]
pub struct RssReader {
    statm: Option<File>,
    page_bytes: u64,
}

impl RssReader {
    pub fn open() -> RssReader {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        RssReader {
            statm: File::open("/proc/self/statm").ok(),
            page_bytes: u64::try_from(page).unwrap_or(4096).max(1),
        }
    }

    /// The RSS now in bytes; 0 where it cannot be read.
    pub fn read(&self) -> u64 {
        let Some(f) = &self.statm else { return 0 };
        let mut buf = [0u8; 128];
        let Ok(n) = f.read_at(&mut buf, 0) else {
            return 0;
        };
        statm_resident(&buf[..n]).saturating_mul(self.page_bytes)
    }
}

/// The second field of statm ("size resident shared ..."), in pages.
fn statm_resident(text: &[u8]) -> u64 {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.split_ascii_whitespace().nth(1))
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

/// When the sampler takes the ring: at most once per `min_interval` (at
/// least [`MIN_BATCH_SPACING`]), and at once when the last take is older
/// than that, so any rate of requests costs at most that many host
/// readings and messages a second, each carrying every request since the
/// last. The periodic sample keeps [`MIN_BATCH_SPACING`] from the ring's
/// messages too (and they from it), so the cap holds for every message of
/// the agent, not for the ring's alone. The sampler's own state: the
/// request path only signals.
#[derive(Debug)]
pub struct Pacing {
    min_interval: Duration,
    /// The ring's last take.
    last: Option<Instant>,
    /// The last message of either kind.
    last_any: Option<Instant>,
    /// The request path said the ring holds something.
    signalled: bool,
}

impl Pacing {
    pub fn new(min_interval: Duration) -> Pacing {
        Pacing {
            min_interval: min_interval.max(MIN_BATCH_SPACING),
            last: None,
            last_any: None,
            signalled: false,
        }
    }

    /// Something waits in the ring.
    pub fn signal(&mut self) {
        self.signalled = true;
    }

    /// When the ring is due, if something waits in it.
    pub fn due(&self) -> Option<Instant> {
        if !self.signalled {
            return None;
        }
        let ring = self
            .last
            .map_or_else(Instant::now, |t| t + self.min_interval);
        let any = self.last_any.map(|t| t + MIN_BATCH_SPACING);
        Some(any.map_or(ring, |a| a.max(ring)))
    }

    /// What is left of [`MIN_BATCH_SPACING`] since the last message: what
    /// the periodic sample waits out before it goes.
    pub fn wait_left(&self) -> Duration {
        self.last_any.map_or(Duration::ZERO, |t| {
            (t + MIN_BATCH_SPACING).saturating_duration_since(Instant::now())
        })
    }

    /// The periodic sample went now: the ring's next message keeps the
    /// spacing from it.
    pub fn sent(&mut self) {
        self.last_any = Some(Instant::now());
    }

    /// Whether the ring is due now; if so it counts as taken now.
    pub fn take_due(&mut self) -> bool {
        if self.due().is_none_or(|t| t > Instant::now()) {
            return false;
        }
        let now = Instant::now();
        self.last = Some(now);
        self.last_any = Some(now);
        self.signalled = false;
        true
    }
}

/// Whether a reading is a request's end.
pub fn is_end(r: &pb::RequestReading) -> bool {
    r.boundary.as_ref().is_some_and(|b| !b.start)
}

/// The readings gathered since the last take, oldest first.
#[derive(Debug, Default)]
pub struct BoundaryRing {
    readings: Vec<pb::RequestReading>,
    /// What the ring thinned itself while the sampler was away.
    thinned: pb::RequestReadings,
    /// Begins refused with the ring full of begins alone (no end to thin).
    dropped: u64,
}

/// One take of the ring.
#[derive(Debug, Default)]
pub struct Taken {
    pub readings: Vec<pb::RequestReading>,
    /// Thinned already (`readings` empty): counts to carry into the batch.
    pub thinned: pb::RequestReadings,
    pub dropped: u64,
}

impl Taken {
    /// The end readings, oldest first (each one's RSS and context for the
    /// agent's own suspicion, before a batch thins them).
    pub fn ends(&self) -> impl Iterator<Item = &pb::RequestReading> {
        self.readings.iter().filter(|r| is_end(r))
    }

    /// The batch one message carries: at most [`MAX_REQUESTS_PER_BATCH`]
    /// requests whole, the rest thinned (see the module's doc).
    pub fn into_batch(self, fold: FoldPeaks) -> pb::RequestReadings {
        let (readings, mut thinned) = thin(self.readings, MAX_REQUESTS_PER_BATCH, fold);
        merge(&mut thinned, &self.thinned);
        thinned.readings = readings;
        thinned
    }
}

impl BoundaryRing {
    /// Whether nothing waits: the next boundary must wake the sampler.
    pub fn is_empty(&self) -> bool {
        self.readings.is_empty() && self.thinned.thinned_requests == 0 && self.dropped == 0
    }

    /// A request began at `time_ns` (`boundary.start` set).
    pub fn begin(&mut self, time_ns: i64, boundary: pb::RequestBoundary) {
        if self.readings.len() >= MAX_RING_READINGS {
            self.dropped += 1;
            return;
        }
        self.readings.push(pb::RequestReading {
            time_ns,
            boundary: Some(boundary),
            ..Default::default()
        });
    }

    /// A request ended: its reading (the boundary, RSS, context). A full
    /// ring thins itself first, keeping what a batch would.
    pub fn end(&mut self, reading: pb::RequestReading, fold: FoldPeaks) {
        if self.readings.len() >= THIN_AT {
            let (kept, thinned) = thin(
                std::mem::take(&mut self.readings),
                MAX_REQUESTS_PER_BATCH,
                fold,
            );
            merge(&mut self.thinned, &thinned);
            self.readings = kept;
        }
        if self.readings.len() >= MAX_RING_READINGS {
            self.dropped += 1;
            return;
        }
        self.readings.push(reading);
    }

    /// Everything gathered, leaving the ring empty.
    pub fn take(&mut self) -> Taken {
        Taken {
            readings: std::mem::take(&mut self.readings),
            thinned: std::mem::take(&mut self.thinned),
            dropped: std::mem::take(&mut self.dropped),
        }
    }
}

/// Adds the thinned counts of `more` into `into`.
fn merge(into: &mut pb::RequestReadings, more: &pb::RequestReadings) {
    if more.thinned_requests == 0 {
        return;
    }
    if into.thinned_requests == 0 {
        into.thinned_from_ns = more.thinned_from_ns;
    }
    into.thinned_requests += more.thinned_requests;
    into.thinned_prompt_tokens += more.thinned_prompt_tokens;
    into.thinned_output_tokens += more.thinned_output_tokens;
    into.thinned_from_ns = into.thinned_from_ns.min(more.thinned_from_ns);
    into.thinned_to_ns = into.thinned_to_ns.max(more.thinned_to_ns);
}

/// `readings` with at most `max` ends kept whole (see the module's doc),
/// and what was thinned. A thinned end's peaks go into the next end kept.
fn thin(
    readings: Vec<pb::RequestReading>,
    max: usize,
    fold: FoldPeaks,
) -> (Vec<pb::RequestReading>, pb::RequestReadings) {
    let mut thinned = pb::RequestReadings::default();
    let ends: Vec<usize> = (0..readings.len())
        .filter(|&i| is_end(&readings[i]))
        .collect();
    if ends.len() <= max {
        return (readings, thinned);
    }
    let mut keep = vec![false; readings.len()];
    // The newest, the lowest and highest RSS read, then failures (oldest
    // first) while room is left.
    let last = *ends.last().expect("more ends than max");
    let read = || ends.iter().copied().filter(|&i| readings[i].rss_bytes > 0);
    let low = read().min_by_key(|&i| readings[i].rss_bytes);
    let high = read().max_by_key(|&i| readings[i].rss_bytes);
    let mut kept = 0;
    for i in [Some(last), low, high].into_iter().flatten() {
        if !keep[i] {
            keep[i] = true;
            kept += 1;
        }
    }
    for &i in &ends {
        let failed = readings[i]
            .boundary
            .as_ref()
            .is_some_and(|b| !b.error.is_empty());
        if kept < max && failed && !keep[i] {
            keep[i] = true;
            kept += 1;
        }
    }
    // Each end's begin in this batch: the latest unmatched begin of its id.
    let mut open: HashMap<&str, Vec<usize>> = HashMap::new();
    let mut begin_of = vec![None; readings.len()];
    for (i, r) in readings.iter().enumerate() {
        let Some(b) = &r.boundary else { continue };
        if b.start {
            open.entry(b.request_id.as_str()).or_default().push(i);
        } else {
            begin_of[i] = open.get_mut(b.request_id.as_str()).and_then(Vec::pop);
        }
    }
    let mut drop = vec![false; readings.len()];
    for &i in &ends {
        if keep[i] {
            continue;
        }
        drop[i] = true;
        let end = &readings[i];
        let prompt = begin_of[i].map_or(0, |b| {
            drop[b] = true;
            readings[b].boundary.as_ref().map_or(0, |b| b.prompt_tokens)
        });
        if thinned.thinned_requests == 0 {
            thinned.thinned_from_ns = end.time_ns;
        }
        thinned.thinned_requests += 1;
        thinned.thinned_prompt_tokens += prompt;
        thinned.thinned_output_tokens += end.boundary.as_ref().map_or(0, |b| b.output_tokens);
        thinned.thinned_to_ns = thinned.thinned_to_ns.max(end.time_ns);
    }
    let mut out = Vec::with_capacity(readings.len() - drop.iter().filter(|d| **d).count());
    let mut peaks: Option<pb::RequestContext> = None;
    for (i, mut r) in readings.into_iter().enumerate() {
        if drop[i] {
            if let Some(c) = r.context.take() {
                match &mut peaks {
                    Some(p) => fold(p, &c),
                    None => peaks = Some(c),
                }
            }
            continue;
        }
        if is_end(&r) {
            if let (Some(p), Some(c)) = (peaks.take(), r.context.as_mut()) {
                fold(c, &p);
            }
        }
        out.push(r);
    }
    (out, thinned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fold(newer: &mut pb::RequestContext, older: &pb::RequestContext) {
        newer.queued = newer.queued.max(older.queued);
    }

    fn begin(ring: &mut BoundaryRing, id: &str, t: i64) {
        ring.begin(
            t,
            pb::RequestBoundary {
                request_id: id.into(),
                start: true,
                prompt_tokens: 10,
                ..Default::default()
            },
        );
    }

    fn end(ring: &mut BoundaryRing, id: &str, t: i64, done: u64, rss: u64, error: &str) {
        ring.end(
            pb::RequestReading {
                time_ns: t,
                boundary: Some(pb::RequestBoundary {
                    request_id: id.into(),
                    output_tokens: 3,
                    error: error.into(),
                    ..Default::default()
                }),
                rss_bytes: rss,
                context: Some(pb::RequestContext {
                    requests_done: done,
                    queued: done % 7,
                    ..Default::default()
                }),
                ..Default::default()
            },
            fold,
        );
    }

    fn ids(b: &pb::RequestReadings, start: bool) -> Vec<String> {
        b.readings
            .iter()
            .filter_map(|r| r.boundary.as_ref())
            .filter(|x| x.start == start)
            .map(|x| x.request_id.clone())
            .collect()
    }

    #[test]
    fn up_to_the_bound_every_begin_and_end_goes_in_order() {
        let mut ring = BoundaryRing::default();
        assert!(ring.is_empty());
        for i in 0..MAX_REQUESTS_PER_BATCH as u64 {
            begin(&mut ring, &format!("r{i}"), 2 * i as i64);
            end(
                &mut ring,
                &format!("r{i}"),
                2 * i as i64 + 1,
                i + 1,
                1000 + i,
                "",
            );
        }
        // A request still in flight: its begin goes too.
        begin(&mut ring, "open", 10_000);
        assert!(!ring.is_empty());
        let taken = ring.take();
        assert!(ring.is_empty());
        assert_eq!(taken.ends().count(), MAX_REQUESTS_PER_BATCH);
        let b = taken.into_batch(fold);
        assert_eq!(b.thinned_requests, 0);
        assert_eq!(b.readings.len(), 2 * MAX_REQUESTS_PER_BATCH + 1);
        assert!(b.readings.windows(2).all(|w| w[0].time_ns < w[1].time_ns));
        assert_eq!(ids(&b, true).last().unwrap(), "open");
        assert_eq!(ids(&b, false).len(), MAX_REQUESTS_PER_BATCH);
    }

    #[test]
    fn past_the_bound_the_extremes_failures_and_open_begins_are_kept_the_rest_counted() {
        let mut ring = BoundaryRing::default();
        let n = 500u64;
        begin(&mut ring, "open", 0);
        for i in 0..n {
            let id = format!("r{i}");
            begin(&mut ring, &id, 10 * i as i64 + 1);
            // RSS dips at request 100, peaks at request 300; 250 fails.
            let rss = match i {
                100 => 10,
                300 => 9_999,
                _ => 1000 + i % 5,
            };
            let error = if i == 250 { "RuntimeError: boom" } else { "" };
            end(&mut ring, &id, 10 * i as i64 + 2, i + 1, rss, error);
        }
        let b = ring.take().into_batch(fold);
        let ends = ids(&b, false);
        assert_eq!(ends, ["r100", "r250", "r300", "r499"]);
        // Each kept end keeps its begin; the request in flight keeps its.
        assert_eq!(ids(&b, true), ["open", "r100", "r250", "r300", "r499"]);
        assert_eq!(b.thinned_requests, n - 4);
        assert_eq!(b.thinned_prompt_tokens, 10 * (n - 4));
        assert_eq!(b.thinned_output_tokens, 3 * (n - 4));
        assert_eq!(b.thinned_from_ns, 2);
        assert_eq!(b.thinned_to_ns, 10 * 498 + 2);
        assert!(b.readings.windows(2).all(|w| w[0].time_ns < w[1].time_ns));
        // A thinned end's peak (queued 6 at request 97's end) is carried
        // by the next end kept.
        let r100 = b.readings.iter().find(|r| is_end(r)).unwrap();
        assert_eq!(r100.context.as_ref().unwrap().queued, 6);
    }

    #[test]
    fn a_ring_the_sampler_left_alone_stays_bounded_and_counts_what_it_thinned() {
        let mut ring = BoundaryRing::default();
        let n = 3 * MAX_RING_READINGS as u64;
        for i in 0..n {
            let id = format!("r{i}");
            begin(&mut ring, &id, 2 * i as i64);
            end(&mut ring, &id, 2 * i as i64 + 1, i + 1, 1000 + i, "");
            assert!(ring.readings.len() <= MAX_RING_READINGS);
        }
        let taken = ring.take();
        assert_eq!(taken.dropped, 0);
        let b = taken.into_batch(fold);
        let kept = ids(&b, false).len() as u64;
        assert!(kept <= MAX_REQUESTS_PER_BATCH as u64, "{kept}");
        // Nothing vanished: every request is kept or counted.
        assert_eq!(kept + b.thinned_requests, n);
        // The lowest RSS (the first) and the newest survive every thinning.
        assert_eq!(ids(&b, false).first().unwrap(), "r0");
        assert_eq!(ids(&b, false).last().unwrap(), &format!("r{}", n - 1));
        assert_eq!(b.thinned_from_ns, 3);
    }

    #[test]
    fn begins_alone_past_the_bound_are_counted_as_dropped() {
        let mut ring = BoundaryRing::default();
        for i in 0..MAX_RING_READINGS + 5 {
            begin(&mut ring, &format!("r{i}"), i as i64);
        }
        let taken = ring.take();
        assert_eq!(taken.readings.len(), MAX_RING_READINGS);
        assert_eq!(taken.dropped, 5);
    }

    #[test]
    fn pacing_takes_at_once_then_at_most_once_per_interval_and_only_when_signalled() {
        let mut p = Pacing::new(Duration::ZERO);
        assert_eq!(p.min_interval, MIN_BATCH_SPACING, "never under the floor");
        assert!(p.due().is_none() && !p.take_due(), "nothing signalled");
        p.signal();
        assert!(p.take_due(), "the first take is at once");
        assert!(p.due().is_none(), "taken: nothing waits");
        p.signal();
        let due = p.due().unwrap();
        assert!(due > Instant::now() + MIN_BATCH_SPACING / 2, "spaced");
        assert!(!p.take_due());
    }

    #[test]
    fn a_periodic_message_keeps_the_spacing_with_the_rings() {
        // Whatever the ring's own spacing (1 s here, or the floor), the
        // periodic sample keeps the cap's from the ring's last message.
        let taken = |ring: Duration| {
            let mut p = Pacing::new(ring);
            assert_eq!(p.wait_left(), Duration::ZERO, "nothing sent yet");
            p.signal();
            assert!(p.take_due());
            let left = p.wait_left();
            assert!(
                left > MIN_BATCH_SPACING / 2 && left <= MIN_BATCH_SPACING,
                "{left:?}"
            );
            p
        };
        taken(Duration::from_secs(1));
        let mut p = taken(Duration::ZERO);
        // The periodic sample went: the ring's next waits the spacing from it,
        // and what it holds is still due then.
        p.signal();
        p.sent();
        assert!(p.due().unwrap() > Instant::now() + MIN_BATCH_SPACING / 2);
        assert!(!p.take_due());
    }

    #[test]
    fn statm_gives_the_resident_pages_and_the_reader_a_plausible_rss() {
        assert_eq!(statm_resident(b"12345 678 90 1 0 2 0\n"), 678);
        assert_eq!(statm_resident(b"garbage"), 0);
        let rss = RssReader::open().read();
        // This test process holds at least a megabyte and less than a terabyte.
        assert!((1 << 20..1 << 40).contains(&rss), "{rss}");
    }
}
