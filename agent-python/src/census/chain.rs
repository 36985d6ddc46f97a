//! Who holds the top grower: a referrer chain up to a module's globals.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::listing::{untracked, Listing, REFERENTS_CHUNK};
use super::names::{attribute_step, describe_holder, describe_leaf, is_module_globals};
use super::slices::Slices;

/// Objects expanded plus referents seen, walking down from the modules,
/// between two looks at the clock.
const WALK_CLOCK_EVERY: usize = 256;

/// How far the referrer chain walks up from the top grower.
pub const MAX_CHAIN: usize = 8;
/// Who holds `obj`: each step is the first referrer that is not a frame,
/// not one of the census's own lists and not already on the chain, up to a module's
/// globals or [`MAX_CHAIN`] steps. Outermost first.
/// Each step looks through the scanned `objects` in slices
/// ([`referrer_among`]), while the census's budget lasts; where none of
/// them holds the chain's head, the rest of the way is walked down from the
/// modules ([`path_from_modules`]).
pub(super) fn referrer_chain<'py>(
    slices: &mut Slices<'py>,
    census_name: &str,
    obj: &Bound<'py, PyAny>,
    objects: &Listing<'py>,
    skip: &[usize],
) -> PyResult<Vec<String>> {
    let gc = slices.py.import("gc")?;
    // Not `sys._getframe()`: the agent's own thread has no Python frame.
    let frame = slices.py.import("types")?.getattr("FrameType")?;
    let mut on_chain: HashSet<usize> = skip.iter().copied().collect();
    on_chain.insert(obj.as_ptr() as usize);
    // Innermost first.
    let mut holders: Vec<Bound<'py, PyAny>> = Vec::new();
    let mut child = obj.clone();
    while holders.len() < MAX_CHAIN {
        let next = referrer_among(slices, &gc, objects, &child, |r| {
            !on_chain.contains(&(r.as_ptr() as usize)) && !r.get_type().is(&frame)
        })?;
        let Some(parent) = next else {
            let depth = MAX_CHAIN - holders.len();
            // Best effort: a walk that fails keeps the steps found so far.
            let path = path_from_modules(slices, &gc, &frame, &child, &on_chain, depth);
            if let Some(path) = path.ok().flatten() {
                holders.extend(path.into_iter().rev());
            }
            break;
        };
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

/// How the modules' globals reach `target`, outermost first: a module's
/// globals dict, then each holder down to `target`'s own. For a head the
/// listing has no holder of: a holder frozen with `gc.freeze()` (vLLM
/// freezes its start-up heap in every process) is in no generation gc
/// lists, so the global list a leak grows in would end the chain one step
/// above the leak. A breadth-first walk of what the globals reach, at most
/// `depth` levels, `__main__` first, in the census's slices; it skips
/// `avoid`, frames (a request's locals are not what retains a leak) and
/// what gc does not track (it holds nothing tracked). `None` when the budget
/// runs out first or nothing within `depth` holds `target`.
fn path_from_modules<'py>(
    slices: &mut Slices<'py>,
    gc: &Bound<'py, PyModule>,
    frame: &Bound<'py, PyAny>,
    target: &Bound<'py, PyAny>,
    avoid: &HashSet<usize>,
    depth: usize,
) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
    let py = slices.py;
    let referents = gc.getattr("get_referents")?;
    let mut globals: Vec<(bool, Bound<'py, PyAny>)> = Vec::new();
    for (name, module) in py
        .import("sys")?
        .getattr("modules")?
        .cast::<PyDict>()?
        .iter()
    {
        if let Ok(dict) = module.getattr("__dict__") {
            let main = name.extract::<String>().is_ok_and(|n| n == "__main__");
            globals.push((!main, dict));
        }
    }
    globals.sort_by_key(|(later, _)| *later);
    // Each object reached, and the index of the one it was reached from.
    let mut nodes: Vec<(Bound<'py, PyAny>, usize)> = Vec::new();
    let mut seen = avoid.clone();
    for (_, dict) in globals {
        if seen.insert(dict.as_ptr() as usize) {
            nodes.push((dict, usize::MAX));
        }
    }
    let mut level = 0..nodes.len();
    // Objects expanded and referents seen: the clock is read every
    // WALK_CLOCK_EVERY of them, however they are spread over the nodes.
    let mut work = 0usize;
    let mut tick = |slices: &mut Slices<'py>| {
        work += 1;
        !work.is_multiple_of(WALK_CLOCK_EVERY) || slices.step()
    };
    for _ in 0..depth {
        for i in level.clone() {
            if !tick(slices) {
                return Ok(None);
            }
            let held = untracked(referents.call1((&nodes[i].0,))?.cast_into::<PyList>()?);
            for r in held.iter() {
                if !tick(slices) {
                    return Ok(None);
                }
                if r.is(target) {
                    let mut path = Vec::new();
                    let mut at = i;
                    while at != usize::MAX {
                        path.push(nodes[at].0.clone());
                        at = nodes[at].1;
                    }
                    path.reverse();
                    return Ok(Some(path));
                }
                // SAFETY: a live object, the GIL held.
                let tracked = unsafe { pyo3::ffi::PyObject_GC_IsTracked(r.as_ptr()) } == 1;
                if tracked && !r.get_type().is(frame) && seen.insert(r.as_ptr() as usize) {
                    nodes.push((r, i));
                }
            }
        }
        level = level.end..nodes.len();
        if level.is_empty() {
            break;
        }
    }
    Ok(None)
}
