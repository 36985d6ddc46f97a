//! The GPU domain as the driver sees it, through NVML (`nvml-wrapper`).
//!
//! NVML is loaded at run time: without `libnvidia-ml.so.1` or without a GPU
//! the probe is simply absent. Every NVML call also runs under
//! `catch_unwind`, because this code runs inside someone's server.

use std::panic::{catch_unwind, AssertUnwindSafe};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

use crate::pb;

/// A handle on NVML, or nothing when it is not available.
pub struct GpuProbe {
    nvml: Option<Nvml>,
}

impl std::fmt::Debug for GpuProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuProbe")
            .field("present", &self.is_present())
            .finish()
    }
}

impl GpuProbe {
    /// Initialises NVML; absent (never a panic) when the library is missing,
    /// fails to initialise, or sees no device.
    pub fn open() -> GpuProbe {
        let nvml = catch_unwind(|| Nvml::init().ok()).ok().flatten();
        let nvml = nvml.filter(|n| guarded(|| n.device_count().ok()).is_some_and(|c| c > 0));
        GpuProbe { nvml }
    }

    /// A probe that never reads anything (tests, hosts told to skip NVML).
    pub fn absent() -> GpuProbe {
        GpuProbe { nvml: None }
    }

    pub fn is_present(&self) -> bool {
        self.nvml.is_some()
    }

    /// Every device's memory and compute processes. A device that fails to
    /// answer is skipped; a process whose usage NVML cannot see reads 0 bytes.
    pub fn read(&self) -> Vec<pb::GpuDevice> {
        let Some(nvml) = &self.nvml else {
            return Vec::new();
        };
        guarded(|| {
            let count = nvml.device_count().ok()?;
            Some((0..count).filter_map(|i| read_device(nvml, i)).collect())
        })
        .unwrap_or_default()
    }

    /// The devices as a Hello's placement list (no per-process cap known here).
    pub fn placements(&self) -> Vec<pb::GpuPlacement> {
        self.read()
            .into_iter()
            .map(|d| pb::GpuPlacement {
                index: d.index,
                uuid: d.uuid,
                name: d.name,
                total_bytes: d.total_bytes,
                cap_bytes: 0,
                pci_bus_id: d.pci_bus_id,
                ordinal: None,
                parent_uuid: d.parent_uuid,
            })
            .collect()
    }
}

fn read_device(nvml: &Nvml, index: u32) -> Option<pb::GpuDevice> {
    let device = nvml.device_by_index(index).ok()?;
    let memory = device.memory_info().ok()?;
    let processes = device
        .running_compute_processes()
        .unwrap_or_default()
        .into_iter()
        .map(|p| pb::GpuProcessUsage {
            pid: p.pid,
            used_bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes),
                UsedGpuMemory::Unavailable => None,
            },
            view: pb::PidView::Unspecified as i32,
        })
        .collect();
    Some(pb::GpuDevice {
        index: index as i32,
        uuid: device.uuid().unwrap_or_default(),
        name: device.name().unwrap_or_default(),
        total_bytes: memory.total,
        free_bytes: memory.free,
        used_bytes: memory.used,
        processes,
        pci_bus_id: String::new(),
        parent_uuid: String::new(),
        unreadable: String::new(),
    })
}

/// Runs an NVML call, turning a panic into None.
fn guarded<T>(f: impl FnOnce() -> Option<T>) -> Option<T> {
    catch_unwind(AssertUnwindSafe(f)).ok().flatten()
}
