//! What a census sees: a walk of the heap down from the modules' globals,
//! in the census's slices, kept out of gc's sight.
//!
//! Not `gc.get_objects()`: listing what gc tracks is one pass that cannot be
//! cut (15 to 25 ms for 160k objects with torch imported, over the 20 ms a
//! census may hold the GIL), it misses the untracked containers (a dict
//! holding only `bytes`), and its order put transient frames and tracebacks
//! before a leak's true holder. The walk asks `gc.get_referents` of
//! [`REFERENTS_CHUNK`] objects at a time and lets the GIL go between slices;
//! what it reaches first is nearest the globals, so the referrer chain
//! (which looks for holders in this order) names a module global or a cache
//! rather than a frame. Once `gc.freeze()` has frozen a start-up heap, gc's
//! listing is what was made since, and the walk keeps to it
//! ([`Reach::OutsideFrozen`]).

use std::ops::ControlFlow;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::addr::AddrSet;
use super::names::instance_dict;
use super::slices::Slices;

/// `gc.get_referents` takes this many objects per call.
pub(super) const REFERENTS_CHUNK: usize = 2048;
/// Referents looked at between two looks at the clock.
pub(super) const CLOCK_EVERY: usize = 256;

/// Every container the walk reached, in the order reached (roots first).
pub(super) struct Listing<'py> {
    pub(super) objects: Vec<Bound<'py, PyAny>>,
}

impl<'py> Listing<'py> {
    /// Consecutive runs of at most `n` objects, as a tuple to pass to
    /// `gc.get_referents`.
    pub(super) fn chunks(&self, n: usize) -> impl Iterator<Item = Bound<'py, PyTuple>> + '_ {
        self.objects
            .chunks(n.max(1))
            .filter_map(|c| PyTuple::new(c[0].py(), c.iter()).ok().map(untracked))
    }
}

/// Whether `obj`'s type can hold other objects (gc-capable, tracked or not:
/// a dict of `bytes` is untracked, and is what holds the leak).
pub(super) fn is_container(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: a live object, the GIL held.
    unsafe { pyo3::ffi::PyType_IS_GC(pyo3::ffi::Py_TYPE(obj.as_ptr())) != 0 }
}

/// Where the walk starts: every module's globals (`__main__` first, so a
/// script's own global is the holder named before a library's), then the
/// threads' current frames (what requests in flight hold: reached last, so
/// never named when a global holds the same object), then `gc.garbage`.
/// Objects reachable only from C (an extension's static state) are not seen.
fn roots<'py>(py: Python<'py>, gc: &Bound<'py, PyModule>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let sys = py.import("sys")?;
    let mut globals: Vec<(bool, Bound<'py, PyAny>)> = Vec::new();
    // (What sys.modules holds may be a lazy module or a proxy: its
    // `__dict__` is read without running its code.)
    for (name, module) in sys.getattr("modules")?.cast::<PyDict>()?.iter() {
        if let Some(dict) = instance_dict(&module) {
            let main = name.extract::<String>().is_ok_and(|n| n == "__main__");
            globals.push((!main, dict.into_any()));
        }
    }
    globals.sort_by_key(|(later, _)| *later);
    let mut out: Vec<Bound<'py, PyAny>> = globals.into_iter().map(|(_, d)| d).collect();
    if let Ok(frames) = sys.call_method0("_current_frames") {
        if let Ok(frames) = frames.cast::<PyDict>() {
            out.extend(frames.values().iter());
        }
    }
    if let Ok(garbage) = gc.getattr("garbage") {
        out.push(garbage);
    }
    Ok(out)
}

/// How far a walk goes into what `gc.freeze()` froze.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Reach {
    /// Everything reachable from the roots.
    All,
    /// What gc lists (everything tracked and not frozen), the untracked
    /// containers and buffers it holds, and the module-level collections
    /// (a global list, dict, set or deque) however old: vLLM freezes its
    /// start-up heap, 780k objects in its API server that a walk of all
    /// took 730 ms to cross every census. What a request adds is not frozen,
    /// so gc lists it, unless it is a buffer or untracked and put straight
    /// into a frozen container: the module's own caches are looked into for
    /// that; deeper frozen containers (a frozen object's attribute dict) are
    /// not, and their untracked contents are not counted.
    OutsideFrozen,
}

/// What the censuses know of the frozen heap: how many objects the last
/// ask counted frozen (0: none, or never asked), and how many gc listed at
/// the last census that kept outside them.
struct FrozenSeen {
    frozen: u64,
    listed: usize,
}

/// Censuses run one at a time; this outlives each.
static FROZEN_SEEN: Mutex<FrozenSeen> = Mutex::new(FrozenSeen {
    frozen: 0,
    listed: 0,
});

impl Reach {
    /// `OutsideFrozen` once anything is frozen. CPython answers
    /// `gc.get_freeze_count()` by counting the frozen objects one by one, in
    /// one hold of the GIL: nothing when none are (so it is asked at each
    /// census until some are), 60 ms for vLLM's 636k. So once they are, it
    /// is asked again only when gc lists more than were frozen (an
    /// `unfreeze`, or a heap grown past the frozen one), where the ask costs
    /// less than the listing the census makes anyway: the one long hold is
    /// the first census after a freeze.
    pub(super) fn of(gc: &Bound<'_, PyModule>) -> Reach {
        let mut seen = FROZEN_SEEN.lock().unwrap_or_else(|e| e.into_inner());
        if seen.frozen > 0 && seen.listed as u64 <= seen.frozen {
            return Reach::OutsideFrozen;
        }
        seen.frozen = gc
            .call_method0("get_freeze_count")
            .and_then(|n| n.extract::<u64>())
            .unwrap_or(0);
        seen.listed = 0;
        if seen.frozen > 0 {
            Reach::OutsideFrozen
        } else {
            Reach::All
        }
    }

    /// A census outside the frozen heap found `n` objects listed by gc.
    fn listed(n: usize) {
        FROZEN_SEEN.lock().unwrap_or_else(|e| e.into_inner()).listed = n;
    }
}

/// How a walk ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Ended {
    /// It reached everything in its reach.
    Complete,
    /// The census's budget ran out first.
    Budget,
    /// The visitor had what it wanted.
    Stopped,
}

/// The walk's state: what it reached, in order, and how far it has asked
/// for their referents.
struct Walk<'py> {
    referents: Bound<'py, PyAny>,
    seen: AddrSet,
    objects: Vec<Bound<'py, PyAny>>,
    at: usize,
}

impl<'py> Walk<'py> {
    /// Takes `obj` (a container) in, unless it was reached before.
    fn reach(
        &mut self,
        obj: Bound<'py, PyAny>,
        visit: &mut impl FnMut(&Bound<'py, PyAny>, bool) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        if !self.seen.insert(obj.as_ptr() as usize) {
            return ControlFlow::Continue(());
        }
        let flow = visit(&obj, true);
        self.objects.push(obj);
        flow
    }

    /// Asks for the referents of what was reached, breadth first, up to the
    /// `until`th object (and what that adds), taking in the containers
    /// `admit` accepts, and visiting the other objects held where `atoms`.
    /// None while there is more to walk.
    fn descend(
        &mut self,
        slices: &mut Slices<'py>,
        until: usize,
        atoms: bool,
        admit: impl Fn(&Bound<'py, PyAny>) -> bool,
        visit: &mut impl FnMut(&Bound<'py, PyAny>, bool) -> ControlFlow<()>,
    ) -> PyResult<Option<Ended>> {
        let py = slices.py;
        while self.at < self.objects.len().min(until) {
            if !slices.step() {
                return Ok(Some(Ended::Budget));
            }
            let end = (self.at + REFERENTS_CHUNK)
                .min(self.objects.len())
                .min(until);
            let chunk = untracked(PyTuple::new(py, self.objects[self.at..end].iter())?);
            let held = untracked(self.referents.call1(chunk)?.cast_into::<PyList>()?);
            self.at = end;
            // A chunk's referents can be many (a large dict or list in it), so
            // the clock is read among them too.
            for (j, r) in held.iter().enumerate() {
                if j % CLOCK_EVERY == CLOCK_EVERY - 1 && !slices.step() {
                    return Ok(Some(Ended::Budget));
                }
                let flow = if !is_container(&r) {
                    if atoms {
                        visit(&r, false)
                    } else {
                        ControlFlow::Continue(())
                    }
                } else if admit(&r) {
                    self.reach(r, visit)
                } else {
                    ControlFlow::Continue(())
                };
                if flow.is_break() {
                    return Ok(Some(Ended::Stopped));
                }
            }
        }
        Ok(None)
    }

    fn listing(self) -> Listing<'py> {
        Listing {
            objects: self.objects,
        }
    }
}

/// Walks the heap from [`roots`] in `slices`, breadth first, as far as
/// `reach` goes (then, with `Reach::All`, from what gc's young generations
/// hold that no root reached), calling `visit(obj, container)` once for
/// each container reached and for each other object at each place it is
/// held (the visitor counts an untracked buffer once) until it breaks.
/// Returns the containers in the order reached, and how the walk ended.
pub(super) fn walk<'py>(
    slices: &mut Slices<'py>,
    gc: &Bound<'py, PyModule>,
    reach: Reach,
    mut visit: impl FnMut(&Bound<'py, PyAny>, bool) -> ControlFlow<()>,
) -> PyResult<(Listing<'py>, Ended)> {
    let py = slices.py;
    let mut w = Walk {
        referents: gc.getattr("get_referents")?,
        seen: AddrSet::default(),
        objects: Vec::new(),
        at: 0,
    };
    // Outside a frozen heap: what gc lists, in one pass a generation.
    let mut live: Option<Vec<Bound<'py, PyAny>>> = None;
    if reach == Reach::OutsideFrozen {
        let mut all = Vec::new();
        for generation in [0u8, 1, 2] {
            if !slices.step() {
                return Ok((w.listing(), Ended::Budget));
            }
            all.extend(young(gc, generation)?.iter());
        }
        Reach::listed(all.len());
        live = Some(all);
    }
    let live_set: Option<AddrSet> = live
        .as_ref()
        .map(|l| l.iter().map(|o| o.as_ptr() as usize).collect());
    let collection = Collection::new(py);
    // Not frozen: untracked, or listed by gc.
    let thawed = |r: &Bound<'py, PyAny>| {
        live_set.as_ref().is_none_or(|live| {
            // SAFETY: a live object, the GIL held.
            let tracked = unsafe { pyo3::ffi::PyObject_GC_IsTracked(r.as_ptr()) != 0 };
            !tracked || live.contains(&(r.as_ptr() as usize))
        })
    };
    for root in roots(py, gc)? {
        if is_container(&root) && w.reach(root, &mut visit).is_break() {
            return Ok((w.listing(), Ended::Stopped));
        }
    }
    // The roots' referents first: a module's globals, with its frozen
    // collections. Outside a frozen heap, not the strings, numbers and
    // buffers a module holds itself: they are start-up constants (vLLM's
    // 5,000 modules hold some 300k), and a module's globals do not grow
    // with requests; its collections do.
    let roots_end = w.objects.len();
    let at_roots = |r: &Bound<'py, PyAny>| thawed(r) || collection.is(r);
    let atoms = reach == Reach::All;
    if let Some(ended) = w.descend(slices, roots_end, atoms, at_roots, &mut visit)? {
        return Ok((w.listing(), ended));
    }
    for obj in live.into_iter().flatten() {
        if w.reach(obj, &mut visit).is_break() {
            return Ok((w.listing(), Ended::Stopped));
        }
    }
    if let Some(ended) = w.descend(slices, usize::MAX, true, thawed, &mut visit)? {
        return Ok((w.listing(), ended));
    }
    // Then, with automatic collection off, what gc's young generations
    // hold that no root reaches: garbage cycles piling up for want of a
    // collector (what gc_retained reads); they hold everything made
    // since, so listing them is one uncut pass again. With collection
    // on, young garbage lasts a few hundred allocations: counting it
    // would only add a request's temporaries to the census. Cycles
    // already in the oldest generation are not seen. (Outside a frozen
    // heap they are all listed already.)
    if reach == Reach::OutsideFrozen || gc.call_method0("isenabled")?.is_truthy()? {
        return Ok((w.listing(), Ended::Complete));
    }
    for generation in [0u8, 1] {
        let Ok(listed) = young(gc, generation) else {
            continue;
        };
        for (j, obj) in listed.iter().enumerate() {
            if j % CLOCK_EVERY == CLOCK_EVERY - 1 && !slices.step() {
                return Ok((w.listing(), Ended::Budget));
            }
            if w.reach(obj, &mut visit).is_break() {
                return Ok((w.listing(), Ended::Stopped));
            }
        }
    }
    let ended = w
        .descend(slices, usize::MAX, true, thawed, &mut visit)?
        .unwrap_or(Ended::Complete);
    Ok((w.listing(), ended))
}

/// A list, dict, set or deque: what a module keeps as a cache or a
/// registry.
struct Collection<'py> {
    deque: Option<Bound<'py, PyAny>>,
}

impl<'py> Collection<'py> {
    fn new(py: Python<'py>) -> Self {
        Collection {
            deque: py
                .import("collections")
                .and_then(|c| c.getattr("deque"))
                .ok()
                .filter(|d| d.is_instance_of::<pyo3::types::PyType>()),
        }
    }

    fn is(&self, obj: &Bound<'py, PyAny>) -> bool {
        let p = obj.as_ptr();
        // SAFETY: a live object, the GIL held.
        let builtin = unsafe {
            pyo3::ffi::PyList_Check(p) != 0
                || pyo3::ffi::PyDict_Check(p) != 0
                || pyo3::ffi::PyAnySet_Check(p) != 0
        };
        // By the type alone: `isinstance` would ask the object for its
        // `__class__`, which a lazy proxy (openai's, in vLLM's API server)
        // answers by importing its module, 1,557 modules on one census.
        builtin
            || self.deque.as_ref().is_some_and(|d| {
                // SAFETY: both live, the GIL held; `deque` is a type object.
                unsafe {
                    pyo3::ffi::PyType_IsSubtype(pyo3::ffi::Py_TYPE(p), d.as_ptr().cast()) != 0
                }
            })
    }
}

/// What gc lists in `generation` (never what is frozen), out of gc's
/// sight.
fn young<'py>(gc: &Bound<'py, PyModule>, generation: u8) -> PyResult<Bound<'py, PyList>> {
    let kwargs = PyDict::new(gc.py());
    kwargs.set_item("generation", generation)?;
    Ok(untracked(
        gc.call_method("get_objects", (), Some(&kwargs))?
            .cast_into::<PyList>()?,
    ))
}

/// `obj` (a list or tuple the census made) out of gc's sight. A collection
/// traverses every tracked container of the generations it collects, and a
/// young one runs every few hundred allocations: one of these, holding
/// thousands of objects, would have each collection during the census (in
/// any thread, the server's too) touch them all again. Only the census refers
/// to it, so it is in no cycle gc must break.
pub(super) fn untracked<'py, T>(obj: Bound<'py, T>) -> Bound<'py, T> {
    // SAFETY: the object is alive and the GIL held; untracking twice is
    // allowed (a list's or tuple's dealloc untracks again).
    unsafe { pyo3::ffi::PyObject_GC_UnTrack(obj.as_ptr().cast()) };
    obj
}
