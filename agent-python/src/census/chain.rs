//! Who holds the top grower: a referrer chain up to a module's globals.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::listing::{untracked, Listing, REFERENTS_CHUNK};
use super::names::{describe_holder, describe_leaf};
use super::slices::Slices;

/// How far the referrer chain walks up from the top grower.
pub const MAX_CHAIN: usize = 8;
/// Who holds `obj`: each step is the first referrer that is not a frame,
/// not one of the census's own lists and not already on the chain, up to a module's
/// globals or [`MAX_CHAIN`] steps. Outermost first.
/// Each step looks through the scanned `objects` in slices
/// ([`referrer_among`]), while the census's budget lasts.
pub(super) fn referrer_chain<'py>(
    slices: &mut Slices<'py>,
    census_name: &str,
    obj: &Bound<'py, PyAny>,
    objects: &Listing<'py>,
    skip: &[usize],
) -> PyResult<Vec<String>> {
    let gc = slices.py.import("gc")?;
    let mut steps = vec![describe_leaf(census_name, obj)];
    let mut on_chain: HashSet<usize> = skip.iter().copied().collect();
    on_chain.insert(obj.as_ptr() as usize);
    let mut child = obj.clone();
    for _ in 0..MAX_CHAIN {
        let next = referrer_among(slices, &gc, objects, &child, |r| {
            !on_chain.contains(&(r.as_ptr() as usize))
                && !r.get_type().name().map(|n| n == "frame").unwrap_or(false)
        })?;
        let Some(parent) = next else { break };
        on_chain.insert(parent.as_ptr() as usize);
        let (text, is_module) = describe_holder(&parent, &child);
        steps.push(text);
        if is_module {
            break;
        }
        child = parent;
    }
    steps.reverse();
    Ok(steps)
}

/// The first of `objects` (the census's scan, in the collector's order)
/// that refers to `child` and that `accept` takes. `gc.get_referrers` would
/// find it in one pass over the heap that cannot be cut (18 to 24 ms with
/// torch imported on the 2-core VM, over the 20 ms a census may hold the
/// GIL); this asks `gc.get_referents` of [`REFERENTS_CHUNK`] objects at a
/// time, slices between, then one by one within the chunk that holds it.
/// A referrer created after the scan is not found: the chain stops there.
fn referrer_among<'py>(
    slices: &mut Slices<'py>,
    gc: &Bound<'py, PyModule>,
    objects: &Listing<'py>,
    child: &Bound<'py, PyAny>,
    accept: impl Fn(&Bound<'py, PyAny>) -> bool,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let referents = gc.getattr("get_referents")?;
    let refers = |holders: &Bound<'py, PyTuple>| -> PyResult<bool> {
        let held = referents.call1(holders)?;
        Ok(held.cast::<PyList>()?.iter().any(|r| r.is(child)))
    };
    for chunk in objects.chunks(REFERENTS_CHUNK) {
        if !slices.step() {
            return Ok(None);
        }
        if refers(&untracked(PyTuple::new(slices.py, chunk.iter())?))? {
            for holder in chunk.iter() {
                if accept(&holder) && refers(&PyTuple::new(slices.py, [&holder])?)? {
                    return Ok(Some(holder));
                }
            }
        }
    }
    Ok(None)
}
