//! [`NvmlApi`] over the driver's `libnvidia-ml.so.1`, through `nvml-wrapper`.
//!
//! Device handles are kept as NVML's own pointers, so that a sample costs
//! only the reading calls (no handle look-up per call); they stay valid
//! while this `Nvml` is initialised, and it lives as long as they are used.

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::structs::device::MigMode;
use nvml_wrapper::{Device, Nvml};

use super::{DeviceHandle, MemoryInfo, NvmlApi, ProcessUsage};

/// NVML as loaded from the driver.
pub struct SystemNvml {
    nvml: Nvml,
}

impl SystemNvml {
    /// Loads and initialises NVML; the error says why not (no library, no driver).
    pub fn init() -> Result<SystemNvml, NvmlError> {
        Nvml::init().map(|nvml| SystemNvml { nvml })
    }

    fn device(&self, handle: DeviceHandle) -> Device<'_> {
        // SAFETY: every handle this type gives out came from `self.nvml`
        // (`handle_of`), which is still initialised: `self` owns it.
        unsafe { Device::new(handle.0 as _, &self.nvml) }
    }
}

fn handle_of(device: &Device<'_>) -> DeviceHandle {
    // SAFETY: reading the raw handle has no preconditions; it is only ever
    // turned back into a Device by `SystemNvml::device`.
    DeviceHandle(unsafe { device.handle() } as usize)
}

fn usage(processes: Vec<ProcessInfo>) -> Vec<ProcessUsage> {
    processes
        .into_iter()
        .map(|p| ProcessUsage {
            pid: p.pid,
            used_bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes),
                UsedGpuMemory::Unavailable => None,
            },
        })
        .collect()
}

impl NvmlApi for SystemNvml {
    fn device_count(&self) -> Result<u32, NvmlError> {
        self.nvml.device_count()
    }

    fn device_by_index(&self, index: u32) -> Result<DeviceHandle, NvmlError> {
        self.nvml.device_by_index(index).map(|d| handle_of(&d))
    }

    fn uuid(&self, device: DeviceHandle) -> Result<String, NvmlError> {
        self.device(device).uuid()
    }

    fn name(&self, device: DeviceHandle) -> Result<String, NvmlError> {
        self.device(device).name()
    }

    fn pci_bus_id(&self, device: DeviceHandle) -> Result<String, NvmlError> {
        self.device(device).pci_info().map(|p| p.bus_id)
    }

    fn mig_enabled(&self, device: DeviceHandle) -> Result<bool, NvmlError> {
        self.device(device)
            .mig_mode()
            .map(|MigMode { current, .. }| current == 1)
    }

    fn max_mig_devices(&self, device: DeviceHandle) -> Result<u32, NvmlError> {
        self.device(device).mig_device_count()
    }

    fn mig_device_by_index(
        &self,
        device: DeviceHandle,
        index: u32,
    ) -> Result<DeviceHandle, NvmlError> {
        self.device(device)
            .mig_device_by_index(index)
            .map(|d| handle_of(&d))
    }

    fn memory_info_v2(&self, device: DeviceHandle) -> Result<MemoryInfo, NvmlError> {
        self.device(device).memory_info().map(|m| MemoryInfo {
            total: m.total,
            free: m.free,
            used: m.used,
        })
    }

    fn memory_info_v1(&self, device: DeviceHandle) -> Result<MemoryInfo, NvmlError> {
        // nvml-wrapper calls only the _v2 entry point; drivers older than it
        // have the unversioned one, reached through the loaded library.
        let sym = nvml_sym(self.nvml.lib().nvmlDeviceGetMemoryInfo.as_ref())?;
        // SAFETY: the symbol is NVML's nvmlDeviceGetMemoryInfo(device,
        // nvmlMemory_t*); the struct is plain integers, zero is a valid
        // value, and the handle came from this NVML.
        unsafe {
            let mut memory = std::mem::zeroed();
            nvml_try(sym(device.0 as _, &mut memory))?;
            Ok(MemoryInfo {
                total: memory.total,
                free: memory.free,
                used: memory.used,
            })
        }
    }

    fn compute_processes_v3(&self, device: DeviceHandle) -> Result<Vec<ProcessUsage>, NvmlError> {
        self.device(device).running_compute_processes().map(usage)
    }

    fn compute_processes_v2(&self, device: DeviceHandle) -> Result<Vec<ProcessUsage>, NvmlError> {
        self.device(device)
            .running_compute_processes_v2()
            .map(usage)
    }
}
