//! The Python heap census: objects and bytes by type, from one walk of the
//! heap down from the modules' globals (`listing::walk`: every container,
//! tracked or not, and the bytes/arrays they hold; once a start-up heap is
//! frozen, what was made since), under a time
//! budget, with growth per completed request against the previous census
//! and one referrer chain for the top grower.
//!
//! It holds the GIL in slices of at most [`SLICE`] and lets it go between
//! them, so a request thread waits one slice at most, never the whole scan;
//! the budget bounds the time held over all slices. It runs on the agent's
//! own thread or on demand, never on a request path.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::time::Duration;

use oomscope_agent_core::pb;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyType};

mod addr;
mod chain;
mod listing;
mod names;
mod reasons;
mod slices;

use addr::AddrMap;
pub use addr::AddrSet;
use chain::referrer_chain;
pub use chain::MAX_CHAIN;
pub use names::type_name;
pub use reasons::{Reasons, Why};
pub use slices::{thread_cpu, Idle, Slices, SLICE};

/// (count, bytes) by type name.
type Counts = HashMap<String, (u64, u64)>;

/// Types reported by bytes, by count and by growth (each up to this many):
/// a torch process has thousands of types, the interesting ones are few.
pub const TOP_TYPES: usize = 64;
/// The share of the budget the scan may use; the referrer chain has the rest.
const SCAN_SHARE: f64 = 0.75;

/// The counts of one census, kept to measure the next one's growth.
#[derive(Debug, Default, Clone)]
pub struct Baseline {
    pub by_type: HashMap<String, (u64, u64)>,
    pub requests_done: u64,
    /// Addresses of the objects it saw: the next census starts its
    /// referrer chain at an object that is new since (8 bytes an object,
    /// bounded by the heap itself).
    pub addresses: AddrSet,
    /// Its top grower's bytes grown since the census before (0 without
    /// one): what the suspicion confirms a leak by.
    pub top_grown_bytes: u64,
    /// Whether it kept outside a frozen heap: a census that walked the
    /// whole heap is no baseline for one that did not (or the other way).
    pub outside_frozen: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Tensor,
    Ndarray,
    /// bytes/bytearray: the length is the payload.
    Buffer,
    /// list/dict/set: `__sizeof__` includes their tables.
    Container,
    Plain,
}

struct TypeInfo {
    name: String,
    kind: Kind,
    basicsize: u64,
}

/// One type's count and bytes, and the instance its referrer chain would
/// start at.
#[derive(Default)]
struct Tally<'py> {
    count: u64,
    bytes: u64,
    /// The first instance reached that the previous census did not see.
    new: Option<Bound<'py, PyAny>>,
    /// The first instance reached (nearest the globals), for want of a new
    /// one: a new object may reuse the address of a temporary the previous
    /// census saw, so a steady leak can show no new instance at all.
    first: Option<Bound<'py, PyAny>>,
}

impl<'py> Tally<'py> {
    fn add(&mut self, bytes: u64, obj: &Bound<'py, PyAny>, new: bool) {
        self.count += 1;
        self.bytes = self.bytes.saturating_add(bytes);
        if new && self.new.is_none() {
            self.new = Some(obj.clone());
        }
        if self.first.is_none() {
            self.first = Some(obj.clone());
        }
    }

    /// A new instance where there is one, else the first reached.
    fn instance(self) -> Option<Bound<'py, PyAny>> {
        self.new.or(self.first)
    }
}

struct Scanner<'py> {
    py: Python<'py>,
    tensor: Option<Bound<'py, PyAny>>,
    ndarray: Option<Bound<'py, PyAny>>,
    types: AddrMap<TypeInfo>,
    /// By type object, and for tensors by device.
    plain: AddrMap<Tally<'py>>,
    tensors: HashMap<String, Tally<'py>>,
    storages: HashSet<(String, usize)>,
    seen_untracked: AddrSet,
    scanned: u64,
    previous: Option<AddrSet>,
    addresses: AddrSet,
}

impl<'py> Scanner<'py> {
    fn info(&mut self, obj: &Bound<'py, PyAny>) -> &TypeInfo {
        let ty = obj.get_type();
        let key = ty.as_ptr() as usize;
        if !self.types.contains_key(&key) {
            let sub = |base: &Option<Bound<'py, PyAny>>| {
                base.as_ref().is_some_and(|b| {
                    b.cast::<PyType>()
                        .is_ok_and(|b| ty.is_subclass(b).unwrap_or(false))
                })
            };
            let kind = if sub(&self.tensor) {
                Kind::Tensor
            } else if sub(&self.ndarray) {
                Kind::Ndarray
            } else if ty.is(self.py.get_type::<PyBytes>())
                || ty.is(self.py.get_type::<PyByteArray>())
            {
                Kind::Buffer
            } else if ty.is(self.py.get_type::<PyList>()) || ty.is(self.py.get_type::<PyDict>()) {
                Kind::Container
            } else {
                Kind::Plain
            };
            let basicsize = ty
                .getattr("__basicsize__")
                .and_then(|b| b.extract::<u64>())
                .unwrap_or(0);
            self.types.insert(
                key,
                TypeInfo {
                    name: type_name(&ty),
                    kind,
                    basicsize,
                },
            );
        }
        &self.types[&key]
    }

    /// Whether `obj` is an object the previous census did not see (any is,
    /// without one).
    fn is_new(&mut self, obj: &Bound<'py, PyAny>) -> bool {
        let address = obj.as_ptr() as usize;
        self.addresses.insert(address);
        self.previous.as_ref().is_none_or(|p| !p.contains(&address))
    }

    /// Counts one object: every container once (the walk reaches each
    /// once), a buffer or array once however many hold it, nothing else.
    fn count(&mut self, obj: &Bound<'py, PyAny>, container: bool) {
        let key = obj.get_type().as_ptr() as usize;
        let (kind, basicsize) = {
            let i = self.info(obj);
            (i.kind, i.basicsize)
        };
        if !container && !matches!(kind, Kind::Buffer | Kind::Ndarray) {
            return;
        }
        if !container && !self.seen_untracked.insert(obj.as_ptr() as usize) {
            return;
        }
        let new = self.is_new(obj);
        self.scanned += 1;
        let bytes = match kind {
            Kind::Tensor => {
                let (name, bytes) = self.tensor_bytes(obj);
                self.tensors.entry(name).or_default().add(bytes, obj, new);
                return;
            }
            Kind::Ndarray => {
                // A view shares its base's buffer: count the owner only.
                let owns = obj.getattr("base").map(|b| b.is_none()).unwrap_or(true);
                if owns {
                    obj.getattr("nbytes")
                        .and_then(|n| n.extract::<u64>())
                        .unwrap_or(0)
                } else {
                    0
                }
            }
            Kind::Buffer => obj.len().map(|n| n as u64).unwrap_or(0),
            Kind::Container => obj
                .call_method0("__sizeof__")
                .and_then(|n| n.extract::<u64>())
                .unwrap_or(basicsize),
            Kind::Plain => basicsize,
        };
        self.plain.entry(key).or_default().add(bytes, obj, new);
    }

    /// Counts by type name, with one instance of each type.
    fn finish(self) -> (Counts, HashMap<String, Bound<'py, PyAny>>) {
        let mut by_type: HashMap<String, (u64, u64)> = HashMap::new();
        let mut sample = HashMap::new();
        let named = self
            .plain
            .into_iter()
            .map(|(k, v)| (self.types[&k].name.clone(), v));
        for (name, tally) in named.chain(self.tensors) {
            // Two type objects may share a name (a class defined twice).
            let e = by_type.entry(name.clone()).or_default();
            e.0 += tally.count;
            e.1 = e.1.saturating_add(tally.bytes);
            if let Some(obj) = tally.instance() {
                sample.insert(name, obj);
            }
        }
        (by_type, sample)
    }

    /// `torch.Tensor[<device>]` and the bytes of its storage, counted once
    /// per storage however many tensors view it.
    fn tensor_bytes(&mut self, t: &Bound<'py, PyAny>) -> (String, u64) {
        let device = t
            .getattr("device")
            .and_then(|d| d.str())
            .map(|d| d.to_string())
            .unwrap_or_else(|_| "?".into());
        let name = format!("torch.Tensor[{device}]");
        let storage = t.call_method0("untyped_storage").ok();
        let ptr = storage
            .as_ref()
            .and_then(|s| s.call_method0("data_ptr").ok()?.extract::<usize>().ok())
            .unwrap_or(0);
        let nbytes = storage
            .as_ref()
            .and_then(|s| s.call_method0("nbytes").ok()?.extract::<u64>().ok())
            .unwrap_or(0);
        if ptr != 0 && !self.storages.insert((device, ptr)) {
            return (name, 0);
        }
        (name, nbytes)
    }
}

fn module_attr<'py>(py: Python<'py>, module: &str, attr: &str) -> Option<Bound<'py, PyAny>> {
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    modules
        .cast::<PyDict>()
        .ok()?
        .get_item(module)
        .ok()??
        .getattr(attr)
        .ok()
}

/// Runs a census now. `baseline` is the previous census (updated here);
/// growth is per completed request since it. `between_requests`: a census
/// begun with no request in flight resumes each slice with none, waiting up
/// to the given time in all ([`Slices::between_requests`]).
pub fn run(
    py: Python<'_>,
    budget: Duration,
    requests_done: u64,
    baseline: &mut Option<Baseline>,
    between_requests: Option<(Idle<'_>, Duration)>,
) -> PyResult<pb::HeapCensus> {
    // The scan gets most of the budget; the referrer chain what is left.
    let mut slices = Slices::new(py, budget.mul_f64(SCAN_SHARE));
    if let Some((idle, wait)) = between_requests {
        slices = slices.between_requests(idle, wait);
    }
    let gc = py.import("gc")?;
    let counts: (u64, u64, u64) = gc.call_method0("get_count")?.extract().unwrap_or((0, 0, 0));
    let garbage = gc.getattr("garbage").and_then(|g| g.len()).unwrap_or(0) as u64;
    let reach = listing::Reach::of(&gc);
    let outside_frozen = reach == listing::Reach::OutsideFrozen;
    if baseline
        .as_ref()
        .is_some_and(|b| b.outside_frozen != outside_frozen)
    {
        *baseline = None;
    }
    let mut s = Scanner {
        py,
        tensor: module_attr(py, "torch", "Tensor"),
        ndarray: module_attr(py, "numpy", "ndarray"),
        types: AddrMap::default(),
        plain: AddrMap::default(),
        tensors: HashMap::new(),
        storages: HashSet::new(),
        seen_untracked: AddrSet::default(),
        scanned: 0,
        previous: baseline.as_mut().map(|b| std::mem::take(&mut b.addresses)),
        addresses: AddrSet::default(),
    };
    let (objects, ended) = listing::walk(&mut slices, &gc, reach, |obj, container| {
        s.count(obj, container);
        ControlFlow::Continue(())
    })?;
    let scanned = s.scanned;
    let addresses = std::mem::take(&mut s.addresses);
    s.previous = None;
    let (by_type, sample) = s.finish();

    let growth = growth_per_request(&by_type, baseline.as_ref(), requests_done);
    let top_grown_bytes = match (growth.first(), baseline.as_ref()) {
        (Some((_, per_request, _)), Some(b)) => {
            (per_request * requests_done.saturating_sub(b.requests_done) as f64) as u64
        }
        _ => 0,
    };
    // The chain starts at the top grower that has an instance on record.
    let top = growth
        .iter()
        .find(|(name, _, _)| sample.contains_key(name))
        .map(|(name, _, _)| name.clone());
    let mut chain = Vec::new();
    if let Some(obj) = top.as_ref().and_then(|n| sample.get(n)) {
        slices.budget = budget;
        chain = referrer_chain(
            &mut slices,
            top.as_deref().unwrap_or(""),
            obj,
            &objects,
            reach,
        )
        .unwrap_or_default();
    }
    drop(objects);
    let mut census = pb::HeapCensus {
        types: select_types(&by_type, &growth),
        gc_gen0: counts.0,
        gc_gen1: counts.1,
        gc_gen2: counts.2,
        garbage,
        // The GIL time held, over every slice: what the census cost.
        duration_ns: slices.finish().as_nanos() as u64,
        objects_scanned: scanned,
        referrer_chain: chain,
        longest_hold_ns: slices.longest.as_nanos() as u64,
        longest_hold_cpu_ns: slices.longest_cpu.as_nanos() as u64,
        // The caller knows the requests; see `Agent::census`.
        requests_ended_during: 0,
    };
    if ended != listing::Ended::Complete {
        census.referrer_chain.insert(
            0,
            format!(
                // The analysis knows a partial census by this start.
                "(partial census: the {} ms budget ran out)",
                budget.as_millis()
            ),
        );
    }
    drop(sample);
    *baseline = Some(Baseline {
        by_type,
        requests_done,
        addresses,
        top_grown_bytes,
        outside_frozen,
    });
    Ok(census)
}

/// Types whose bytes (then count) grew since the baseline, as
/// (name, bytes per request, count per request), largest first. Empty
/// without a baseline or without a completed request since.
pub fn growth_per_request(
    now: &HashMap<String, (u64, u64)>,
    baseline: Option<&Baseline>,
    requests_done: u64,
) -> Vec<(String, f64, f64)> {
    let Some(base) = baseline else {
        return Vec::new();
    };
    let requests = requests_done.saturating_sub(base.requests_done);
    if requests == 0 {
        return Vec::new();
    }
    let mut out: Vec<(String, f64, f64)> = now
        .iter()
        .filter_map(|(name, (count, bytes))| {
            let (c0, b0) = base.by_type.get(name).copied().unwrap_or((0, 0));
            let dc = *count as f64 - c0 as f64;
            let db = *bytes as f64 - b0 as f64;
            (dc > 0.0 || db > 0.0)
                .then(|| (name.clone(), db / requests as f64, dc / requests as f64))
        })
        // Grown in bytes, however the count went (a server frees small
        // `bytes` while a leak adds 256 KiB ones: vLLM's API server, 11
        // fewer and 1.3 MB more); or in count, the bytes not falling.
        .filter(|(_, db, dc)| *db > 0.0 || *dc > 0.0 && *db >= 0.0)
        .collect();
    out.sort_by(|a, b| {
        b.1.total_cmp(&a.1)
            .then(b.2.total_cmp(&a.2))
            .then(a.0.cmp(&b.0))
    });
    out
}

/// The largest types by bytes, by count, and the top growers (each up to
/// [`TOP_TYPES`]), largest bytes first.
pub fn select_types(
    by_type: &HashMap<String, (u64, u64)>,
    growth: &[(String, f64, f64)],
) -> Vec<pb::TypeCount> {
    let mut all: Vec<(&String, &(u64, u64))> = by_type.iter().collect();
    let mut keep: HashSet<&str> = HashSet::new();
    all.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(b.0)));
    keep.extend(all.iter().take(TOP_TYPES).map(|(n, _)| n.as_str()));
    all.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(b.0)));
    keep.extend(all.iter().take(TOP_TYPES).map(|(n, _)| n.as_str()));
    keep.extend(growth.iter().take(TOP_TYPES).map(|(n, _, _)| n.as_str()));
    keep.extend(
        by_type
            .keys()
            .filter(|n| n.starts_with("torch.Tensor["))
            .map(String::as_str),
    );
    let mut out: Vec<pb::TypeCount> = keep
        .into_iter()
        .map(|n| pb::TypeCount {
            type_name: n.to_string(),
            count: by_type[n].0,
            bytes: by_type[n].1,
        })
        .collect();
    out.sort_by(|a, b| {
        b.bytes
            .cmp(&a.bytes)
            .then(b.count.cmp(&a.count))
            .then(a.type_name.cmp(&b.type_name))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(pairs: &[(&str, u64, u64)]) -> HashMap<String, (u64, u64)> {
        pairs
            .iter()
            .map(|(n, c, b)| (n.to_string(), (*c, *b)))
            .collect()
    }

    #[test]
    fn growth_is_per_completed_request_and_largest_bytes_first() {
        let base = Baseline {
            by_type: counts(&[
                ("torch.Tensor[cpu]", 10, 1000),
                ("dict", 500, 50_000),
                ("Resp", 0, 0),
            ]),
            requests_done: 10,
            addresses: AddrSet::default(),
            top_grown_bytes: 0,
            outside_frozen: false,
        };
        let now = counts(&[
            ("torch.Tensor[cpu]", 30, 41_000),
            ("dict", 500, 50_000),
            ("Resp", 20, 960),
            ("gone", 1, 1),
        ]);
        let g = growth_per_request(&now, Some(&base), 30);
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!(g[0], ("torch.Tensor[cpu]".to_string(), 2000.0, 1.0));
        assert_eq!(g[1], ("Resp".to_string(), 48.0, 1.0));
        assert_eq!(g[2].0, "gone");
    }

    #[test]
    fn fewer_but_larger_objects_are_growth() {
        // vLLM's API server between two censuses: 11 fewer `bytes` objects
        // (small ones freed), 1.3 MB more (five 256 KiB buffers kept); and
        // dicts that grew a little. The buffers lead.
        let base = Baseline {
            by_type: counts(&[("bytes", 817, 24_934_487), ("dict", 10_004, 8_781_824)]),
            requests_done: 95,
            addresses: AddrSet::default(),
            top_grown_bytes: 0,
            outside_frozen: true,
        };
        let now = counts(&[("bytes", 806, 26_244_940), ("dict", 10_034, 8_790_888)]);
        let g = growth_per_request(&now, Some(&base), 100);
        assert_eq!(g[0].0, "bytes", "{g:?}");
        assert_eq!(g[0].1, (26_244_940.0 - 24_934_487.0) / 5.0);
        assert_eq!(g[1].0, "dict");
        // Fewer and smaller is no growth.
        let shrunk = counts(&[("bytes", 806, 24_000_000)]);
        assert!(growth_per_request(&shrunk, Some(&base), 100).is_empty());
    }

    #[test]
    fn no_growth_without_a_baseline_or_a_request_since() {
        let now = counts(&[("a", 5, 5)]);
        assert!(growth_per_request(&now, None, 10).is_empty());
        let base = Baseline {
            by_type: counts(&[("a", 1, 1)]),
            requests_done: 10,
            addresses: AddrSet::default(),
            top_grown_bytes: 0,
            outside_frozen: false,
        };
        assert!(growth_per_request(&now, Some(&base), 10).is_empty());
    }

    #[test]
    fn selection_keeps_growers_beyond_the_top_lists() {
        let mut by: HashMap<String, (u64, u64)> = (0..300)
            .map(|i| (format!("t{i}"), (1000 + i, 10_000 + i)))
            .collect();
        by.insert("small_grower".into(), (3, 30));
        let growth = vec![("small_grower".to_string(), 10.0, 1.0)];
        let sel = select_types(&by, &growth);
        assert!(sel.iter().any(|t| t.type_name == "small_grower"));
        assert!(sel.len() <= 3 * TOP_TYPES + 1);
        assert!(sel.windows(2).all(|w| w[0].bytes >= w[1].bytes));
    }
}
