//! What a census sees: a walk of the heap down from the modules' globals,
//! in the census's slices, kept out of gc's sight.
//!
//! Not `gc.get_objects()`: listing what gc tracks is one pass that cannot be
//! cut (15 to 25 ms for 160k objects with torch imported, over the 20 ms a
//! census may hold the GIL), it misses what `gc.freeze()` froze and the
//! untracked containers (a dict holding only `bytes`), and its order put
//! transient frames and tracebacks before a leak's true holder. The walk asks
//! `gc.get_referents` of [`REFERENTS_CHUNK`] objects at a time and lets the
//! GIL go between slices; what it reaches first is nearest the globals, so
//! the referrer chain (which looks for holders in this order) names a
//! module global or a cache rather than a frame.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::slices::Slices;

/// `gc.get_referents` takes this many objects per call.
pub(super) const REFERENTS_CHUNK: usize = 2048;
/// Referents looked at between two looks at the clock.
const CLOCK_EVERY: usize = 256;

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
    for (name, module) in sys.getattr("modules")?.cast::<PyDict>()?.iter() {
        if let Ok(dict) = module.getattr("__dict__") {
            let main = name.extract::<String>().is_ok_and(|n| n == "__main__");
            globals.push((!main, dict));
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

/// Walks the heap from [`roots`] in `slices`, breadth first (then from
/// what gc's young generations hold that no root reached), calling
/// `visit(obj, container)` once for each container reached and for each
/// other object at each place it is held (the visitor counts an untracked
/// buffer once). Returns the containers in the order reached, and whether
/// the walk ended before the budget did.
pub(super) fn walk<'py>(
    slices: &mut Slices<'py>,
    gc: &Bound<'py, PyModule>,
    mut visit: impl FnMut(&Bound<'py, PyAny>, bool),
) -> PyResult<(Listing<'py>, bool)> {
    let py = slices.py;
    let referents = gc.getattr("get_referents")?;
    let mut seen: HashSet<usize> = HashSet::new();
    let mut objects: Vec<Bound<'py, PyAny>> = Vec::new();
    for root in roots(py, gc)? {
        if is_container(&root) && seen.insert(root.as_ptr() as usize) {
            visit(&root, true);
            objects.push(root);
        }
    }
    let mut at = 0;
    let mut young_listed = false;
    loop {
        while at < objects.len() {
            if !slices.step() {
                return Ok((Listing { objects }, false));
            }
            let end = (at + REFERENTS_CHUNK).min(objects.len());
            let chunk = untracked(PyTuple::new(py, objects[at..end].iter())?);
            let held = untracked(referents.call1(chunk)?.cast_into::<PyList>()?);
            at = end;
            // A chunk's referents can be many (a large dict or list in it), so
            // the clock is read among them too.
            for (j, r) in held.iter().enumerate() {
                if j % CLOCK_EVERY == CLOCK_EVERY - 1 && !slices.step() {
                    return Ok((Listing { objects }, false));
                }
                if !is_container(&r) {
                    visit(&r, false);
                } else if seen.insert(r.as_ptr() as usize) {
                    visit(&r, true);
                    objects.push(r);
                }
            }
        }
        if young_listed {
            break;
        }
        // Then, with automatic collection off, what gc's young generations
        // hold that no root reaches: garbage cycles piling up for want of a
        // collector (what gc_retained reads); they hold everything made
        // since, so listing them is one uncut pass again. With collection
        // on, young garbage lasts a few hundred allocations: counting it
        // would only add a request's temporaries to the census. Cycles
        // already in the oldest generation are not seen.
        young_listed = true;
        if gc.call_method0("isenabled")?.is_truthy()? {
            break;
        }
        for generation in [0u8, 1] {
            let Ok(listed) = young(gc, generation) else {
                continue;
            };
            for (j, obj) in listed.iter().enumerate() {
                if j % CLOCK_EVERY == CLOCK_EVERY - 1 && !slices.step() {
                    return Ok((Listing { objects }, false));
                }
                if seen.insert(obj.as_ptr() as usize) {
                    visit(&obj, true);
                    objects.push(obj);
                }
            }
        }
    }
    Ok((Listing { objects }, true))
}

/// What gc lists in `generation`, out of gc's sight.
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
