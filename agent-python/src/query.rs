//! Reads a collector back over its QueryService, for tools and tests in
//! Python: `oomscope.query.timeline(url, agent)` gets every field of the
//! protos, where `oomscope timeline --json` prints a digest. (A timeline too
//! large to send whole comes as the samples' figures: every field but the
//! allocators' `raw` dicts; see `collector/STORAGE.md`.)
//!
//! The Python objects are the messages' own serde form (oomscope-proto's
//! `serde` feature) made by pythonize, so a field added to a `.proto` shows up
//! here without a line of code: dicts keyed by the proto field names, an unset
//! message or `optional` field as None, enum fields as their numbers, a
//! oneof's member under its own field name. Two changes of shape, for the
//! callers' convenience: a timeline's samples and events are the `Sample` and
//! `Event` dicts with their `seq` added, and an event names its oneof member
//! in `kind` (`{"seq": 9, "time_ns": ..., "kind": "oom", "oom": {...}}`;
//! `"kind": None` for an event without one) and its sender in `agent_id`
//! (empty for the timeline's own agent; an instance's timeline holds every
//! member's events, its `members` the members' `AgentSummary` dicts).

use std::time::Duration;

use oomscope_agent_core::pb;
use oomscope_client::Client;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pythonize::pythonize;

/// Runs one query with the GIL released: connecting may take up to
/// `timeout`, and so may the call.
fn fetch<T: Send>(
    py: Python<'_>,
    url: &str,
    timeout: Duration,
    query: impl FnOnce(&mut Client) -> oomscope_client::Result<T> + Send,
) -> PyResult<T> {
    py.detach(|| Client::connect_with(url, timeout, timeout).and_then(|mut c| query(&mut c)))
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The agent's whole timeline (by id or name), every sample and event.
pub fn timeline<'py>(
    py: Python<'py>,
    url: &str,
    agent: &str,
    timeout: Duration,
) -> PyResult<Bound<'py, PyDict>> {
    let req = pb::TimelineRequest {
        agent: agent.to_string(),
        ..Default::default()
    };
    let t = fetch(py, url, timeout, |c| c.timeline(req))?;
    let samples = PyList::empty(py);
    for s in t.samples {
        let d = as_dict(py, &s.sample.unwrap_or_default())?;
        d.set_item("seq", s.seq)?;
        samples.append(d)?;
    }
    let events = PyList::empty(py);
    for e in t.events {
        let mut event = e.event.unwrap_or_default();
        // Serialized apart, the oneof is a one-entry dict: its key is the kind.
        let kind = event.kind.take();
        let d = as_dict(py, &event)?;
        d.set_item("seq", e.seq)?;
        d.set_item("agent_id", e.agent_id)?;
        d.set_item("kind", py.None())?;
        if let Some(kind) = kind {
            let member = as_dict(py, &kind)?;
            for (name, body) in member.iter() {
                d.set_item("kind", &name)?;
                d.set_item(name, body)?;
            }
        }
        events.append(d)?;
    }
    let out = PyDict::new(py);
    out.set_item("hello", pythonize(py, &t.hello)?)?;
    out.set_item("samples", samples)?;
    out.set_item("events", events)?;
    out.set_item("members", pythonize(py, &t.members)?)?;
    Ok(out)
}

/// Every agent the collector knows, as a list of `AgentSummary` dicts.
pub fn agents<'py>(py: Python<'py>, url: &str, timeout: Duration) -> PyResult<Bound<'py, PyAny>> {
    let r = fetch(py, url, timeout, |c| c.agents())?;
    Ok(pythonize(py, &r.agents)?)
}

fn as_dict<'py>(py: Python<'py>, v: &impl serde::Serialize) -> PyResult<Bound<'py, PyDict>> {
    Ok(pythonize(py, v)?.cast_into::<PyDict>()?)
}
