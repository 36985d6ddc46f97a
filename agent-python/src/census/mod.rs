//! The Python heap census: objects and bytes by type, from one walk of the
//! heap down from the modules' globals (`listing::walk`: every container,
//! tracked or not, and the bytes/arrays they hold; once a start-up heap is
//! frozen, what was made since), under a time
//! budget, with growth per completed request against the previous census
//! and one referrer chain for the top grower. Every object is counted; a
//! census on suspicion sizes only some (`sizing`: the growers by count, and
//! tensors, arrays and buffers), the others' bytes estimated and said so.
//!
//! It holds the GIL in slices of at most [`SLICE`] and lets it go between
//! them, so a request thread waits one slice at most, never the whole scan;
//! the budget bounds the time held over all slices. It runs on the agent's
//! own thread or on demand, never on a request path.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::Mutex;
use std::time::Duration;

use oomscope_agent_core::pb;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyType};

mod addr;
mod chain;
mod listing;
mod names;
mod reasons;
mod sizing;
mod slices;

use addr::AddrMap;
pub use addr::AddrSet;
use chain::referrer_chain;
pub use chain::MAX_CHAIN;
pub use names::type_name;
pub use reasons::{Reasons, Why};
pub use sizing::Sizing;
pub use slices::{thread_cpu, Idle, Slices, SLICE};

/// (count, bytes) by type name.
type Counts = HashMap<String, (u64, u64)>;

/// One census's counts by type name, which of them have estimated bytes,
/// and one instance of each type.
struct Finished<'py> {
    by_type: Counts,
    estimated: HashSet<String>,
    sample: HashMap<String, Bound<'py, PyAny>>,
}

/// Types reported by bytes, by count and by growth (each up to this many):
/// a torch process has thousands of types, the interesting ones are few.
pub const TOP_TYPES: usize = 64;
/// The share of the budget the scan may use; the referrer chain has the rest.
const SCAN_SHARE: f64 = 0.75;

/// This thread's CPU time in each part of a census: the walk (counting, and
/// sizing what is sized as counted), the growers sized after it, and the
/// rest (the growth, the referrer chain). `stats()` shows the latest.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseCpu {
    pub walk: Duration,
    pub size_growers: Duration,
    pub chain: Duration,
}

/// The latest census's [`PhaseCpu`] (censuses run one at a time).
static LAST_PHASES: Mutex<PhaseCpu> = Mutex::new(PhaseCpu {
    walk: Duration::ZERO,
    size_growers: Duration::ZERO,
    chain: Duration::ZERO,
});

/// The latest census's [`PhaseCpu`].
pub fn last_phases() -> PhaseCpu {
    *LAST_PHASES.lock().unwrap_or_else(|e| e.into_inner())
}

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
    /// Each type's mean bytes an object when last sized (by this census or
    /// an earlier one): what a type left unsized is estimated at.
    pub mean_bytes: HashMap<String, f64>,
    /// The types grown most in count since the census before
    /// ([`sizing::count_growers`]): the next census on suspicion sizes them
    /// as it counts them.
    pub count_growers: HashSet<String>,
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
    /// Among the previous census's growers by count: sized as counted.
    grew: bool,
}

/// One type's count and bytes (of the `sized` objects sized), and the
/// instance its referrer chain would start at.
#[derive(Default)]
struct Tally<'py> {
    count: u64,
    sized: u64,
    bytes: u64,
    /// The first instance reached that the previous census did not see.
    new: Option<Bound<'py, PyAny>>,
    /// The first instance reached (nearest the globals), for want of a new
    /// one: a new object may reuse the address of a temporary the previous
    /// census saw, so a steady leak can show no new instance at all.
    first: Option<Bound<'py, PyAny>>,
}

impl<'py> Tally<'py> {
    /// Counts `obj`, sized at `bytes` where it was.
    fn add(&mut self, bytes: Option<u64>, obj: &Bound<'py, PyAny>, new: bool) {
        self.count += 1;
        if let Some(bytes) = bytes {
            self.size(bytes);
        }
        if new && self.new.is_none() {
            self.new = Some(obj.clone());
        }
        if self.first.is_none() {
            self.first = Some(obj.clone());
        }
    }

    fn size(&mut self, bytes: u64) {
        self.sized += 1;
        self.bytes = self.bytes.saturating_add(bytes);
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
    sizing: Sizing,
    /// The previous census's growers by count ([`Baseline::count_growers`]).
    grew: HashSet<String>,
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
            let name = type_name(&ty);
            self.types.insert(
                key,
                TypeInfo {
                    grew: self.grew.contains(&name),
                    name,
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
        let (kind, basicsize, grew) = {
            let i = self.info(obj);
            (i.kind, i.basicsize, i.grew)
        };
        if !container && !matches!(kind, Kind::Buffer | Kind::Ndarray) {
            return;
        }
        if !container && !self.seen_untracked.insert(obj.as_ptr() as usize) {
            return;
        }
        let new = self.is_new(obj);
        self.scanned += 1;
        // A list's or dict's `__sizeof__` is a call: on suspicion, only the
        // growers' are made, as counted where they grew before, else after
        // the walk (`size_growers`).
        if kind == Kind::Container && self.sizing == Sizing::Growers && !grew {
            self.plain.entry(key).or_default().add(None, obj, new);
            return;
        }
        let bytes = match kind {
            Kind::Tensor => {
                let (name, bytes) = self.tensor_bytes(obj);
                self.tensors
                    .entry(name)
                    .or_default()
                    .add(Some(bytes), obj, new);
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
            Kind::Container => container_bytes(obj, basicsize),
            Kind::Plain => basicsize,
        };
        self.plain
            .entry(key)
            .or_default()
            .add(Some(bytes), obj, new);
    }

    /// Sizes, after the walk, the containers of the types
    /// [`sizing::growers_to_size`] picks (grown most in count since
    /// `before`), in the census's slices; what the budget leaves unsized is
    /// estimated in [`Scanner::finish`].
    fn size_growers(
        &mut self,
        slices: &mut Slices<'py>,
        objects: &listing::Listing<'py>,
        before: Option<&Baseline>,
    ) {
        let mut now: HashMap<String, u64> = HashMap::new();
        let mut unmeasured = HashSet::new();
        for (key, tally) in &self.plain {
            let name = &self.types[key].name;
            *now.entry(name.clone()).or_default() += tally.count;
            if tally.sized < tally.count {
                unmeasured.insert(name.clone());
            }
        }
        for (name, tally) in &self.tensors {
            *now.entry(name.clone()).or_default() += tally.count;
        }
        let (no_counts, no_means) = (HashMap::new(), HashMap::new());
        let picked = sizing::growers_to_size(
            &now,
            &unmeasured,
            before.map_or(&no_counts, |b| &b.by_type),
            before.map_or(&no_means, |b| &b.mean_bytes),
        );
        // A few type objects (list, dict): a scan of a short list beats a
        // hash per object.
        let keys: Vec<usize> = self
            .plain
            .iter()
            .filter(|(k, t)| t.sized < t.count && picked.contains(&self.types[*k].name))
            .map(|(k, _)| *k)
            .collect();
        if keys.is_empty() {
            return;
        }
        for (j, obj) in objects.objects.iter().enumerate() {
            if j % listing::CLOCK_EVERY == listing::CLOCK_EVERY - 1 && !slices.step() {
                return;
            }
            // SAFETY: a live object, the GIL held.
            let key = unsafe { pyo3::ffi::Py_TYPE(obj.as_ptr()) } as usize;
            if keys.contains(&key) {
                let bytes = container_bytes(obj, self.types[&key].basicsize);
                if let Some(t) = self.plain.get_mut(&key) {
                    t.size(bytes);
                }
            }
        }
    }

    /// Counts by type name, with one instance of each type; a type some of
    /// whose objects were left unsized has them at its mean size (of those
    /// sized, else as last measured in `means`), marked estimated. Updates
    /// `means` with what was sized.
    fn finish(self, means: &mut HashMap<String, f64>) -> Finished<'py> {
        let mut f = Finished {
            by_type: HashMap::new(),
            estimated: HashSet::new(),
            sample: HashMap::new(),
        };
        let types = &self.types;
        let named = self
            .plain
            .into_iter()
            .map(|(k, v)| (types[&k].name.clone(), types[&k].basicsize, v));
        let tensors = self.tensors.into_iter().map(|(n, v)| (n, 0, v));
        let mut sized: HashMap<String, (u64, u64)> = HashMap::new();
        for (name, basicsize, tally) in named.chain(tensors) {
            let (bytes, estimated) = sizing::with_unsized(
                tally.count,
                tally.sized,
                tally.bytes,
                means.get(&name).copied(),
                basicsize,
            );
            if estimated {
                f.estimated.insert(name.clone());
            }
            let s = sized.entry(name.clone()).or_default();
            s.0 += tally.sized;
            s.1 = s.1.saturating_add(tally.bytes);
            // Two type objects may share a name (a class defined twice).
            let e = f.by_type.entry(name.clone()).or_default();
            e.0 += tally.count;
            e.1 = e.1.saturating_add(bytes);
            if let Some(obj) = tally.instance() {
                f.sample.insert(name, obj);
            }
        }
        for (name, (n, bytes)) in sized {
            if n > 0 {
                means.insert(name, bytes as f64 / n as f64);
            }
        }
        f
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

/// A list's or dict's own bytes, its tables included (`__sizeof__`).
fn container_bytes(obj: &Bound<'_, PyAny>, basicsize: u64) -> u64 {
    obj.call_method0(pyo3::intern!(obj.py(), "__sizeof__"))
        .and_then(|n| n.extract::<u64>())
        .unwrap_or(basicsize)
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
/// growth is per completed request since it. `sizing`: which objects it
/// sizes ([`Sizing`]). `between_requests`: a census
/// begun with no request in flight resumes each slice with none, waiting up
/// to the given time in all ([`Slices::between_requests`]).
pub fn run(
    py: Python<'_>,
    budget: Duration,
    requests_done: u64,
    baseline: &mut Option<Baseline>,
    sizing: Sizing,
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
        sizing,
        grew: baseline
            .as_mut()
            .map(|b| std::mem::take(&mut b.count_growers))
            .unwrap_or_default(),
    };
    let walk_start = thread_cpu();
    let (objects, ended) = listing::walk(&mut slices, &gc, reach, |obj, container| {
        s.count(obj, container);
        ControlFlow::Continue(())
    })?;
    let walked = thread_cpu();
    if sizing == Sizing::Growers && ended == listing::Ended::Complete {
        s.size_growers(&mut slices, &objects, baseline.as_ref());
    }
    let sized = thread_cpu();
    let scanned = s.scanned;
    let addresses = std::mem::take(&mut s.addresses);
    s.previous = None;
    let mut mean_bytes = baseline
        .as_mut()
        .map(|b| std::mem::take(&mut b.mean_bytes))
        .unwrap_or_default();
    let Finished {
        by_type,
        estimated,
        sample,
    } = s.finish(&mut mean_bytes);

    let growth = growth_per_request(&by_type, baseline.as_ref(), requests_done);
    let count_growers = baseline.as_ref().map_or_else(HashSet::new, |b| {
        sizing::count_growers(by_type.iter().map(|(n, c)| (n, c.0)), &b.by_type)
            .into_iter()
            .cloned()
            .collect()
    });
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
    *LAST_PHASES.lock().unwrap_or_else(|e| e.into_inner()) = PhaseCpu {
        walk: walked.saturating_sub(walk_start),
        size_growers: sized.saturating_sub(walked),
        chain: thread_cpu().saturating_sub(sized),
    };
    drop(objects);
    let mut census = pb::HeapCensus {
        types: select_types(&by_type, &growth, &estimated),
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
        mean_bytes,
        count_growers,
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
/// [`TOP_TYPES`]), largest bytes first; those in `estimated` say their
/// bytes are.
pub fn select_types(
    by_type: &HashMap<String, (u64, u64)>,
    growth: &[(String, f64, f64)],
    estimated: &HashSet<String>,
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
            bytes_estimated: estimated.contains(n),
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
            mean_bytes: HashMap::new(),
            count_growers: HashSet::new(),
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
            mean_bytes: HashMap::new(),
            count_growers: HashSet::new(),
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
            mean_bytes: HashMap::new(),
            count_growers: HashSet::new(),
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
        let estimated: HashSet<String> = ["t299".to_string()].into();
        let sel = select_types(&by, &growth, &estimated);
        assert!(sel.iter().any(|t| t.type_name == "small_grower"));
        assert!(sel
            .iter()
            .any(|t| t.type_name == "t299" && t.bytes_estimated));
        assert!(sel
            .iter()
            .all(|t| t.bytes_estimated == (t.type_name == "t299")));
        assert!(sel.len() <= 3 * TOP_TYPES + 1);
        assert!(sel.windows(2).all(|w| w[0].bytes >= w[1].bytes));
    }
}
