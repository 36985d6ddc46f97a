//! The `oomscope` Python extension: an in-process agent for PyTorch servers.
//!
//! This is the native module `oomscope._native`; the package `oomscope`
//! (agent-python/python/oomscope) is the thin Python surface over it. The
//! work is done here, in Rust, with agent-core's readers and reporter: host
//! domains without the GIL on the agent's own thread, the CUDA caching
//! allocator and the heap census with the GIL, briefly.
//!
//! Nothing here raises into user code from a background thread, and no
//! Rust panic crosses into Python: pyo3 turns a panic in a Python-called
//! function into an exception, and the background threads catch their own.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oomscope_agent_core::{lock, pb};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pythonize::pythonize;

pub mod agent;
pub mod census;
pub mod config;
pub mod context;
pub mod devices;
pub mod exit;
pub mod own_heap;
pub mod pyjson;
pub mod query;
pub mod request;
pub mod sampler;
pub mod signals;
pub mod suspicion;
pub mod torchread;

use agent::Agent;
use config::{Config, Env, ModelSpec};

/// The process's agent. Taken only with the GIL held and never across a
/// GIL release (see `agent`), so a fork never finds it locked.
static AGENT: Mutex<Option<Arc<Agent>>> = Mutex::new(None);

pub(crate) fn current() -> Option<Arc<Agent>> {
    lock(&AGENT).clone()
}

/// start()'s keyword arguments as text, None and absent alike left out.
fn given(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    if let Some(kw) = kwargs {
        for (k, v) in kw.iter() {
            if v.is_none() {
                continue;
            }
            out.insert(k.extract::<String>()?, v.str()?.to_string());
        }
    }
    Ok(out)
}

fn default_name(py: Python<'_>) -> String {
    py.import("sys")
        .and_then(|s| s.getattr("argv"))
        .and_then(|a| a.get_item(0))
        .and_then(|a| a.extract::<String>())
        .ok()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
        })
        .filter(|s| !s.is_empty() && s != "-c")
        .unwrap_or_else(|| "python".into())
}

/// Starts the agent. Settings not given come from `OOMSCOPE_*` variables.
/// `autostart=True` (the `.pth` hook only) starts held (see
/// [`config::DEFAULT_AUTOSTART_HOLD`]). While the autostart's agent runs,
/// an explicit start re-configures it ([`reconfigure`]): the app's own
/// call wins over the environment. While an agent started by the app runs,
/// a second start does nothing and returns False.
#[pyfunction]
#[pyo3(signature = (autostart = false, **kwargs))]
fn start(py: Python<'_>, autostart: bool, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<bool> {
    let running = current();
    if let Some(a) = &running {
        if autostart || !a.config.autostarted {
            return Ok(false);
        }
    }
    // A bad value raises here, before a running agent is touched.
    let mut config =
        Config::resolve(&given(kwargs)?, &Env, &default_name(py)).map_err(PyValueError::new_err)?;
    config.autostarted = autostart;
    if !autostart {
        config.hold = Duration::ZERO;
    }
    let changed = match running {
        Some(a) => reconfigure(py, &a, config),
        None => {
            launch(py, config);
            true
        }
    };
    // The caller's thread is the server's: its device is one the agent reads.
    if let Some(a) = current() {
        a.devices.note_current(py);
    }
    Ok(changed)
}

/// The app's explicit start() over the autostart's agent `a`: the app's
/// settings win, and the agent is released (the program wants it heard).
/// Returns whether anything changed. In order of preference:
/// - the same settings: nothing to change (`oomscope run` gives the app's
///   own `start()` the same name through the environment);
/// - still held: nothing was said yet, so it is replaced without a trace by
///   an agent started with the app's settings (its id carries the new name);
/// - only the identity differs (name, role, rank, model): a new Hello on
///   the open stream, same agent id;
/// - a setting a running agent cannot change (collector, interval, spool,
///   ...): it says Goodbye ("reconfigured") and a new agent starts.
fn reconfigure(py: Python<'_>, a: &Arc<Agent>, config: Config) -> bool {
    let running = a.settings(py);
    if running.same_settings(&config) && running.same_identity(&config) {
        a.release();
        return false;
    }
    if !a.reporter.held() && running.same_settings(&config) {
        a.reconfigure_identity(py, config);
        a.release();
        return true;
    }
    let taken = lock(&AGENT).take();
    if let Some(old) = taken {
        // Held, it leaves silently (agent-core's reporter says nothing).
        old.stop(py, "reconfigured", 0);
    }
    launch(py, config);
    true
}

/// Starts an agent and its sampler, and makes it this process's agent.
fn launch(py: Python<'_>, config: Config) {
    let (agent, reader) = Agent::start(py, config);
    sampler::start(&agent, reader);
    exit::register();
    signals::watch(&agent);
    *lock(&AGENT) = Some(agent);
}

/// Stops the agent: Goodbye (with `exit_code`, the status the process
/// ends with when known), then waits (GIL released) for the acks. Returns
/// whether everything was acked; a second call returns False.
#[pyfunction]
#[pyo3(signature = (reason = "stop", exit_code = 0))]
fn stop(py: Python<'_>, reason: &str, exit_code: i32) -> bool {
    let taken = lock(&AGENT).take();
    match taken {
        Some(a) => a.stop(py, reason, exit_code),
        None => false,
    }
}

/// Python's atexit: stops the sampler while the interpreter can still
/// answer it, and leaves the Goodbye to the process's exit, which knows the
/// status it ends with (see `exit`). Returns False when it cannot (no agent,
/// or no exit callback on this platform): the caller says Goodbye now.
#[pyfunction]
fn stop_at_exit(py: Python<'_>) -> bool {
    if !exit::register() {
        return false;
    }
    let taken = lock(&AGENT).take();
    let Some(a) = taken else { return false };
    a.stop_sampler(py);
    exit::defer(a);
    true
}

/// Installs the native SIGTERM handler (see `signals`), once per process;
/// returns how SIGTERM was left: "native", "ignored" or "unavailable".
#[pyfunction]
fn install_signal_handlers() -> &'static str {
    // The running agent was made the one to say Goodbye when it launched.
    signals::install().as_str()
}

#[pyfunction]
fn is_running() -> bool {
    current().is_some()
}

#[pyfunction]
fn agent_id() -> Option<String> {
    current().map(|a| a.agent_id.clone())
}

#[pyfunction]
#[pyo3(signature = (id, prompt_tokens = 0, max_tokens = 0))]
fn request_begin(id: &str, prompt_tokens: u64, max_tokens: u64) {
    if let Some(a) = current() {
        a.request_begin(id, prompt_tokens, max_tokens);
    }
}

#[pyfunction]
#[pyo3(signature = (id, output_tokens = 0, error = ""))]
fn request_end(id: &str, output_tokens: u64, error: &str) {
    if let Some(a) = current() {
        a.request_end(id, output_tokens, error);
    }
}

/// One edge of a phase; returns the device bytes allocated now.
#[pyfunction]
#[pyo3(signature = (name, start, model = None, revision = None, quantization = None, dtype = None, error = "", before = 0))]
#[allow(clippy::too_many_arguments)]
fn phase_edge(
    py: Python<'_>,
    name: &str,
    start: bool,
    model: Option<String>,
    revision: Option<String>,
    quantization: Option<String>,
    dtype: Option<String>,
    error: &str,
    before: u64,
) -> u64 {
    let Some(a) = current() else { return 0 };
    let spec = model.map(|name| ModelSpec {
        name,
        revision: revision.unwrap_or_default(),
        quantization: quantization.unwrap_or_default(),
        dtype: dtype.unwrap_or_default(),
    });
    a.phase_edge(py, name, start, spec, error, before)
}

/// The runtime's own numbers; None leaves a number as it was.
#[pyfunction]
#[pyo3(signature = (**kwargs))]
fn set_context(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let Some(a) = current() else { return Ok(()) };
    let Some(kw) = kwargs else { return Ok(()) };
    let mut values = Vec::new();
    for (k, v) in kw.iter() {
        if v.is_none() {
            continue;
        }
        let key: String = k.extract()?;
        let n: f64 = v.extract().map_err(|_| {
            PyValueError::new_err(format!(
                "oomscope.set_context: {key} must be a number, not {}",
                v.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        values.push((key, n));
    }
    lock(&a.context).set(values);
    Ok(())
}

/// The runtime's own text facts, carried by every later sample's context.
#[pyfunction]
#[pyo3(signature = (**kwargs))]
fn set_labels(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let Some(a) = current() else { return Ok(()) };
    let Some(kw) = kwargs else { return Ok(()) };
    let mut values = Vec::new();
    for (k, v) in kw.iter() {
        if v.is_none() {
            continue;
        }
        values.push((k.extract::<String>()?, v.str()?.to_string()));
    }
    lock(&a.context).labels.extend(values);
    Ok(())
}

/// What this process is within its server (a runtime's plugin knows better
/// than the command line): the agent's Hello changes, on the open stream too.
#[pyfunction]
#[pyo3(signature = (role = None, rank = None, runtime_name = None))]
fn set_identity(role: Option<String>, rank: Option<i32>, runtime_name: Option<String>) {
    let Some(a) = current() else { return };
    a.reporter.update_hello(|h| {
        if let Some(role) = role {
            h.role = role;
        }
        if let Some(rank) = rank {
            h.rank = rank;
        }
        if let Some(name) = runtime_name {
            h.labels.insert("serving_runtime".into(), name);
        }
    });
}

/// A finished request, reported after the fact (see `Agent::record_request`).
#[pyfunction]
#[pyo3(signature = (id, started_s_ago = 0.0, prompt_tokens = 0, output_tokens = 0, max_tokens = 0))]
fn record_request(
    id: &str,
    started_s_ago: f64,
    prompt_tokens: u64,
    output_tokens: u64,
    max_tokens: u64,
) {
    if let Some(a) = current() {
        let ago = (started_s_ago.max(0.0) * 1e9).min(i64::MAX as f64) as i64;
        a.record_request(id, ago, prompt_tokens, output_tokens, max_tokens);
    }
}

/// A snapshot summary of the device (dict), or None without CUDA.
#[pyfunction]
#[pyo3(signature = (device = None))]
fn snapshot(py: Python<'_>, device: Option<i32>) -> PyResult<Option<Bound<'_, PyAny>>> {
    // Without a device named: the caller's current device.
    let device = device.or_else(|| torchread::TorchCuda::get(py)?.current_device());
    let summary = match current() {
        Some(a) => a.snapshot(py, device),
        None => device.and_then(|d| torchread::snapshot(py, d)),
    };
    Ok(summary.map(|s| pythonize(py, &s)).transpose()?)
}

/// A heap census now (dict). Holds the GIL up to the budget. `sizing`:
/// "all" sizes every object; "growers" sizes as a census on suspicion does
/// (`census::Sizing`).
#[pyfunction(name = "census")]
#[pyo3(signature = (budget_s = None, sizing = "all"))]
fn run_census<'py>(
    py: Python<'py>,
    budget_s: Option<f64>,
    sizing: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let a = current();
    let sizing = census::Sizing::parse(sizing).ok_or_else(|| {
        PyValueError::new_err(format!(
            "oomscope.census: sizing must be \"all\" or \"growers\", not {sizing:?}"
        ))
    })?;
    let budget = match budget_s {
        Some(b) if b.is_finite() && b > 0.0 => Duration::from_secs_f64(b),
        Some(b) => {
            return Err(PyValueError::new_err(format!(
                "oomscope.census: budget_s must be > 0, not {b}"
            )))
        }
        None => a
            .as_ref()
            .map_or(config::DEFAULT_CENSUS_BUDGET, |a| a.config.census_budget),
    };
    let c = match a {
        Some(a) => a.census(py, budget, census::Why::Call, sizing, false)?,
        None => census::run(py, budget, 0, &mut None, sizing, None)?,
    };
    Ok(pythonize(py, &c)?)
}

#[pyfunction]
#[pyo3(signature = (generation, collected, uncollectable = 0, duration_ns = 0))]
fn on_gc(generation: i32, collected: u64, uncollectable: u64, duration_ns: u64) {
    if let Some(a) = current() {
        a.send_event(pb::event::Kind::Gc(pb::GcCollection {
            generation,
            collected,
            uncollectable,
            duration_ns,
        }));
    }
}

#[pyfunction]
#[pyo3(signature = (device, reserved_before, reserved_after, caller = ""))]
fn on_cache_release(device: i32, reserved_before: u64, reserved_after: u64, caller: &str) {
    if let Some(a) = current() {
        a.send_event(pb::event::Kind::CacheRelease(pb::CacheRelease {
            device,
            reserved_before_bytes: reserved_before,
            reserved_after_bytes: reserved_after,
            caller: caller.to_string(),
        }));
    }
}

/// torch's OOM observer: `(device, alloc, device_allocated, device_free)`;
/// the third is the device total or the per-process cap.
#[pyfunction]
fn on_oom_observer(
    py: Python<'_>,
    device: i64,
    alloc: i64,
    device_allocated: i64,
    device_free: i64,
) {
    if let Some(a) = current() {
        a.oom_observed(
            py,
            pb::OomObserver {
                device,
                alloc,
                device_allocated,
                device_free,
            },
        );
    }
}

/// An out-of-memory exception on its way up; returns whether the collector
/// acked the event within `oom_wait_s`.
#[pyfunction]
fn on_oom_exception(py: Python<'_>, error_type: &str, error_text: &str) -> bool {
    current().is_some_and(|a| a.oom_exception(py, error_type, error_text))
}

/// After `os.fork()`, in the child: the parent's agent has no threads here.
/// Leave it untouched (its locks may be held forever; its settings' lock is
/// taken only with the GIL, see `Agent::reconfigured`) and start our own.
#[pyfunction]
fn after_fork_child(py: Python<'_>) {
    let old = lock(&AGENT).take();
    let Some(old) = old else { return };
    let mut config = old.settings(py);
    let (rank, parent) = old.lineage.child();
    std::mem::forget(old);
    config.labels.insert(parent.0, parent.1);
    config.role = config.fork_role.clone();
    config.rank = rank;
    launch(py, config);
}

#[pyfunction]
fn after_fork_parent() {
    if let Some(a) = current() {
        a.lineage.forked();
    }
}

/// Installs the OOM observer, the empty_cache wrapper and the memory
/// history once CUDA is up, each on its own; those torch refuses are kept
/// for `stats()`. The Hello's backend is torch's from then on.
/// CUDA in use ends a held start: a process that touches the GPU matters.
pub fn install_torch_hooks(py: Python<'_>, agent: &Agent) {
    if agent.torch_hooks.swap(true, Ordering::Relaxed) {
        return;
    }
    agent.release();
    let result = py
        .import("oomscope._hooks")
        .and_then(|m| m.call_method1("install_torch", (agent.config.history_max_entries,)))
        .and_then(|missing| missing.extract::<BTreeMap<String, String>>());
    match result {
        Ok(missing) => {
            for (hook, why) in &missing {
                tracing::warn!(hook, why, "oomscope: torch hook not installed");
            }
            lock(&agent.hooks_missing).extend(missing);
        }
        Err(e) => tracing::warn!(error = %e, "oomscope: cannot hook torch"),
    }
    if let Some(backend) = torchread::TorchCuda::get(py).and_then(|c| c.backend()) {
        agent
            .reporter
            .update_hello(|h| h.allocator_settings.get_or_insert_default().backend = backend);
    }
}

#[pyfunction]
fn ensure_torch_hooks(py: Python<'_>) {
    if let Some(a) = current() {
        if !a.torch_hooks.load(Ordering::Relaxed) && torchread::TorchCuda::get(py).is_some() {
            install_torch_hooks(py, &a);
        }
    }
}

/// The reporter's counters, and the agent's own.
#[pyfunction]
fn stats(py: Python<'_>) -> PyResult<Option<Bound<'_, PyAny>>> {
    let Some(a) = current() else { return Ok(None) };
    let s = a.reporter.stats();
    let longest_hold = *lock(&a.census_longest_hold);
    let phases = census::last_phases();
    let (reasons, recent) = {
        let r = lock(&a.census_reasons);
        let recent: Vec<serde_json::Value> = r
            .recent
            .iter()
            .map(|(why, done)| serde_json::json!({"reason": why, "requests_done": done}))
            .collect();
        (r.counts.clone(), recent)
    };
    let v = serde_json::json!({
        "agent_id": a.agent_id, "pid": a.pid, "sent": s.sent, "acked": s.acked, "dropped": s.dropped,
        "spooled": s.spooled, "rejected": s.rejected, "connected": s.connected,
        "thinned": s.thinned, "max_stride": s.max_stride, "buffered_bytes": s.buffered_bytes,
        "buffer_max_bytes": a.config.buffer_max_bytes,
        "connect_failures": s.connect_failures, "last_error": s.last_error,
        "boundary_dropped": a.boundary_dropped.load(Ordering::Relaxed),
        "torch_hooks": a.torch_hooks.load(Ordering::Relaxed),
        "requests_done": lock(&a.context).requests_done,
        "held": a.reporter.held(),
        "agent_heap_bytes": own_heap::live_bytes(),
        "censuses": a.censuses.load(Ordering::Relaxed),
        "census_longest_hold_ms": longest_hold.0 as f64 / 1e6,
        "census_longest_hold_cpu_ms": longest_hold.1 as f64 / 1e6,
        "census_last_cpu_ms": {
            "walk": phases.walk.as_secs_f64() * 1e3,
            "size_growers": phases.size_growers.as_secs_f64() * 1e3,
            "chain": phases.chain.as_secs_f64() * 1e3,
        },
        "census_reasons": reasons, "census_recent": recent,
        "torch_hooks_missing": lock(&a.hooks_missing).clone(),
    });
    Ok(Some(pythonize(py, &v)?))
}

/// Waits (GIL released) until everything sent so far is acked. Ends a
/// held start: asking for delivery is asking to be heard.
#[pyfunction]
#[pyo3(signature = (timeout_s = 5.0))]
fn flush(py: Python<'_>, timeout_s: f64) -> bool {
    let Some(a) = current() else { return false };
    a.release();
    a.forward_events();
    let r = a.reporter.clone();
    let t = Duration::from_secs_f64(timeout_s.clamp(0.0, 3600.0));
    py.detach(move || r.flush(t))
}

/// One periodic-style sample taken now on this thread (for benchmarks:
/// the GIL-held part is what a regular sample costs the server).
#[pyfunction]
fn read_allocator(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let stats = match current() {
        Some(a) => a.devices.read(py, devices::Which::Scan),
        None => devices::Devices::default().read(py, devices::Which::Scan),
    };
    Ok(pythonize(py, &stats)?)
}

/// The live agent's conversion of a `memory_stats()` dict (what each sample
/// carries), for comparing with what `oomscope replay` sends.
#[pyfunction]
#[pyo3(signature = (memory_stats, device = 0, mem_get_info = None))]
fn convert_memory_stats<'py>(
    py: Python<'py>,
    memory_stats: &Bound<'py, PyAny>,
    device: i32,
    mem_get_info: Option<(u64, u64)>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let stats = torchread::stats_from_dict(memory_stats, device, mem_get_info);
    Ok(stats.map(|a| pythonize(py, &a)).transpose()?)
}

/// Benchmarks only: the mean microseconds of the live path's conversion of
/// a counters dict (flat or nested) into AllocatorStats, with the GIL held,
/// as a sample does it (no Python objects made for the result).
#[pyfunction]
fn bench_stats_conversion(stats: &Bound<'_, PyAny>, n: u32) -> f64 {
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        std::hint::black_box(torchread::stats_from_dict(stats, 0, Some((1, 2))));
    }
    t0.elapsed().as_secs_f64() * 1e6 / f64::from(n.max(1))
}

/// The live agent's summary of a `memory._snapshot()` dict.
#[pyfunction]
#[pyo3(signature = (snapshot, device = 0))]
fn summarize_snapshot<'py>(
    py: Python<'py>,
    snapshot: &Bound<'py, PyAny>,
    device: i32,
) -> PyResult<Bound<'py, PyAny>> {
    let s = oomscope_agent_core::torch::snapshot_summary(&pyjson::to_json(snapshot), device);
    Ok(pythonize(py, &s)?)
}

#[pyfunction]
#[pyo3(signature = (collector, agent, timeout_s = 10.0))]
fn query_timeline<'py>(
    py: Python<'py>,
    collector: &str,
    agent: &str,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyDict>> {
    query::timeline(py, collector, agent, query_timeout(timeout_s))
}

#[pyfunction]
#[pyo3(signature = (collector, timeout_s = 10.0))]
fn query_agents<'py>(
    py: Python<'py>,
    collector: &str,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyAny>> {
    query::agents(py, collector, query_timeout(timeout_s))
}

fn query_timeout(timeout_s: f64) -> Duration {
    Duration::from_secs_f64(timeout_s.clamp(0.1, 600.0))
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    oomscope_agent_core::own_heap::set_reader(own_heap::live_bytes);
    m.add_function(wrap_pyfunction!(start, m)?)?;
    m.add_function(wrap_pyfunction!(stop, m)?)?;
    m.add_function(wrap_pyfunction!(stop_at_exit, m)?)?;
    m.add_function(wrap_pyfunction!(install_signal_handlers, m)?)?;
    m.add_function(wrap_pyfunction!(is_running, m)?)?;
    m.add_function(wrap_pyfunction!(agent_id, m)?)?;
    m.add_function(wrap_pyfunction!(set_labels, m)?)?;
    m.add_function(wrap_pyfunction!(set_identity, m)?)?;
    m.add_function(wrap_pyfunction!(record_request, m)?)?;
    m.add_class::<request::Request>()?;
    m.add_function(wrap_pyfunction!(request::exit_error, m)?)?;
    m.add_function(wrap_pyfunction!(request_begin, m)?)?;
    m.add_function(wrap_pyfunction!(request_end, m)?)?;
    m.add_function(wrap_pyfunction!(phase_edge, m)?)?;
    m.add_function(wrap_pyfunction!(set_context, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(run_census, m)?)?;
    m.add_function(wrap_pyfunction!(on_gc, m)?)?;
    m.add_function(wrap_pyfunction!(on_cache_release, m)?)?;
    m.add_function(wrap_pyfunction!(on_oom_observer, m)?)?;
    m.add_function(wrap_pyfunction!(on_oom_exception, m)?)?;
    m.add_function(wrap_pyfunction!(after_fork_child, m)?)?;
    m.add_function(wrap_pyfunction!(after_fork_parent, m)?)?;
    m.add_function(wrap_pyfunction!(ensure_torch_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(flush, m)?)?;
    m.add_function(wrap_pyfunction!(read_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(query_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(convert_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(bench_stats_conversion, m)?)?;
    m.add_function(wrap_pyfunction!(summarize_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(query_agents, m)?)?;
    query::register(m)?;
    Ok(())
}
