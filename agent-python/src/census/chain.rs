//! Who holds the top grower: a referrer chain up to a module's globals.

use std::collections::HashSet;
use std::ops::ControlFlow;

use pyo3::exceptions::PyBaseException;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple, PyType};

use super::listing::{walk, Listing, Reach, REFERENTS_CHUNK};
use super::names::{attribute_step, describe_holder, describe_leaf, is_module_globals};
use super::slices::Slices;

/// How far the referrer chain walks up from the top grower.
pub const MAX_CHAIN: usize = 8;

/// Who holds `obj`: each step is the first holder in the walk's order (so
/// the one nearest a module's globals) that is not transient (a frame, a
/// traceback, an exception: what a request in flight or a caught error
/// holds for a moment) and not already on the chain, up to a module's
/// globals or [`MAX_CHAIN`] steps. Outermost first. Each step looks through
/// the walk's `objects` in slices ([`referrer_among`]) while the census's
/// budget lasts. A holder the census did not list (it kept outside a
/// frozen heap: `reach`) is looked for by a walk of the whole heap down
/// from the globals that stops where it reaches the child: a module's
/// frozen list is a few hundred objects in, a frozen object's dict a few
/// thousand.
pub(super) fn referrer_chain<'py>(
    slices: &mut Slices<'py>,
    census_name: &str,
    obj: &Bound<'py, PyAny>,
    objects: &Listing<'py>,
    reach: Reach,
) -> PyResult<Vec<String>> {
    let py = slices.py;
    let gc = py.import("gc")?;
    // Not `sys._getframe()`: the agent's own thread has no Python frame.
    let types = py.import("types")?;
    let transient = [
        types.getattr("FrameType")?,
        types.getattr("TracebackType")?,
        py.get_type::<PyBaseException>().into_any(),
    ];
    let is_transient = |r: &Bound<'py, PyAny>| {
        let ty = r.get_type();
        transient.iter().any(|t| {
            t.cast::<PyType>()
                .is_ok_and(|t| ty.is(t) || ty.is_subclass(t).unwrap_or(false))
        })
    };
    let mut on_chain: HashSet<usize> = HashSet::new();
    on_chain.insert(obj.as_ptr() as usize);
    // Innermost first.
    let mut holders: Vec<Bound<'py, PyAny>> = Vec::new();
    let mut child = obj.clone();
    while holders.len() < MAX_CHAIN {
        let accept =
            |r: &Bound<'py, PyAny>| !on_chain.contains(&(r.as_ptr() as usize)) && !is_transient(r);
        let mut next = referrer_among(slices, &gc, objects, &child, accept)?;
        if next.is_none() && reach == Reach::OutsideFrozen {
            let (deep, _) = walk(slices, &gc, Reach::All, |r, _| {
                if r.is(&child) {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })?;
            next = referrer_among(slices, &gc, &deep, &child, accept)?;
        }
        let Some(parent) = next else { break };
        on_chain.insert(parent.as_ptr() as usize);
        holders.push(parent.clone());
        if is_module_globals(&parent) {
            break;
        }
        child = parent;
    }
    let mut steps = describe_path(obj.clone(), holders);
    steps.insert(0, describe_leaf(census_name, obj));
    steps.reverse();
    Ok(steps)
}

/// The first of `objects` (the walk's, nearest the globals first) that
/// refers to `child` and that `accept` takes. `gc.get_referrers` would
/// find it in one pass over the heap that cannot be cut (18 to 24 ms with
/// torch imported on the 2-core VM, over the 20 ms a census may hold the
/// GIL); this asks `gc.get_referents` of [`REFERENTS_CHUNK`] objects at a
/// time, slices between, then one by one within the chunk that holds it.
/// A referrer created after the walk is not found: the chain stops there.
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
        if refers(&chunk)? {
            for holder in chunk.iter() {
                if accept(&holder) && refers(&PyTuple::new(slices.py, [&holder])?)? {
                    return Ok(Some(holder));
                }
            }
        }
    }
    Ok(None)
}

/// The steps from `child` up through `holders` (innermost first, each
/// holding the one before), innermost first, to the nearest module's
/// globals. An object and its attribute dict are one step, `Type.attr`.
fn describe_path<'py>(child: Bound<'py, PyAny>, holders: Vec<Bound<'py, PyAny>>) -> Vec<String> {
    let mut steps = Vec::new();
    let mut below = child;
    let mut up = holders.into_iter().peekable();
    while let Some(holder) = up.next() {
        if let Some(text) = up.peek().and_then(|o| attribute_step(o, &holder, &below)) {
            steps.push(text);
            match up.next() {
                Some(owner) => {
                    below = owner;
                    continue;
                }
                None => break,
            }
        }
        let (text, is_module) = describe_holder(&holder, &below);
        steps.push(text);
        if is_module {
            break;
        }
        below = holder;
    }
    steps
}
