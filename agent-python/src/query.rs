//! Reads a collector back over its QueryService, for tools and tests in
//! Python. Each query gives its reply message's serde form (oomscope-proto's
//! `serde` feature) made by pythonize: the very shape `oomscope ... --json`
//! prints, so a field added to a `.proto` shows up here without a line of
//! code. Dicts keyed by the proto field names, an unset message or
//! `optional` field as None, enum fields as their lowercase names, a oneof's
//! member under its own field name (an event is `{"time_ns": ..., "oom":
//! {...}}`). (A timeline too large to send whole comes as the samples'
//! figures: every field but the allocators' `raw` dicts; see
//! `collector/STORAGE.md`.)

use std::time::Duration;

use oomscope_agent_core::pb;
use oomscope_client::Client;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
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

/// The agent's whole timeline (by id or name): a `TimelineResponse` dict.
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
    Ok(pythonize(py, &t)?.cast_into::<PyDict>()?)
}

/// Every agent the collector knows, as a list of `AgentSummary` dicts.
pub fn agents<'py>(py: Python<'py>, url: &str, timeout: Duration) -> PyResult<Bound<'py, PyAny>> {
    let r = fetch(py, url, timeout, |c| c.agents())?;
    Ok(pythonize(py, &r.agents)?)
}

/// The incidents (of one agent, id or name, where given), as a list of
/// `Incident` dicts.
#[pyfunction]
#[pyo3(signature = (collector, agent = "", timeout_s = 10.0))]
fn query_incidents<'py>(
    py: Python<'py>,
    collector: &str,
    agent: &str,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let req = pb::IncidentsRequest {
        agent: agent.to_string(),
        ..Default::default()
    };
    let r = fetch(py, collector, timeout(timeout_s), |c| c.incidents(req))?;
    Ok(pythonize(py, &r.incidents)?)
}

/// The verdict on an incident (its id), or on an agent's latest incident or
/// history; the latest incident with neither: a `Diagnosis` dict.
#[pyfunction]
#[pyo3(signature = (collector, incident = "", agent = "", timeout_s = 10.0))]
fn query_diagnose<'py>(
    py: Python<'py>,
    collector: &str,
    incident: &str,
    agent: &str,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let req = pb::DiagnoseRequest {
        incident: incident.to_string(),
        agent: agent.to_string(),
        ..Default::default()
    };
    let d = fetch(py, collector, timeout(timeout_s), |c| c.diagnose(req))?;
    Ok(pythonize(py, &d)?)
}

fn timeout(timeout_s: f64) -> Duration {
    Duration::from_secs_f64(timeout_s.clamp(0.1, 600.0))
}

/// Adds the queries defined here to the native module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(query_incidents, m)?)?;
    m.add_function(wrap_pyfunction!(query_diagnose, m)?)?;
    Ok(())
}
