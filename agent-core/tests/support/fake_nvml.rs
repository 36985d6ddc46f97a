//! A scripted NVML for tests: devices, MIG slots, refusals and missing
//! driver calls as a test sets them, and a count of every call made. Test
//! support only; the agent never ships it.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use oomscope_agent_core::readers::gpu::{
    DeviceHandle, MemoryInfo, NvmlApi, NvmlError, ProcessUsage,
};

/// An NVML error as a test scripts it (NvmlError is not Clone).
pub type Refusal = fn() -> NvmlError;

/// One scripted device: a GPU or a MIG instance.
#[derive(Clone, Default)]
pub struct FakeDevice {
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub memory: MemoryInfo,
    pub processes: Vec<ProcessUsage>,
    /// MIG mode on, with these slots (None: an empty slot). None: MIG off.
    pub mig: Option<Vec<Option<FakeDevice>>>,
    /// Calls this device refuses (by method name), and how. "device"
    /// refuses the handle itself (the parent's `device_by_index` or
    /// `mig_device_by_index` for its slot).
    pub refuse: Vec<(&'static str, Refusal)>,
}

impl FakeDevice {
    pub fn gpu(uuid: &str, total: u64, used: u64) -> FakeDevice {
        FakeDevice {
            uuid: uuid.into(),
            name: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: format!("00000000:{:02X}:00.0", uuid.len()),
            memory: MemoryInfo {
                total,
                free: total - used,
                used,
            },
            ..Default::default()
        }
    }

    pub fn with_processes(mut self, processes: &[(u32, Option<u64>)]) -> FakeDevice {
        self.processes = processes
            .iter()
            .map(|&(pid, used_bytes)| ProcessUsage { pid, used_bytes })
            .collect();
        self
    }

    pub fn refusing(mut self, call: &'static str, how: Refusal) -> FakeDevice {
        self.refuse.push((call, how));
        self
    }

    fn refusal(&self, call: &str) -> Option<NvmlError> {
        self.refuse
            .iter()
            .find(|(c, _)| *c == call)
            .map(|(_, how)| how())
    }
}

struct Inner {
    /// Every device, GPUs first (handle = position), then MIG instances.
    devices: Vec<FakeDevice>,
    gpus: u32,
    /// (parent handle, slot) -> the instance's handle.
    slots: HashMap<(usize, u32), Option<usize>>,
    /// Driver calls this "driver" lacks, and how the library says so.
    missing: Vec<(&'static str, Refusal)>,
    calls: Mutex<HashMap<&'static str, usize>>,
    /// Memory changed by the test after the reader opened, by uuid.
    memory_now: Mutex<HashMap<String, MemoryInfo>>,
    /// Process lists changed by the test after the reader opened, by uuid.
    processes_now: Mutex<HashMap<String, Vec<ProcessUsage>>>,
    /// The thread each call was made on, in order.
    threads: Mutex<Vec<(&'static str, ThreadId)>>,
}

/// The scripted NVML; clones share the call counts.
#[derive(Clone)]
pub struct FakeNvml(Arc<Inner>);

impl FakeNvml {
    pub fn new(gpus: Vec<FakeDevice>) -> FakeNvml {
        FakeNvml::with_missing(gpus, &[])
    }

    /// A driver without the `missing` calls (e.g. "compute_processes_v3").
    pub fn with_missing(gpus: Vec<FakeDevice>, missing: &[(&'static str, Refusal)]) -> FakeNvml {
        let count = gpus.len() as u32;
        let mut devices = gpus;
        let mut slots = HashMap::new();
        for parent in 0..devices.len() {
            let Some(mig) = devices[parent].mig.clone() else {
                continue;
            };
            for (slot, instance) in mig.into_iter().enumerate() {
                let handle = instance.map(|d| {
                    devices.push(d);
                    devices.len() - 1
                });
                slots.insert((parent, slot as u32), handle);
            }
        }
        FakeNvml(Arc::new(Inner {
            devices,
            gpus: count,
            slots,
            missing: missing.to_vec(),
            calls: Mutex::default(),
            memory_now: Mutex::default(),
            processes_now: Mutex::default(),
            threads: Mutex::default(),
        }))
    }

    /// How many times `call` was made.
    pub fn calls(&self, call: &str) -> usize {
        self.0.calls.lock().unwrap().get(call).copied().unwrap_or(0)
    }

    /// Every call made, all kinds together.
    pub fn total_calls(&self) -> usize {
        self.0.calls.lock().unwrap().values().sum()
    }

    /// The device `uuid` now reports `memory`.
    pub fn set_memory(&self, uuid: &str, memory: MemoryInfo) {
        self.0
            .memory_now
            .lock()
            .unwrap()
            .insert(uuid.into(), memory);
    }

    /// The device `uuid` now lists `processes` (pid, used bytes).
    pub fn set_processes(&self, uuid: &str, processes: &[(u32, Option<u64>)]) {
        let list = processes
            .iter()
            .map(|&(pid, used_bytes)| ProcessUsage { pid, used_bytes })
            .collect();
        self.0
            .processes_now
            .lock()
            .unwrap()
            .insert(uuid.into(), list);
    }

    /// How many times `call` was made on `thread`.
    pub fn calls_on(&self, call: &str, thread: ThreadId) -> usize {
        let threads = self.0.threads.lock().unwrap();
        threads
            .iter()
            .filter(|(c, t)| *c == call && *t == thread)
            .count()
    }

    /// Counts the call, then answers: missing from the driver, refused by
    /// the device, or the device.
    fn call(&self, call: &'static str, handle: DeviceHandle) -> Result<&FakeDevice, NvmlError> {
        *self.0.calls.lock().unwrap().entry(call).or_default() += 1;
        let thread = std::thread::current().id();
        self.0.threads.lock().unwrap().push((call, thread));
        if let Some((_, how)) = self.0.missing.iter().find(|(c, _)| *c == call) {
            return Err(how());
        }
        let d = self.0.devices.get(handle.0).ok_or(NvmlError::InvalidArg)?;
        match d.refusal(call) {
            Some(e) => Err(e),
            None => Ok(d),
        }
    }

    fn handle(&self, index: usize) -> Result<DeviceHandle, NvmlError> {
        match self.0.devices[index].refusal("device") {
            Some(e) => Err(e),
            None => Ok(DeviceHandle(index)),
        }
    }
}

impl NvmlApi for FakeNvml {
    fn device_count(&self) -> Result<u32, NvmlError> {
        *self
            .0
            .calls
            .lock()
            .unwrap()
            .entry("device_count")
            .or_default() += 1;
        Ok(self.0.gpus)
    }

    fn device_by_index(&self, index: u32) -> Result<DeviceHandle, NvmlError> {
        *self
            .0
            .calls
            .lock()
            .unwrap()
            .entry("device_by_index")
            .or_default() += 1;
        if index >= self.0.gpus {
            return Err(NvmlError::InvalidArg);
        }
        self.handle(index as usize)
    }

    fn uuid(&self, device: DeviceHandle) -> Result<String, NvmlError> {
        self.call("uuid", device).map(|d| d.uuid.clone())
    }

    fn name(&self, device: DeviceHandle) -> Result<String, NvmlError> {
        self.call("name", device).map(|d| d.name.clone())
    }

    fn pci_bus_id(&self, device: DeviceHandle) -> Result<String, NvmlError> {
        self.call("pci_bus_id", device)
            .map(|d| d.pci_bus_id.clone())
    }

    fn mig_enabled(&self, device: DeviceHandle) -> Result<bool, NvmlError> {
        self.call("mig_enabled", device).map(|d| d.mig.is_some())
    }

    fn max_mig_devices(&self, device: DeviceHandle) -> Result<u32, NvmlError> {
        let d = self.call("max_mig_devices", device)?;
        d.mig
            .as_ref()
            .map(|slots| slots.len() as u32)
            .ok_or(NvmlError::NotSupported)
    }

    fn mig_device_by_index(
        &self,
        device: DeviceHandle,
        slot: u32,
    ) -> Result<DeviceHandle, NvmlError> {
        self.call("mig_device_by_index", device)?;
        match self.0.slots.get(&(device.0, slot)) {
            Some(Some(instance)) => self.handle(*instance),
            Some(None) => Err(NvmlError::NotFound),
            None => Err(NvmlError::InvalidArg),
        }
    }

    fn memory_info_v2(&self, device: DeviceHandle) -> Result<MemoryInfo, NvmlError> {
        let d = self.call("memory_info_v2", device)?;
        Ok(self.memory(d))
    }

    fn memory_info_v1(&self, device: DeviceHandle) -> Result<MemoryInfo, NvmlError> {
        let d = self.call("memory_info_v1", device)?;
        Ok(self.memory(d))
    }

    fn compute_processes_v3(&self, device: DeviceHandle) -> Result<Vec<ProcessUsage>, NvmlError> {
        self.call("compute_processes_v3", device)
            .map(|d| self.processes(d))
    }

    fn compute_processes_v2(&self, device: DeviceHandle) -> Result<Vec<ProcessUsage>, NvmlError> {
        self.call("compute_processes_v2", device)
            .map(|d| self.processes(d))
    }
}

impl FakeNvml {
    fn memory(&self, d: &FakeDevice) -> MemoryInfo {
        self.0
            .memory_now
            .lock()
            .unwrap()
            .get(&d.uuid)
            .copied()
            .unwrap_or(d.memory)
    }

    fn processes(&self, d: &FakeDevice) -> Vec<ProcessUsage> {
        let now = self.0.processes_now.lock().unwrap();
        now.get(&d.uuid).unwrap_or(&d.processes).clone()
    }
}
