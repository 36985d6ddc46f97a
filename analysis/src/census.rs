//! The Python heap census as a series: each HeapCensus placed at the number
//! of requests completed when it ran, and each type's bytes fitted against it.
//!
//! On a process without a device allocator (a CPU server) the census is the
//! only count of live bytes there is: what a leak grows and what a collection
//! gives back. Its bytes are exact (tensor storage nbytes, each storage counted
//! once), not rounded up to allocator blocks, so a smaller window shows growth
//! than on a device. But a census is expensive, so there are only a handful;
//! they cannot reach significance on their own. A verdict therefore also needs
//! the host's between-request readings (one per request) to rise significantly
//! over the same requests: the census names and sizes the growth, the host
//! readings prove it is not chance.

use std::collections::BTreeSet;

use crate::findings::Findings;
use crate::growth::{
    self, Trend, MIN_LEAK_BYTES_PER_REQUEST, MIN_SIGNAL_TO_NOISE, MIN_TREND_POINTS, PERSISTENCE,
    RECLAIMED_SHARE,
};
use crate::pb;
use crate::pb::event::Kind;
use crate::stats;
use crate::timeline::{Point, Timeline};
use crate::units::bytes_short;

/// The phase of the sample an agent sends just before each census: its
/// `requests_done` is the census's place in the request count.
use oomscope_proto::CENSUS_PHASE;

/// Fewer censuses than this cannot show that growth persists (the later half
/// needs two of them).
pub const MIN_CENSUSES: usize = 3;

/// A type's growth worth a verdict: the same per-request floor as a device
/// leak...
pub const MIN_CENSUS_BYTES_PER_REQUEST: f64 = MIN_LEAK_BYTES_PER_REQUEST;

/// ...and at least this much between the first and last census. Smaller than
/// the device's window floor because census bytes are exact: there is no
/// block rounding or cache to hide inside, only real objects.
pub const MIN_CENSUS_GROWTH_BYTES: f64 = (4u64 << 20) as f64;

/// Kendall's tau of a type's bytes across censuses: most pairs of censuses
/// must agree that it rose (one census that caught a request's temporaries
/// may flip a pair or two).
pub const MIN_CENSUS_TAU: f64 = 0.6;

/// A type named as retained alongside the largest grower gains at least this
/// many objects per request (one response object per request is 1.0).
pub const MIN_OBJECTS_PER_REQUEST: f64 = 0.5;

/// At most this many other retained types are named in the evidence.
pub const MAX_OTHER_TYPES: usize = 3;

/// The host readings must rise at least this share of the census's bytes per
/// request: retained CPU objects are resident memory the host is charged for,
/// though RSS can trail them while the allocator reuses chunks freed earlier.
/// Census noise (a request's temporaries caught by one scan) moves no RSS.
pub const MIN_HOST_SHARE: f64 = 0.5;

/// With fewer censuses than a trend test needs, each interval between two
/// of them must grow within this factor of the fitted rate: retained objects
/// pile up at the rate requests arrive, while a census that caught a burst of
/// temporaries makes one interval jump and the next stall. 1.5 leaves room
/// for responses of different sizes; on seeded noise (four censuses catching
/// 0 to 32 MiB of temporaries, RSS creeping 256 KiB per request) it keeps false
/// leaks under one in a thousand (tests/heap_census.rs).
pub const STEADY_FACTOR: f64 = 1.5;

/// The generation of a full collection: the only one that collects old
/// reference cycles, so the only one whose effect on the census is telling.
pub const FULL_COLLECTION: i32 = 2;

/// One census and the requests completed when it ran.
#[derive(Clone, Copy, Debug)]
pub struct CensusPoint<'a> {
    pub time_ns: i64,
    pub requests_done: u64,
    pub census: &'a pb::HeapCensus,
}

impl CensusPoint<'_> {
    pub fn get(&self, type_name: &str) -> Option<&pb::TypeCount> {
        self.census.types.iter().find(|t| t.type_name == type_name)
    }
}

/// How the agent marks a census whose budget ran out before its scan
/// ended: the first line of its referrer chain starts with this.
pub const PARTIAL_MARK: &str = "(partial census";

/// Whether the scan stopped early: its counts are a part of the heap, and
/// a type's bytes in it say nothing about growth.
pub fn is_partial(c: &pb::HeapCensus) -> bool {
    c.referrer_chain
        .first()
        .is_some_and(|l| l.starts_with(PARTIAL_MARK))
}

/// Every whole census in time order (partial ones left out), each at the
/// requests done by its census-phase sample (sent just before it), else by
/// the latest reading before it.
pub fn points<'a>(events: &'a [pb::Event], tl: &Timeline) -> Vec<CensusPoint<'a>> {
    let mut censuses: Vec<(i64, &pb::HeapCensus)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::HeapCensus(h)) if !is_partial(h) => Some((e.time_ns, h)),
            _ => None,
        })
        .collect();
    censuses.sort_by_key(|(t, _)| *t);
    let mut since = i64::MIN;
    censuses
        .into_iter()
        .map(|(t, census)| {
            let marked = tl
                .points
                .iter()
                .rev()
                .find(|p| p.time_ns > since && p.time_ns <= t && p.phase == CENSUS_PHASE);
            let requests_done = marked.map(|p| p.requests_done).unwrap_or_else(|| {
                tl.points
                    .iter()
                    .filter(|p| p.time_ns <= t)
                    .map(|p| p.requests_done)
                    .max()
                    .unwrap_or(0)
            });
            since = t;
            CensusPoint {
                time_ns: t,
                requests_done,
                census,
            }
        })
        .collect()
}

/// One type's bytes (and objects) fitted against completed requests, over
/// the censuses that list it (the first census of a process lists only the
/// largest types, so an unlisted type is unknown there, not absent).
#[derive(Clone, Debug)]
pub struct TypeGrowth {
    pub name: String,
    pub bytes: Trend,
    pub objects: Option<Trend>,
    pub censuses: usize,
    /// Kendall's tau of the bytes.
    pub tau: f64,
    /// Kendall's tau of the object count.
    pub objects_tau: f64,
    /// The slowest and fastest growth between consecutive censuses, bytes
    /// per request.
    pub steps: (f64, f64),
    /// A census counted some of its objects without sizing them
    /// (`TypeCount.bytes_estimated`): its bytes there are estimated.
    pub estimated: bool,
}

impl TypeGrowth {
    pub fn bytes_per_request(&self) -> f64 {
        self.bytes.line.slope
    }

    pub fn objects_per_request(&self) -> f64 {
        self.objects.map_or(0.0, |o| o.line.slope)
    }

    /// Bytes that grow persistently, by at least the minimum effect.
    pub fn persists(&self) -> bool {
        let t = &self.bytes;
        let growth = t.line.slope * t.span;
        self.censuses >= MIN_CENSUSES
            && self.tau >= MIN_CENSUS_TAU
            && t.line.slope >= MIN_CENSUS_BYTES_PER_REQUEST
            && growth >= MIN_CENSUS_GROWTH_BYTES
            && growth >= MIN_SIGNAL_TO_NOISE * t.residual_sigma
            && t.later_slope >= PERSISTENCE * t.line.slope
            && (self.censuses >= MIN_TREND_POINTS || self.steady())
    }

    /// Every interval between censuses grew at the fitted rate within a
    /// factor of [`STEADY_FACTOR`] either way.
    fn steady(&self) -> bool {
        let (slowest, fastest) = self.steps;
        let rate = self.bytes.line.slope;
        slowest * STEADY_FACTOR >= rate && fastest <= STEADY_FACTOR * rate
    }

    /// Objects that pile up persistently, at least [`MIN_OBJECTS_PER_REQUEST`].
    pub fn objects_persist(&self) -> bool {
        self.objects.is_some_and(|o| {
            self.censuses >= MIN_CENSUSES
                && self.objects_tau >= MIN_CENSUS_TAU
                && o.line.slope >= MIN_OBJECTS_PER_REQUEST
                && o.later_slope >= PERSISTENCE * o.line.slope
        })
    }
}

/// Every type listed in at least [`MIN_CENSUSES`] censuses, largest bytes
/// per request first.
pub fn type_growths(pts: &[CensusPoint]) -> Vec<TypeGrowth> {
    let names: BTreeSet<&str> = pts
        .iter()
        .flat_map(|p| p.census.types.iter().map(|t| t.type_name.as_str()))
        .collect();
    let mut out: Vec<TypeGrowth> = names
        .into_iter()
        .filter_map(|name| {
            let listed: Vec<(f64, &pb::TypeCount)> = pts
                .iter()
                .filter_map(|p| p.get(name).map(|t| (p.requests_done as f64, t)))
                .collect();
            if listed.len() < MIN_CENSUSES {
                return None;
            }
            let bytes: Vec<(f64, f64)> = listed.iter().map(|(x, t)| (*x, t.bytes as f64)).collect();
            let count: Vec<(f64, f64)> = listed.iter().map(|(x, t)| (*x, t.count as f64)).collect();
            let tau = |s: &[(f64, f64)]| stats::mann_kendall(s).map_or(0.0, |m| m.tau);
            Some(TypeGrowth {
                name: name.to_string(),
                bytes: growth::trend(&bytes)?,
                objects: growth::trend(&count),
                censuses: listed.len(),
                tau: tau(&bytes),
                objects_tau: tau(&count),
                steps: steps(&bytes),
                estimated: listed.iter().any(|(_, t)| t.bytes_estimated),
            })
        })
        .collect();
    out.sort_by(|a, b| {
        b.bytes_per_request()
            .total_cmp(&a.bytes_per_request())
            .then_with(|| a.name.cmp(&b.name))
    });
    out
}

/// The smallest and largest rise per request between consecutive readings.
/// A few censuses fit a line too easily (Theil–Sen passes through two of
/// four), so with few of them every interval must show the same growth:
/// retained objects pile up at a steady rate, while temporaries caught by one
/// scan make one interval jump and the next fall.
fn steps(points: &[(f64, f64)]) -> (f64, f64) {
    points
        .windows(2)
        .filter(|w| w[1].0 > w[0].0)
        .map(|w| (w[1].1 - w[0].1) / (w[1].0 - w[0].0))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| {
            (lo.min(r), hi.max(r))
        })
}

/// What says the census growth is not chance.
#[derive(Clone, Copy, Debug)]
pub struct Significance {
    /// "host RSS" | "cgroup usage" | "the heap censuses"
    pub what: &'static str,
    pub p_value: f64,
    pub readings: usize,
    /// The host's own growth per request, when the host readings carried it.
    pub host_bytes_per_request: Option<f64>,
}

/// Persistent, significant growth of the Python heap between two censuses.
#[derive(Clone, Debug)]
pub struct HeapGrowth<'a> {
    /// The type whose bytes grew most.
    pub top: TypeGrowth,
    /// Other types whose objects pile up (response objects, their dicts).
    pub others: Vec<TypeGrowth>,
    pub significance: Significance,
    pub first: CensusPoint<'a>,
    pub last: CensusPoint<'a>,
    /// The agent's referrer chain for its top grower, outermost first.
    pub chain: &'a [String],
}

impl HeapGrowth<'_> {
    pub fn requests(&self) -> f64 {
        self.top.bytes.span
    }

    pub fn censuses(&self) -> usize {
        self.top.censuses
    }

    /// "torch.Tensor[cpu] +1.0 objects per request; also retained: __main__.Completion +1.0 per request",
    /// and whether the top type's bytes were estimated.
    pub fn objects_line(&self) -> String {
        let mut line = format!(
            "{} +{:.1} objects per request",
            self.top.name,
            self.top.objects_per_request().max(0.0)
        );
        if !self.others.is_empty() {
            let others: Vec<String> = self
                .others
                .iter()
                .map(|o| format!("{} +{:.1}", o.name, o.objects_per_request()))
                .collect();
            line.push_str(&format!(
                "; also retained per request: {}",
                others.join(", ")
            ));
        }
        line + estimated_note(self.top.estimated)
    }

    /// "between requests the Python heap's torch.Tensor[cpu] rose from ..."
    pub fn growth_line(&self) -> String {
        let t = &self.top.bytes;
        format!(
            "between requests the Python heap's {} rose from {} to {} over {} requests: {} per request (Theil–Sen over {} heap censuses, requests {} to {}; still rising in the later half)",
            self.top.name,
            bytes_short(t.first_bytes.max(0.0) as u64),
            bytes_short(t.last_bytes.max(0.0) as u64),
            t.span,
            bytes_short(self.top.bytes_per_request().max(0.0).round() as u64),
            self.censuses(),
            self.first.requests_done,
            self.last.requests_done,
        )
    }

    /// Why the growth is not chance: the host readings rose with it, or the
    /// censuses alone are significant.
    pub fn significance_line(&self) -> String {
        let s = &self.significance;
        match s.host_bytes_per_request {
            Some(host) => format!(
                "{} between requests rose with it over the same requests: {} per request (Mann–Kendall p = {:.1e} over {} readings)",
                s.what,
                bytes_short(host.max(0.0).round() as u64),
                s.p_value,
                s.readings
            ),
            None => format!(
                "the rise is significant across {} censuses (Mann–Kendall p = {:.1e})",
                s.readings, s.p_value
            ),
        }
    }

    /// "held by a -> b -> c", when the agent found a chain.
    pub fn chain_line(&self) -> Option<String> {
        (!self.chain.is_empty()).then(|| format!("held by {}", self.chain.join(" -> ")))
    }
}

/// Heap growth over these censuses: the type with the largest persistent
/// byte growth, made significant by the host readings over the same requests
/// (or by the censuses themselves when there are enough of them).
pub fn growth_over<'a>(pts: &[CensusPoint<'a>], tl: &Timeline) -> Option<HeapGrowth<'a>> {
    let (first, last) = (*pts.first()?, *pts.last()?);
    let growths = type_growths(pts);
    let top = growths.iter().find(|g| g.persists())?.clone();
    let from_censuses = Significance {
        what: "the heap censuses",
        p_value: top.bytes.p_value,
        readings: top.bytes.points,
        host_bytes_per_request: None,
    };
    let censuses_suffice =
        top.bytes.points >= MIN_TREND_POINTS && top.bytes.p_value < growth::TREND_P_VALUE;
    let min_host_slope = MIN_HOST_SHARE * top.bytes_per_request();
    let significance = host_significance(tl, &first, &last, min_host_slope)
        .or(censuses_suffice.then_some(from_censuses))?;
    let others = growths
        .iter()
        .filter(|g| g.name != top.name && g.objects_persist())
        .take(MAX_OTHER_TYPES)
        .cloned()
        .collect();
    let chain = pts
        .iter()
        .rev()
        .map(|p| p.census.referrer_chain.as_slice())
        .find(|c| !c.is_empty())
        .unwrap_or(&[]);
    Some(HeapGrowth {
        top,
        others,
        significance,
        first,
        last,
        chain,
    })
}

/// The host's between-request readings from the first census's request count
/// to the last census: RSS, else the cgroup's usage. Significant when they
/// rise by Mann–Kendall at the leak's level over enough readings, by at
/// least `min_slope` bytes per request.
fn host_significance(
    tl: &Timeline,
    first: &CensusPoint,
    last: &CensusPoint,
    min_slope: f64,
) -> Option<Significance> {
    let series = |v: fn(&Point) -> Option<u64>| -> Vec<(f64, f64)> {
        tl.points
            .iter()
            .filter(|p| {
                p.is_baseline()
                    && p.time_ns <= last.time_ns
                    && (first.requests_done..=last.requests_done).contains(&p.requests_done)
            })
            .filter_map(|p| v(p).map(|b| (p.requests_done as f64, b as f64)))
            .collect()
    };
    [
        // The server's own memory: the agent's heap is not its growth.
        ("host RSS", series(Point::server_rss)),
        ("cgroup usage", series(Point::server_cgroup_usage)),
    ]
    .into_iter()
    .find_map(|(what, s)| {
        let t = growth::trend(&s)?;
        (t.points >= MIN_TREND_POINTS
            && t.p_value < growth::TREND_P_VALUE
            && t.line.slope > 0.0
            && t.line.slope >= min_slope)
            .then_some(Significance {
                what,
                p_value: t.p_value,
                readings: t.points,
                host_bytes_per_request: Some(t.line.slope),
            })
    })
}

/// Two whole censuses this many requests apart or more name a growing
/// type; closer ones mostly differ by the temporaries each caught.
pub const MIN_NAMING_REQUESTS: u64 = 20;

/// What the censuses say grew, when they are too few (or too young) for
/// [`growth_over`]'s trend: the type whose bytes grew most per request
/// between an earlier whole census and the latest, and the chain the agent
/// found for it. It names and sizes a growth the host readings proved; it
/// proves nothing by itself.
#[derive(Clone, Debug)]
pub struct NamedGrowth<'a> {
    pub name: String,
    pub bytes_per_request: f64,
    pub objects_per_request: f64,
    pub from: CensusPoint<'a>,
    pub to: CensusPoint<'a>,
    /// The latest chain whose leaf is this type, outermost first.
    pub chain: &'a [String],
    /// Either census estimated its bytes (`TypeCount.bytes_estimated`).
    pub estimated: bool,
}

/// Said after a growth whose bytes a census estimated.
fn estimated_note(estimated: bool) -> &'static str {
    if estimated {
        "; its bytes partly estimated (a census on suspicion counted some of its objects without sizing them, at the type's last measured mean size)"
    } else {
        ""
    }
}

impl NamedGrowth<'_> {
    /// "the heap census names the growing type: bytes +195.3 KiB (+1.0 objects) per request (99% of the host growth) between censuses at requests 40 and 90"
    pub fn line(&self, host_per_request: f64) -> String {
        let mut line = format!(
            "the heap census names the growing type: {} +{} (+{:.1} objects) per request",
            self.name,
            bytes_short(self.bytes_per_request.max(0.0).round() as u64),
            self.objects_per_request.max(0.0),
        );
        if host_per_request > 0.0 {
            line.push_str(&format!(
                " ({:.0}% of the host growth)",
                100.0 * self.bytes_per_request / host_per_request
            ));
        }
        line.push_str(&format!(
            " between censuses at requests {} and {}",
            self.from.requests_done, self.to.requests_done
        ));
        line + estimated_note(self.estimated)
    }

    /// "held by a -> b -> c", when the agent found a chain.
    pub fn chain_line(&self) -> Option<String> {
        (!self.chain.is_empty()).then(|| format!("held by {}", self.chain.join(" -> ")))
    }
}

/// The type that grew most in bytes per request from the latest whole
/// census at least [`MIN_NAMING_REQUESTS`] before the last one (else the
/// first) to the last, with its chain where a census found one.
pub fn named_growth<'a>(pts: &[CensusPoint<'a>]) -> Option<NamedGrowth<'a>> {
    let to = *pts.last()?;
    let from = *pts
        .iter()
        .rev()
        .find(|p| p.requests_done + MIN_NAMING_REQUESTS <= to.requests_done)
        .or_else(|| pts.first())?;
    let requests = to.requests_done.checked_sub(from.requests_done)? as f64;
    if requests < 1.0 {
        return None;
    }
    let (name, db, dc, estimated) = to
        .census
        .types
        .iter()
        .filter_map(|t| {
            // A type the earlier census did not list was under its lists'
            // cut, not absent: its growth from there is unknown.
            let before = from.get(&t.type_name)?;
            let db = t.bytes as f64 - before.bytes as f64;
            let dc = t.count as f64 - before.count as f64;
            let estimated = t.bytes_estimated || before.bytes_estimated;
            (db > 0.0).then_some((t.type_name.as_str(), db, dc, estimated))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(a.0)))?;
    let chain = pts
        .iter()
        .rev()
        .map(|p| p.census.referrer_chain.as_slice())
        .find(|c| {
            c.last()
                .is_some_and(|leaf| leaf.split(' ').next() == Some(name))
        })
        .unwrap_or(&[]);
    Some(NamedGrowth {
        name: name.to_string(),
        bytes_per_request: db / requests,
        objects_per_request: dc / requests,
        from,
        to,
        chain,
        estimated,
    })
}

/// Growth that a full collection gave back: not a leak.
#[derive(Clone, Debug)]
pub struct HeapReclaim<'a> {
    /// The growth over the censuses before the collection.
    pub growth: HeapGrowth<'a>,
    pub collected: u64,
    /// The top type's bytes at the last census before the collection...
    pub before_bytes: u64,
    /// ...and at the first census after it.
    pub after_bytes: u64,
}

impl HeapReclaim<'_> {
    /// What the top type had gained over the censuses before the collection.
    pub fn gained(&self) -> f64 {
        self.growth.top.bytes.last_bytes - self.growth.top.bytes.first_bytes
    }

    pub fn freed(&self) -> f64 {
        self.before_bytes as f64 - self.after_bytes as f64
    }
}

/// The first full collection that took back at least
/// `share` of the heap growth before it, as the next census shows. A
/// collection with no census after it yet says nothing either way.
pub fn reclaim<'a>(
    pts: &[CensusPoint<'a>],
    tl: &Timeline,
    events: &[pb::Event],
    share: f64,
) -> Option<HeapReclaim<'a>> {
    full_collections(events).find_map(|(at, gc)| {
        let before: Vec<CensusPoint> = pts.iter().copied().filter(|p| p.time_ns < at).collect();
        let after = pts.iter().find(|p| p.time_ns > at)?;
        let growth = growth_over(&before, tl)?;
        let name = growth.top.name.as_str();
        let before_bytes = before.iter().rev().find_map(|p| p.get(name))?.bytes;
        // A census lists every type that grew since the last one, every tensor
        // type and the largest: a grown type missing after the collection
        // shrank out of those lists.
        let after_bytes = after.get(name).map_or(0, |t| t.bytes);
        let r = HeapReclaim {
            growth,
            collected: gc.collected,
            before_bytes,
            after_bytes,
        };
        (r.gained() > 0.0 && r.freed() >= share * r.gained()).then_some(r)
    })
}

/// Full collections that collected something, in time order.
fn full_collections(events: &[pb::Event]) -> impl Iterator<Item = (i64, &pb::GcCollection)> {
    let mut out: Vec<(i64, &pb::GcCollection)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Gc(g)) if g.generation >= FULL_COLLECTION && g.collected > 0 => {
                Some((e.time_ns, g))
            }
            _ => None,
        })
        .collect();
    out.sort_by_key(|(t, _)| *t);
    out.into_iter()
}

/// The heap's verdicts for one timeline: growth that a collection gave back
/// (gc_retained), else growth that stays (a leak on the host).
pub enum HeapVerdict<'a> {
    Retained(HeapReclaim<'a>),
    Growing(HeapGrowth<'a>),
}

pub fn verdict<'a>(f: &Findings<'a>) -> Option<HeapVerdict<'a>> {
    let pts = points(&f.evidence.events, &f.timeline);
    if pts.len() < MIN_CENSUSES {
        return None;
    }
    if let Some(r) = reclaim(&pts, &f.timeline, &f.evidence.events, RECLAIMED_SHARE) {
        return Some(HeapVerdict::Retained(r));
    }
    growth_over(&pts, &f.timeline).map(HeapVerdict::Growing)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn census(types: &[(&str, u64, u64)], chain: &[&str]) -> pb::HeapCensus {
        pb::HeapCensus {
            types: types
                .iter()
                .map(|(n, c, b)| pb::TypeCount {
                    type_name: n.to_string(),
                    count: *c,
                    bytes: *b,
                    ..Default::default()
                })
                .collect(),
            referrer_chain: chain.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn at(requests_done: u64, census: &pb::HeapCensus) -> CensusPoint<'_> {
        CensusPoint {
            time_ns: requests_done as i64,
            requests_done,
            census,
        }
    }

    #[test]
    fn two_censuses_name_the_type_that_grew_most_and_its_chain() {
        let chain = [
            "module __main__ global payloads",
            "dict['r0'] (90 items)",
            "bytes",
        ];
        let a = census(&[("bytes", 100, 1_000_000), ("dict", 5000, 900_000)], &[]);
        let b = census(&[("bytes", 180, 17_384_000), ("dict", 5004, 905_000)], &[]);
        let c = census(
            &[("bytes", 190, 19_432_000), ("dict", 5004, 905_000)],
            &chain,
        );
        // The latest census 20 or more requests before the last: b at 45
        // is too close to c at 60, so the growth runs from a at 10.
        let pts = [at(10, &a), at(45, &b), at(60, &c)];
        let n = named_growth(&pts).unwrap();
        assert_eq!(n.name, "bytes");
        assert_eq!((n.from.requests_done, n.to.requests_done), (10, 60));
        assert_eq!(n.bytes_per_request, (19_432_000.0 - 1_000_000.0) / 50.0);
        assert_eq!(n.objects_per_request, 90.0 / 50.0);
        assert_eq!(
            n.chain_line().unwrap(),
            "held by module __main__ global payloads -> dict['r0'] (90 items) -> bytes"
        );
        assert!(n.line(368_640.0).contains("bytes +360.0 KiB (+1.8 objects) per request (100% of the host growth) between censuses at requests 10 and 60"), "{}", n.line(368_640.0));
    }

    #[test]
    fn estimated_bytes_are_said_so() {
        // A census on suspicion counted the dicts without sizing them all.
        let a = census(&[("dict", 5000, 1_160_000)], &[]);
        let mut b = census(&[("dict", 8000, 1_856_000)], &[]);
        let n = named_growth(&[at(10, &a), at(20, &b)]).unwrap();
        assert!(!n.estimated && !n.line(0.0).contains("estimated"));
        b.types[0].bytes_estimated = true;
        let n = named_growth(&[at(10, &a), at(20, &b)]).unwrap();
        assert_eq!(n.bytes_per_request, 69_600.0);
        assert!(n.estimated);
        assert!(
            n.line(0.0).contains("its bytes partly estimated"),
            "{}",
            n.line(0.0)
        );
        let c = census(&[("dict", 11000, 2_552_000)], &[]);
        let growths = type_growths(&[at(10, &a), at(20, &b), at(30, &c)]);
        assert!(growths[0].estimated, "{growths:?}");
    }

    #[test]
    fn a_chain_for_another_type_is_not_this_ones() {
        let a = census(&[("list", 10, 1000)], &[]);
        let b = census(
            &[("list", 50, 9000)],
            &[
                "module m global cache",
                "dict['k'] (3 items)",
                "torch.Tensor[cpu] torch.Size([4])",
            ],
        );
        let pts = [at(10, &a), at(40, &b)];
        let n = named_growth(&pts).unwrap();
        assert_eq!(n.name, "list");
        assert!(n.chain.is_empty(), "{:?}", n.chain);
        // One census, or none that grew: nothing to name.
        assert!(named_growth(&pts[..1]).is_none());
        let flat = [at(10, &a), at(40, &a)];
        assert!(named_growth(&flat).is_none());
    }
}
