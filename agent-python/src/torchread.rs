//! Reads PyTorch's CUDA caching allocator, with the GIL held. Active only
//! when torch is already imported and CUDA is initialised: the agent never
//! imports torch and never initialises CUDA itself (that would put a CUDA
//! context on a GPU the server may not use).

use std::collections::BTreeMap;

use oomscope_agent_core::{pb, torch};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::pyjson;

/// The `torch` module, when something has imported it (never imported here).
fn imported_torch(py: Python<'_>) -> Option<Bound<'_, PyAny>> {
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    modules.cast::<PyDict>().ok()?.get_item("torch").ok()?
}

/// `torch.cuda`, when torch is imported and CUDA is initialised.
pub fn cuda<'py>(py: Python<'py>) -> Option<Bound<'py, PyAny>> {
    let cuda = imported_torch(py)?.getattr("cuda").ok()?;
    let ready = cuda.call_method0("is_initialized").ok()?.is_truthy().ok()?;
    ready.then_some(cuda)
}

/// The device the server allocates on now.
pub fn current_device(cuda: &Bound<'_, PyAny>) -> i32 {
    cuda.call_method0("current_device")
        .and_then(|d| d.extract::<i32>())
        .unwrap_or(0)
}

/// The allocator's counters and `mem_get_info(device)` as AllocatorStats,
/// through the same function `oomscope replay` uses.
///
/// The counters come from the nested dict torch builds in C++
/// (`torch._C._cuda_memoryStats`, what `memory_stats()` itself calls),
/// flattened here: `memory_stats()` flattens and sorts its ~120 entries in
/// Python, the larger part of a sample's GIL time (66 us of Python on the
/// CI machine, see BENCHMARKS.md). Falls back to `memory_stats()` should a
/// torch lack the private call.
pub fn allocator_stats(cuda: &Bound<'_, PyAny>, device: i32) -> Option<pb::AllocatorStats> {
    let nested = imported_torch(cuda.py())
        .and_then(|t| t.getattr("_C").ok())
        .and_then(|c| c.call_method1("_cuda_memoryStats", (device,)).ok())
        .filter(|d| d.is_instance_of::<PyDict>());
    let stats = match nested {
        Some(d) => d,
        None => cuda.call_method1("memory_stats", (device,)).ok()?,
    };
    let info = cuda
        .call_method1("mem_get_info", (device,))
        .and_then(|t| t.extract::<(u64, u64)>())
        .ok();
    stats_from_dict(&stats, device, info)
}

/// A `memory_stats()` dict, or the nested one torch's C++ returns, (and
/// `mem_get_info()`) as AllocatorStats: the live path, also reachable from
/// Python to compare with a replay.
pub fn stats_from_dict(
    stats: &Bound<'_, PyAny>,
    device: i32,
    info: Option<(u64, u64)>,
) -> Option<pb::AllocatorStats> {
    let dict = stats.cast::<PyDict>().ok()?;
    let mut map = BTreeMap::new();
    flatten(dict, &mut String::new(), &mut map);
    Some(torch::allocator_stats(device, &map, info))
}

/// `{"a": {"b": 1}, "c": 2}` as `a.b = 1, c = 2`, the keys `memory_stats()`
/// gives; a flat dict comes out as it went in. Non-integer leaves are skipped.
fn flatten(dict: &Bound<'_, PyDict>, prefix: &mut String, out: &mut BTreeMap<String, i64>) {
    let len = prefix.len();
    for (k, v) in dict.iter() {
        let Ok(k) = k.cast::<PyString>() else {
            continue;
        };
        let Ok(k) = k.to_cow() else {
            continue;
        };
        if len > 0 {
            prefix.push('.');
        }
        prefix.push_str(&k);
        if let Ok(inner) = v.cast::<PyDict>() {
            flatten(inner, prefix, out);
        } else if let Ok(v) = v.extract::<i64>() {
            out.insert(prefix.clone(), v);
        }
        prefix.truncate(len);
    }
}

/// Stats of the current device (one entry, or none without CUDA).
pub fn read_all(py: Python<'_>) -> Vec<pb::AllocatorStats> {
    let Some(cuda) = cuda(py) else {
        return Vec::new();
    };
    allocator_stats(&cuda, current_device(&cuda))
        .into_iter()
        .collect()
}

/// `torch.cuda.memory._snapshot()` summarised for `device`.
pub fn snapshot(py: Python<'_>, device: Option<i32>) -> Option<pb::SnapshotSummary> {
    let cuda = cuda(py)?;
    let device = device.unwrap_or_else(|| current_device(&cuda));
    let raw = cuda
        .getattr("memory")
        .ok()?
        .call_method0("_snapshot")
        .ok()?;
    Some(torch::snapshot_summary(&pyjson::to_json(&raw), device))
}

/// The allocator backend (`native`, `cudaMallocAsync`) where torch says.
pub fn backend(py: Python<'_>) -> Option<String> {
    let cuda = cuda(py)?;
    cuda.call_method0("get_allocator_backend")
        .ok()?
        .extract()
        .ok()
}

/// The allocator's settings from the environment (and the backend, when
/// torch is up).
pub fn settings(py: Python<'_>) -> pb::AllocatorSettings {
    let conf = std::env::var("PYTORCH_CUDA_ALLOC_CONF")
        .or_else(|_| std::env::var("PYTORCH_ALLOC_CONF"))
        .unwrap_or_default();
    let mut s = torch::alloc_conf_settings(&conf);
    if let Some(b) = backend(py) {
        s.backend = b;
    }
    s
}

/// `torch.__version__` and `torch.version.cuda`, when torch is imported.
pub fn versions(py: Python<'_>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Some(torch) = imported_torch(py) else {
        return out;
    };
    if let Ok(v) = torch.getattr("__version__").and_then(|v| v.str()) {
        out.push(("torch".into(), v.to_string()));
    }
    if let Ok(v) = torch.getattr("version").and_then(|v| v.getattr("cuda")) {
        if !v.is_none() {
            if let Ok(v) = v.str() {
                out.push(("cuda".into(), v.to_string()));
            }
        }
    }
    out
}
