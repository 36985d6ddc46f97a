//! The GPU domain as the driver sees it, through NVML.
//!
//! NVML is optional: it is loaded at run time, and without
//! `libnvidia-ml.so.1`, a driver or a device the reader is simply absent.
//! Everything is read through [`NvmlApi`], a narrow seam that tests script
//! (MIG layouts, refusals, older drivers) and [`nvml::SystemNvml`] implements
//! over the real library. Every call runs under `catch_unwind`, because this
//! code runs inside someone's server.
//!
//! Cost: what does not change while the process runs (each device's uuid,
//! name, PCI bus id and total, the MIG layout) is read once, when the reader
//! opens; a sample reads only each device's memory and compute processes.
//! So a MIG instance created later is seen by the next reader only (the
//! supervisor opens one per child start), and one destroyed meanwhile reads
//! as unreadable.

pub mod nvml;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

pub use nvml_wrapper::error::NvmlError;

use crate::pb;
use crate::sync::lock;

/// A PCI address as NVML's `busId` writes it ("00000000:3B:00.0": 8 hex
/// digits of domain, upper case; a GPU is function 0). Every agent writes
/// this one form, so readings of one device compare equal.
pub fn nvml_pci_bus_id(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:08X}:{bus:02X}:{device:02X}.0")
}

/// An NVML device handle as the [`NvmlApi`] implementation chose it (a
/// pointer for the real library, a table index for a fake).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceHandle(pub usize);

/// A device's memory as NVML reports it, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryInfo {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// One compute process on a device; `used_bytes` None where NVML cannot
/// give it (MIG without privileges, some drivers and containers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    pub pid: u32,
    pub used_bytes: Option<u64>,
}

/// What the reader reads from NVML, one method per NVML call. Versioned calls
/// are separate methods so that the reader, not the implementation, decides
/// when to fall back to the older one.
pub trait NvmlApi: Send + Sync {
    fn device_count(&self) -> Result<u32, NvmlError>;
    fn device_by_index(&self, index: u32) -> Result<DeviceHandle, NvmlError>;
    fn uuid(&self, device: DeviceHandle) -> Result<String, NvmlError>;
    fn name(&self, device: DeviceHandle) -> Result<String, NvmlError>;
    /// "00000000:3B:00.0" as NVML writes it.
    fn pci_bus_id(&self, device: DeviceHandle) -> Result<String, NvmlError>;
    /// Whether MIG mode is on now (not after the next reset).
    fn mig_enabled(&self, device: DeviceHandle) -> Result<bool, NvmlError>;
    /// How many MIG device slots a GPU has (not how many are in use).
    fn max_mig_devices(&self, device: DeviceHandle) -> Result<u32, NvmlError>;
    /// The MIG instance in `slot`; `NotFound` where the slot is empty.
    fn mig_device_by_index(
        &self,
        device: DeviceHandle,
        slot: u32,
    ) -> Result<DeviceHandle, NvmlError>;
    /// nvmlDeviceGetMemoryInfo_v2.
    fn memory_info_v2(&self, device: DeviceHandle) -> Result<MemoryInfo, NvmlError>;
    /// nvmlDeviceGetMemoryInfo, for drivers without the _v2 call.
    fn memory_info_v1(&self, device: DeviceHandle) -> Result<MemoryInfo, NvmlError>;
    /// nvmlDeviceGetComputeRunningProcesses_v3.
    fn compute_processes_v3(&self, device: DeviceHandle) -> Result<Vec<ProcessUsage>, NvmlError>;
    /// nvmlDeviceGetComputeRunningProcesses_v2, for drivers without _v3.
    fn compute_processes_v2(&self, device: DeviceHandle) -> Result<Vec<ProcessUsage>, NvmlError>;
}

/// A handle on NVML, or nothing when it is not available.
pub struct GpuReader {
    api: Option<Box<dyn NvmlApi>>,
    /// The static facts, read once at open.
    devices: Vec<Device>,
    /// The calls this driver answers, learnt on the way; behind a lock
    /// because a reader is shared by the sampler and the event readers.
    calls: Mutex<Calls>,
}

impl std::fmt::Debug for GpuReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuReader")
            .field("present", &self.is_present())
            .finish()
    }
}

/// Which of a versioned pair of calls this driver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Newer,
    Older,
}

#[derive(Debug, Clone, Copy)]
struct Calls {
    memory: Call,
    processes: Call,
}

impl Default for Calls {
    fn default() -> Self {
        Calls {
            memory: Call::Newer,
            processes: Call::Newer,
        }
    }
}

/// One device as a sample reports it: a whole GPU or a MIG instance.
#[derive(Debug, Clone)]
struct Device {
    /// NVML's index of the GPU (the parent's for a MIG instance).
    index: u32,
    uuid: String,
    name: String,
    pci_bus_id: String,
    parent_uuid: String,
    /// Where to read it; None when NVML refused it at open (`refused`).
    handle: Option<DeviceHandle>,
    /// NVML's error name where it refused this device at open.
    refused: String,
    /// From the first memory reading; None where that was refused (the
    /// Hello's placement then says 0: its total has no "unknown").
    total_bytes: Option<u64>,
}

impl Device {
    fn refused(index: u32, parent_uuid: &str, e: &NvmlError) -> Device {
        Device {
            index,
            uuid: String::new(),
            name: String::new(),
            pci_bus_id: String::new(),
            parent_uuid: parent_uuid.to_string(),
            handle: None,
            refused: error_name(e),
            total_bytes: None,
        }
    }
}

impl GpuReader {
    /// Initialises NVML and reads the devices' static facts; absent (never a
    /// panic) when the library is missing, fails to initialise, or sees no
    /// device.
    pub fn open() -> GpuReader {
        match guarded(|| nvml::SystemNvml::init().ok()) {
            Some(api) => GpuReader::with_api(Box::new(api)),
            None => GpuReader::absent(),
        }
    }

    /// A reader over any [`NvmlApi`] (a scripted one in tests); absent when
    /// it counts no device.
    pub fn with_api(api: Box<dyn NvmlApi>) -> GpuReader {
        let count = guarded(|| api.device_count().ok()).unwrap_or(0);
        if count == 0 {
            return GpuReader::absent();
        }
        let mut calls = Calls::default();
        let devices = guarded(|| Some(layout(api.as_ref(), &mut calls, count))).unwrap_or_default();
        GpuReader {
            api: Some(api),
            devices,
            calls: Mutex::new(calls),
        }
    }

    /// A reader that never reads anything (tests, hosts told to skip NVML).
    pub fn absent() -> GpuReader {
        GpuReader {
            api: None,
            devices: Vec::new(),
            calls: Mutex::default(),
        }
    }

    pub fn is_present(&self) -> bool {
        self.api.is_some()
    }

    /// Every device's memory and compute processes now: two NVML calls per
    /// device. A device NVML refuses is listed with `unreadable` (its
    /// figures unknown); a process whose usage NVML cannot see has none.
    /// Pids are not resolved here (`view` unspecified): the host reader
    /// knows which are ours.
    pub fn read(&self) -> Vec<pb::GpuDevice> {
        let Some(api) = &self.api else {
            return Vec::new();
        };
        let mut calls = lock(&self.calls);
        self.devices
            .iter()
            .map(|d| {
                guarded(|| Some(sample(api.as_ref(), &mut calls, d))).unwrap_or_else(|| panicked(d))
            })
            .collect()
    }

    /// The compute processes on the devices named by `uuids` (a MIG
    /// instance by its own): one NVML call per device and no memory
    /// reading, the cheap reading of a request boundary. Devices NVML
    /// refuses, or whose list it refuses now, give nothing. Pids are not
    /// resolved here (`view` unspecified).
    pub fn processes_on(&self, uuids: &[&str]) -> Vec<pb::GpuProcess> {
        let Some(api) = &self.api else {
            return Vec::new();
        };
        let mut calls = lock(&self.calls);
        let mut out = Vec::new();
        for d in self
            .devices
            .iter()
            .filter(|d| uuids.contains(&d.uuid.as_str()))
        {
            let Some(handle) = d.handle else { continue };
            let read = guarded(|| processes(api.as_ref(), &mut calls, handle).ok());
            out.extend(read.into_iter().flatten().map(|p| pb::GpuProcess {
                device: d.index as i32,
                pid: p.pid,
                used_bytes: p.used_bytes,
                device_uuid: d.uuid.clone(),
                ..Default::default()
            }));
        }
        out
    }

    /// The devices as a Hello's placement list, from the facts read at open
    /// (no NVML call). Devices NVML refused are left out: they have no
    /// identity to place.
    pub fn placements(&self) -> Vec<pb::GpuPlacement> {
        self.devices
            .iter()
            .filter(|d| d.refused.is_empty())
            .map(|d| pb::GpuPlacement {
                index: d.index as i32,
                uuid: d.uuid.clone(),
                name: d.name.clone(),
                total_bytes: d.total_bytes.unwrap_or(0),
                cap_bytes: 0,
                pci_bus_id: d.pci_bus_id.clone(),
                ordinal: None,
                parent_uuid: d.parent_uuid.clone(),
            })
            .collect()
    }
}

/// The static facts of `count` GPUs: a MIG-enabled GPU is its instances.
fn layout(api: &dyn NvmlApi, calls: &mut Calls, count: u32) -> Vec<Device> {
    let mut devices = Vec::new();
    for index in 0..count {
        let found = api
            .device_by_index(index)
            .and_then(|h| identify(api, index, "", h));
        let (gpu, handle) = match found {
            Ok(found) => found,
            Err(e) => {
                devices.push(Device::refused(index, "", &e));
                continue;
            }
        };
        let gpu = Device {
            pci_bus_id: api.pci_bus_id(handle).unwrap_or_default(),
            ..gpu
        };
        // NotSupported (a GPU without MIG) and other refusals read as "off":
        // the whole GPU is then read, and refuses there if it must.
        if api.mig_enabled(handle).unwrap_or(false) {
            let before = devices.len();
            mig_instances(api, calls, &gpu, handle, &mut devices);
            if devices.len() > before {
                continue;
            }
            // MIG on with no instance: nothing can run there, but the GPU
            // is still there (and still read).
        }
        devices.push(with_total(api, calls, gpu, handle));
    }
    devices
}

/// A MIG GPU's instances, each a device of its own; a refusal to list them
/// is the parent listed as unreadable, a refused slot an unreadable device.
fn mig_instances(
    api: &dyn NvmlApi,
    calls: &mut Calls,
    gpu: &Device,
    parent: DeviceHandle,
    out: &mut Vec<Device>,
) {
    let slots = match api.max_mig_devices(parent) {
        Ok(n) => n,
        Err(e) => {
            out.push(Device {
                handle: None,
                refused: error_name(&e),
                ..gpu.clone()
            });
            return;
        }
    };
    for slot in 0..slots {
        let found = api.mig_device_by_index(parent, slot);
        if matches!(found, Err(NvmlError::NotFound)) {
            continue;
        }
        // MIG instances share their GPU's PCI address.
        let instance = match found.and_then(|h| identify(api, gpu.index, &gpu.uuid, h)) {
            Ok((d, handle)) => with_total(api, calls, d, handle),
            Err(e) => Device::refused(gpu.index, &gpu.uuid, &e),
        };
        out.push(Device {
            pci_bus_id: gpu.pci_bus_id.clone(),
            ..instance
        });
    }
}

/// A device's uuid and name; NVML's refusal when the uuid cannot be had (a
/// device without identity cannot be joined to anything).
fn identify(
    api: &dyn NvmlApi,
    index: u32,
    parent_uuid: &str,
    handle: DeviceHandle,
) -> Result<(Device, DeviceHandle), NvmlError> {
    let uuid = api.uuid(handle)?;
    let device = Device {
        index,
        uuid,
        name: api.name(handle).unwrap_or_default(),
        pci_bus_id: String::new(),
        parent_uuid: parent_uuid.to_string(),
        handle: Some(handle),
        refused: String::new(),
        total_bytes: None,
    };
    Ok((device, handle))
}

/// The device to read, with its total (for the Hello's placements).
fn with_total(api: &dyn NvmlApi, calls: &mut Calls, d: Device, handle: DeviceHandle) -> Device {
    Device {
        total_bytes: memory(api, calls, handle).ok().map(|m| m.total),
        ..d
    }
}

/// One device now.
fn sample(api: &dyn NvmlApi, calls: &mut Calls, d: &Device) -> pb::GpuDevice {
    let mut out = pb::GpuDevice {
        index: d.index as i32,
        uuid: d.uuid.clone(),
        name: d.name.clone(),
        pci_bus_id: d.pci_bus_id.clone(),
        parent_uuid: d.parent_uuid.clone(),
        unreadable: d.refused.clone(),
        ..Default::default()
    };
    let Some(handle) = d.handle else {
        return out;
    };
    match memory(api, calls, handle) {
        Ok(m) => {
            out.total_bytes = m.total;
            out.free_bytes = m.free;
            out.used_bytes = m.used;
        }
        Err(e) => out.unreadable = error_name(&e),
    }
    // A refused process list is unknown, not empty: the device's figures
    // above stand on their own.
    match processes(api, calls, handle) {
        Ok(list) => {
            out.processes = list
                .into_iter()
                .map(|p| pb::GpuProcessUsage {
                    pid: p.pid,
                    used_bytes: p.used_bytes,
                    view: pb::PidView::Unspecified as i32,
                })
                .collect()
        }
        Err(e) => out.processes_unreadable = error_name(&e),
    }
    out
}

/// Memory info by the newest call the driver has: _v2, else the original.
fn memory(api: &dyn NvmlApi, calls: &mut Calls, d: DeviceHandle) -> Result<MemoryInfo, NvmlError> {
    if calls.memory == Call::Newer {
        match api.memory_info_v2(d) {
            Err(e) if function_missing(&e) => calls.memory = Call::Older,
            read => return read,
        }
    }
    api.memory_info_v1(d)
}

/// Compute processes by the newest call the driver has: _v3, else _v2.
fn processes(
    api: &dyn NvmlApi,
    calls: &mut Calls,
    d: DeviceHandle,
) -> Result<Vec<ProcessUsage>, NvmlError> {
    if calls.processes == Call::Newer {
        match api.compute_processes_v3(d) {
            Err(e) if function_missing(&e) => calls.processes = Call::Older,
            read => return read,
        }
    }
    api.compute_processes_v2(d)
}

/// The driver lacks the call: NVML says so, or the library lacks the symbol.
fn function_missing(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::FunctionNotFound | NvmlError::FailedToLoadSymbol(_)
    )
}

/// NVML's name for an error ("NotSupported", "GpuLost"), without the
/// wrapper's details.
pub fn error_name(e: &NvmlError) -> String {
    let debug = format!("{e:?}");
    let end = debug.find(['(', ' ', '{']).unwrap_or(debug.len());
    debug[..end].to_string()
}

/// A device whose reading panicked inside NVML: unreadable, not dropped.
fn panicked(d: &Device) -> pb::GpuDevice {
    pb::GpuDevice {
        index: d.index as i32,
        uuid: d.uuid.clone(),
        name: d.name.clone(),
        pci_bus_id: d.pci_bus_id.clone(),
        parent_uuid: d.parent_uuid.clone(),
        unreadable: "panic".into(),
        ..Default::default()
    }
}

/// Runs an NVML call, turning a panic into None.
fn guarded<T>(f: impl FnOnce() -> Option<T>) -> Option<T> {
    catch_unwind(AssertUnwindSafe(f)).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pci_address_is_written_as_nvml_writes_it() {
        assert_eq!(nvml_pci_bus_id(0, 0x3b, 0), "00000000:3B:00.0");
        assert_eq!(nvml_pci_bus_id(1, 0xc1, 0x1f), "00000001:C1:1F.0");
    }

    #[test]
    fn an_error_is_named_as_nvml_names_it() {
        assert_eq!(error_name(&NvmlError::NotSupported), "NotSupported");
        assert_eq!(error_name(&NvmlError::GpuLost), "GpuLost");
        assert_eq!(
            error_name(&NvmlError::FailedToLoadSymbol("no such symbol".into())),
            "FailedToLoadSymbol"
        );
        assert_eq!(
            error_name(&NvmlError::InsufficientSize(Some(4))),
            "InsufficientSize"
        );
        assert_eq!(
            error_name(&NvmlError::StringTooLong {
                max_len: 1,
                actual_len: 2
            }),
            "StringTooLong"
        );
    }
}
