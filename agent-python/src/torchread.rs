//! Reads PyTorch's CUDA state, with the GIL held. Active only when torch is
//! already imported and CUDA is initialised: the agent never imports torch
//! and never initialises CUDA itself (that would put a CUDA context on a GPU
//! the server may not use).
//!
//! Every call the agent makes into `torch.cuda` goes through [`TorchCuda`],
//! found in `sys.modules` at each use: the one seam between the agent and
//! PyTorch's CUDA, so a test can put a scripted `torch` there and see every
//! device each call touched (tests/test_device_selection.py). What the calls
//! cost a device, from PyTorch's source:
//! - `device_count`, `_cuda_hasPrimaryContext(d)`, `_cuda_memoryStats(d)`
//!   (and `memory_stats(d)` over it), `get_device_properties(d)`,
//!   `memory._snapshot()` and `get_allocator_backend()` read state the host
//!   already has: none creates a CUDA context. (`cudaMallocAsync`'s stats
//!   "return 0s without creating a context" on a device it has not used.)
//! - `mem_get_info(d)` makes `d` current for the call: a context of 300 to
//!   600 MB on `d` when the process had none there. Only asked where the
//!   process has one already.
//! - `current_device()` is the *calling thread's* device (a new thread's is
//!   0): only asked on the server's own threads, never on the sampler's.

use std::collections::BTreeMap;

use oomscope_agent_core::readers::gpu::nvml_pci_bus_id;
use oomscope_agent_core::{pb, torch};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::pyjson;

/// The `torch` module, when something has imported it (never imported here).
fn imported_torch(py: Python<'_>) -> Option<Bound<'_, PyAny>> {
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    modules.cast::<PyDict>().ok()?.get_item("torch").ok()?
}

/// Who a device is, read once from `get_device_properties`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceIdentity {
    /// As NVML writes it: "GPU-…", or "MIG-…" on a MIG instance; empty
    /// where this torch does not say.
    pub uuid: String,
    /// "00000000:3B:00.0" as NVML writes it; empty where torch does not say.
    pub pci_bus_id: String,
    pub name: String,
    pub total_bytes: u64,
}

/// `torch.cuda` as the agent uses it, when torch is imported and CUDA is
/// initialised (see the module's note for what each call costs a device).
pub struct TorchCuda<'py> {
    torch: Bound<'py, PyAny>,
    cuda: Bound<'py, PyAny>,
}

impl<'py> TorchCuda<'py> {
    pub fn get(py: Python<'py>) -> Option<Self> {
        let torch = imported_torch(py)?;
        let cuda = torch.getattr("cuda").ok()?;
        let ready = cuda.call_method0("is_initialized").ok()?.is_truthy().ok()?;
        ready.then_some(TorchCuda { torch, cuda })
    }

    pub fn device_count(&self) -> i32 {
        self.cuda
            .call_method0("device_count")
            .and_then(|n| n.extract::<i32>())
            .unwrap_or(0)
    }

    /// The calling thread's current device.
    pub fn current_device(&self) -> Option<i32> {
        self.cuda
            .call_method0("current_device")
            .and_then(|d| d.extract::<i32>())
            .ok()
    }

    /// Whether the process has CUDA's primary context on `device` (the
    /// driver's answer; creates none). None where this torch cannot say.
    pub fn has_context(&self, device: i32) -> Option<bool> {
        self.torch
            .getattr("_C")
            .and_then(|c| c.call_method1("_cuda_hasPrimaryContext", (device,)))
            .and_then(|b| b.is_truthy())
            .ok()
    }

    /// The allocator's counters of `device`, flattened as `memory_stats()`
    /// names them ("allocated_bytes.all.current", ...).
    ///
    /// They come from the nested dict torch builds in C++
    /// (`torch._C._cuda_memoryStats`, what `memory_stats()` itself calls),
    /// flattened here: `memory_stats()` flattens and sorts its ~120 entries
    /// in Python, the larger part of a sample's GIL time (66 us of Python on
    /// the CI machine, see BENCHMARKS.md). Falls back to `memory_stats()`
    /// should a torch lack the private call.
    pub fn counters(&self, device: i32) -> Option<BTreeMap<String, i64>> {
        let nested = self
            .torch
            .getattr("_C")
            .and_then(|c| c.call_method1("_cuda_memoryStats", (device,)))
            .ok()
            .filter(|d| d.is_instance_of::<PyDict>());
        let stats = match nested {
            Some(d) => d,
            None => self.cuda.call_method1("memory_stats", (device,)).ok()?,
        };
        let mut map = BTreeMap::new();
        flatten(stats.cast::<PyDict>().ok()?, &mut String::new(), &mut map);
        Some(map)
    }

    /// `mem_get_info(device)` as (free, total): creates a context on a
    /// device that has none (see the module's note).
    pub fn mem_get_info(&self, device: i32) -> Option<(u64, u64)> {
        self.cuda
            .call_method1("mem_get_info", (device,))
            .and_then(|t| t.extract::<(u64, u64)>())
            .ok()
    }

    pub fn identity(&self, device: i32) -> Option<DeviceIdentity> {
        let p = self
            .cuda
            .call_method1("get_device_properties", (device,))
            .ok()?;
        let name: String = p
            .getattr("name")
            .and_then(|n| n.extract())
            .unwrap_or_default();
        let int = |k: &str| p.getattr(k).and_then(|v| v.extract::<u32>()).ok();
        let pci_bus_id = match (
            int("pci_domain_id"),
            int("pci_bus_id"),
            int("pci_device_id"),
        ) {
            (Some(domain), Some(bus), Some(dev)) => nvml_pci_bus_id(domain, bus, dev),
            _ => String::new(),
        };
        let uuid = p.getattr("uuid").ok().map_or_else(String::new, |u| {
            // torch 2.x: a `_CUuuid` with the 16 bytes; older ones a string.
            match u.getattr("bytes").ok() {
                Some(b) if b.is_instance_of::<PyBytes>() => {
                    let b: Vec<u8> = b.extract().unwrap_or_default();
                    nvml_uuid(&uuid_text(&b), &name)
                }
                _ => nvml_uuid(&u.str().map(|s| s.to_string()).unwrap_or_default(), &name),
            }
        });
        Some(DeviceIdentity {
            uuid,
            pci_bus_id,
            total_bytes: p
                .getattr("total_memory")
                .and_then(|t| t.extract())
                .unwrap_or(0),
            name,
        })
    }

    /// `torch.cuda.memory._snapshot()` (every device's segments; the
    /// `cudaMallocAsync` backend has none and raises).
    pub fn snapshot(&self) -> Option<Bound<'py, PyAny>> {
        self.cuda
            .getattr("memory")
            .ok()?
            .call_method0("_snapshot")
            .ok()
    }

    /// The allocator backend (`native`, `cudaMallocAsync`).
    pub fn backend(&self) -> Option<String> {
        self.cuda
            .call_method0("get_allocator_backend")
            .ok()?
            .extract()
            .ok()
    }
}

/// 16 bytes as "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"; empty for any other length.
pub fn uuid_text(bytes: &[u8]) -> String {
    if bytes.len() != 16 {
        return String::new();
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// A device uuid as NVML writes it: CUDA's (and torch's `str()` of it) has
/// no prefix; NVML's is "GPU-…", or "MIG-…" for a MIG instance, which CUDA
/// names "… MIG 1g.10gb". Text that is no uuid gives "".
pub fn nvml_uuid(text: &str, device_name: &str) -> String {
    let text = text.trim();
    if text.starts_with("GPU-") || text.starts_with("MIG-") {
        return text.to_string();
    }
    let is_uuid = text.len() == 36
        && text.char_indices().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        });
    if !is_uuid {
        return String::new();
    }
    let mig = device_name.split_whitespace().any(|w| w == "MIG");
    format!(
        "{}-{}",
        if mig { "MIG" } else { "GPU" },
        text.to_ascii_lowercase()
    )
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

/// `torch.cuda.memory._snapshot()` summarised for `device`.
pub fn snapshot(py: Python<'_>, device: i32) -> Option<pb::SnapshotSummary> {
    let raw = TorchCuda::get(py)?.snapshot()?;
    Some(torch::snapshot_summary(&pyjson::to_json(&raw), device))
}

/// The allocator's settings from the environment (and the backend, when
/// torch is up).
pub fn settings(py: Python<'_>) -> pb::AllocatorSettings {
    let conf = std::env::var("PYTORCH_CUDA_ALLOC_CONF")
        .or_else(|_| std::env::var("PYTORCH_ALLOC_CONF"))
        .unwrap_or_default();
    let mut s = torch::alloc_conf_settings(&conf);
    if let Some(b) = TorchCuda::get(py).and_then(|c| c.backend()) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cuda_uuid_is_written_as_nvml_writes_it() {
        let bytes: Vec<u8> = (0u8..16).map(|i| i * 17).collect();
        let text = uuid_text(&bytes);
        assert_eq!(text, "00112233-4455-6677-8899-aabbccddeeff");
        assert_eq!(
            nvml_uuid(&text, "NVIDIA H200"),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
        assert_eq!(
            nvml_uuid(&text.to_uppercase(), "NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
            "MIG-00112233-4455-6677-8899-aabbccddeeff"
        );
        // Already prefixed (an older torch's string) stays; no uuid, no guess.
        assert_eq!(nvml_uuid(" GPU-abc ", "x"), "GPU-abc");
        assert_eq!(nvml_uuid("", "x"), "");
        assert_eq!(nvml_uuid("not-a-uuid", "x"), "");
        assert_eq!(uuid_text(&[1, 2, 3]), "");
    }
}
