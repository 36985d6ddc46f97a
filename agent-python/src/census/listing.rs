//! What gc tracks, listed once per census and kept out of gc's sight.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// `gc.get_referents` takes this many objects per call.
pub(super) const REFERENTS_CHUNK: usize = 2048;

/// What gc tracks, as its generations listed it, young ones (0 and 1)
/// first. Kept as the lists gc gave rather than joined into one: joining
/// touches every object again (6 to 8 ms more with the GIL held, for 160k
/// objects with torch imported).
pub(super) struct Listing<'py> {
    pub(super) lists: Vec<Bound<'py, PyList>>,
    /// How many of the objects, from the start, are young.
    pub(super) young: usize,
}

impl<'py> Listing<'py> {
    /// Every object, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = Bound<'py, PyAny>> + '_ {
        self.lists.iter().flat_map(|l| l.iter())
    }

    /// Consecutive runs of at most `n` objects, none across two lists.
    pub(super) fn chunks(&self, n: usize) -> impl Iterator<Item = Bound<'py, PyList>> + '_ {
        self.lists.iter().flat_map(move |l| {
            (0..l.len())
                .step_by(n.max(1))
                .map(move |start| untracked(l.get_slice(start, (start + n).min(l.len()))))
        })
    }

    /// The lists' own addresses: they hold everything, so no referrer chain
    /// may pass through them.
    pub(super) fn addresses(&self) -> Vec<usize> {
        self.lists.iter().map(|l| l.as_ptr() as usize).collect()
    }
}

/// Every object gc tracks: one pass per generation, with the GIL held,
/// the one step a census cannot cut. A collection between the passes (the
/// lists' own allocation may start one) would move objects from one
/// generation to the next and list them twice, so automatic collection is
/// off for the passes and back as it was before the GIL is let go. Where
/// generations cannot be listed apart (an interpreter whose gc has other
/// generations), one list, none young.
pub(super) fn tracked_objects<'py>(gc: &Bound<'py, PyModule>) -> PyResult<Listing<'py>> {
    let enabled = gc.call_method0("isenabled")?.is_truthy()?;
    if enabled {
        gc.call_method0("disable")?;
    }
    let listed = list_by_generation(gc);
    if enabled {
        gc.call_method0("enable")?;
    }
    match listed {
        Ok(split) => Ok(split),
        Err(_) => Ok(Listing {
            lists: vec![untracked(
                gc.call_method0("get_objects")?.cast_into::<PyList>()?,
            )],
            young: 0,
        }),
    }
}

/// `obj` (a list or tuple the census made) out of gc's sight. A collection
/// traverses every tracked container of the generations it collects, and a
/// young one runs every few hundred allocations: one of these lists, holding
/// every object, would have each collection during the census (in any
/// thread, the server's too) touch them all again, 17 to 20 ms for 160k
/// objects here. Only the census refers to it, so it is in no cycle gc must
/// break.
pub(super) fn untracked<'py, T>(obj: Bound<'py, T>) -> Bound<'py, T> {
    // SAFETY: the object is alive and the GIL held; untracking twice is
    // allowed (a list's or tuple's dealloc untracks again).
    unsafe { pyo3::ffi::PyObject_GC_UnTrack(obj.as_ptr().cast()) };
    obj
}

fn list_by_generation<'py>(gc: &Bound<'py, PyModule>) -> PyResult<Listing<'py>> {
    let generation = |g: u8| -> PyResult<Bound<'py, PyList>> {
        let kwargs = PyDict::new(gc.py());
        kwargs.set_item("generation", g)?;
        Ok(untracked(
            gc.call_method("get_objects", (), Some(&kwargs))?
                .cast_into::<PyList>()?,
        ))
    };
    let young = [generation(0)?, generation(1)?];
    let old = generation(2)?;
    Ok(Listing {
        young: young.iter().map(|l| l.len()).sum(),
        lists: young.into_iter().chain([old]).collect(),
    })
}
