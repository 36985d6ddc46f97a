//! The devices this process uses, and who they are.
//!
//! The agent reads every device on which the process holds memory or a
//! context, and no other: those where CUDA says the process has its context
//! (`_cuda_hasPrimaryContext`), and the device the OOM observer or an OOM's
//! text names. Where torch cannot say which devices have a context, the
//! devices whose allocator holds memory and the devices current on the
//! threads that call `start()`, `request()` and `phase()` (noted there: the
//! current device is per thread, and the sampler thread's is 0 whatever the
//! server uses). Free and total come from `mem_get_info` only where the
//! process has a context already; elsewhere they stay unknown (0). Each
//! reading carries the device's uuid, read once, by which the analysis joins
//! it with NVML's.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use oomscope_agent_core::{lock, now_ns, pb, torch};
use pyo3::prelude::*;

use crate::torchread::{DeviceIdentity, TorchCuda};

/// A thread's current device is noted at most this often at request starts
/// (it rarely changes, and asking torch costs about a microsecond of a
/// request path of a few).
pub const NOTE_SPACING_NS: i64 = 1_000_000_000;

/// The counters the `cudaMallocAsync` backend keeps; its others read 0
/// whatever happened, so they are left out of `raw` (unknown, not 0).
pub const ASYNC_COUNTERS: [&str; 6] = [
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "active_bytes.all.current",
    "active_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
];

/// The backend name `torch.cuda.get_allocator_backend()` gives for it.
pub const ASYNC_BACKEND: &str = "cudaMallocAsync";

thread_local! {
    /// When this thread's current device is next noted at a request start.
    static NEXT_NOTE_NS: Cell<i64> = const { Cell::new(0) };
}

/// Which devices a reading looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    /// Every device torch sees, asked whether the process uses it (the
    /// periodic sample, a phase edge).
    Scan,
    /// Those the latest scan found, and those noted since (request
    /// boundaries, up to 50 a second).
    Known,
}

/// How [`Devices::read_devices`] reads a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    /// The devices in use, each with its driver figures and identity.
    Used,
    /// Whether a device is in use, from its counters alone.
    Counters,
    /// The device named (an OOM's), in use or not.
    Named,
}

/// What the agent knows of the process's devices. Its locks are taken with
/// the GIL held and never across a call into Python.
#[derive(Default)]
pub struct Devices {
    /// Ordinals (bit d; below 64) seen current on the server's threads or
    /// read for an OOM: looked at by every reading from then on.
    noted: AtomicU64,
    /// The devices the latest scan found in use.
    in_use: Mutex<Vec<i32>>,
    identities: Mutex<BTreeMap<i32, DeviceIdentity>>,
    /// How many identities the Hello's placements carry.
    announced: AtomicUsize,
    backend: OnceLock<String>,
}

impl Devices {
    pub fn note(&self, device: i32) {
        if (0..64).contains(&device) {
            self.noted.fetch_or(1 << device, Ordering::Relaxed);
        }
    }

    /// Notes the calling thread's current device, when CUDA is up.
    pub fn note_current(&self, py: Python<'_>) {
        if let Some(d) = TorchCuda::get(py).and_then(|c| c.current_device()) {
            self.note(d);
        }
    }

    /// [`Self::note_current`] on the request path: at most every
    /// [`NOTE_SPACING_NS`] on each thread.
    pub fn note_current_spaced(&self, py: Python<'_>) {
        let now = now_ns();
        if now < NEXT_NOTE_NS.with(Cell::get) {
            return;
        }
        NEXT_NOTE_NS.with(|n| n.set(now.saturating_add(NOTE_SPACING_NS)));
        self.note_current(py);
    }

    /// One reading per device the process uses, by ordinal.
    pub fn read(&self, py: Python<'_>, which: Which) -> Vec<pb::AllocatorStats> {
        let Some(cuda) = TorchCuda::get(py) else {
            return Vec::new();
        };
        let (stats, used) = self.read_devices(&cuda, &self.candidates(&cuda, which), Read::Used);
        if which == Which::Scan {
            *lock(&self.in_use) = used;
        }
        stats
    }

    /// Whether the process uses any device, without reading one (no
    /// `mem_get_info`, no identity): what a held process is asked.
    pub fn any_in_use(&self, py: Python<'_>) -> bool {
        TorchCuda::get(py).is_some_and(|cuda| {
            let candidates = self.candidates(&cuda, Which::Scan);
            !self
                .read_devices(&cuda, &candidates, Read::Counters)
                .1
                .is_empty()
        })
    }

    /// A reading of `device` (the OOM's), which is read from now on.
    pub fn read_one(&self, py: Python<'_>, device: i32) -> Option<pb::AllocatorStats> {
        let cuda = TorchCuda::get(py)?;
        let stats = self.read_devices(&cuda, &[device], Read::Named).0.pop()?;
        self.note(device);
        Some(stats)
    }

    /// The device a reading with none named is of: the first in use.
    pub fn first_in_use(&self) -> Option<i32> {
        let noted = self.noted.load(Ordering::Relaxed);
        let first_noted = (noted != 0).then(|| noted.trailing_zeros() as i32);
        lock(&self.in_use).first().copied().or(first_noted)
    }

    /// `device`'s uuid ("" when CUDA is not up or torch does not say).
    pub fn uuid(&self, py: Python<'_>, device: i32) -> String {
        TorchCuda::get(py).map_or_else(String::new, |c| self.identity(&c, device).uuid)
    }

    /// Every identity read so far, by ordinal.
    pub fn identities(&self) -> Vec<(i32, DeviceIdentity)> {
        let ids = lock(&self.identities);
        self.announced.store(ids.len(), Ordering::Relaxed);
        ids.iter().map(|(d, i)| (*d, i.clone())).collect()
    }

    /// [`Self::identities`] when some were read since they were last taken.
    pub fn unannounced(&self) -> Option<Vec<(i32, DeviceIdentity)>> {
        let n = lock(&self.identities).len();
        (n != self.announced.load(Ordering::Relaxed)).then(|| self.identities())
    }

    fn candidates(&self, cuda: &TorchCuda<'_>, which: Which) -> Vec<i32> {
        let noted = self.noted.load(Ordering::Relaxed);
        let mut list: Vec<i32> = match which {
            Which::Scan => (0..cuda.device_count()).collect(),
            Which::Known => lock(&self.in_use).clone(),
        };
        list.extend((0..64).filter(|d| noted & (1 << d) != 0));
        list.sort_unstable();
        list.dedup();
        list
    }

    /// Reads those of `candidates` the process uses (see [`Read`]); returns
    /// the readings and the ordinals in use.
    ///
    /// A device is in use where CUDA says the process has its context there;
    /// where torch cannot say, where the allocator holds memory or the device
    /// was noted. A device without a context holds nothing (a thread whose
    /// current device is 0 by default has none there): it is not read.
    fn read_devices(
        &self,
        cuda: &TorchCuda<'_>,
        candidates: &[i32],
        how: Read,
    ) -> (Vec<pb::AllocatorStats>, Vec<i32>) {
        let noted = self.noted.load(Ordering::Relaxed);
        let asynchronous = how != Read::Counters && self.backend(cuda) == Some(ASYNC_BACKEND);
        let (mut stats, mut used) = (Vec::new(), Vec::new());
        for &d in candidates {
            let was_noted = (0..64).contains(&d) && noted & (1 << d) != 0;
            let context = cuda.has_context(d);
            if context == Some(false) && how != Read::Named {
                continue;
            }
            let Some(mut counters) = cuda.counters(d) else {
                continue;
            };
            let holds = holds_memory(&counters);
            if !(how == Read::Named || holds || context.unwrap_or(was_noted)) {
                continue;
            }
            used.push(d);
            if how == Read::Counters {
                continue;
            }
            // Only where the process has a context: elsewhere it would make one.
            let info = if context.unwrap_or(holds || was_noted) {
                cuda.mem_get_info(d)
            } else {
                None
            };
            if asynchronous {
                counters.retain(|k, _| ASYNC_COUNTERS.contains(&k.as_str()));
            }
            let mut s = torch::allocator_stats(d, &counters, info);
            let id = self.identity(cuda, d);
            (s.device_uuid, s.pci_bus_id) = (id.uuid, id.pci_bus_id);
            stats.push(s);
        }
        (stats, used)
    }

    /// `device`'s identity, read once (not cached when torch cannot give it).
    fn identity(&self, cuda: &TorchCuda<'_>, device: i32) -> DeviceIdentity {
        if let Some(id) = lock(&self.identities).get(&device) {
            return id.clone();
        }
        let Some(id) = cuda.identity(device) else {
            return DeviceIdentity::default();
        };
        lock(&self.identities).insert(device, id.clone());
        id
    }

    /// The allocator backend, read once CUDA is up (it cannot change then).
    fn backend(&self, cuda: &TorchCuda<'_>) -> Option<&str> {
        if self.backend.get().is_none() {
            if let Some(b) = cuda.backend() {
                let _ = self.backend.set(b);
            }
        }
        self.backend.get().map(String::as_str)
    }
}

/// Whether an allocator's counters show memory it holds or held: reserved
/// bytes now, at their peak or ever (a device it never allocated on reads
/// all zeros, on either backend).
pub fn holds_memory(counters: &BTreeMap<String, i64>) -> bool {
    [
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "reserved_bytes.all.allocated",
        "num_device_alloc",
    ]
    .iter()
    .any(|k| counters.get(*k).is_some_and(|v| *v > 0))
}

/// The Hello's placements with the devices the agent read: NVML's entry of
/// the same uuid gets the ordinal; a device NVML does not list (no NVML)
/// is added with index -1 (NVML's index unknown).
pub fn merge_placements(gpus: &mut Vec<pb::GpuPlacement>, ours: &[(i32, DeviceIdentity)]) {
    for (ordinal, id) in ours {
        let same = |g: &pb::GpuPlacement| {
            if id.uuid.is_empty() {
                g.index < 0 && g.ordinal == Some(*ordinal)
            } else {
                g.uuid == id.uuid
            }
        };
        match gpus.iter_mut().find(|g| same(g)) {
            Some(g) => {
                g.ordinal = Some(*ordinal);
                if g.pci_bus_id.is_empty() {
                    g.pci_bus_id.clone_from(&id.pci_bus_id);
                }
            }
            None => gpus.push(pb::GpuPlacement {
                index: -1,
                uuid: id.uuid.clone(),
                name: id.name.clone(),
                total_bytes: id.total_bytes,
                cap_bytes: 0,
                pci_bus_id: id.pci_bus_id.clone(),
                ordinal: Some(*ordinal),
                parent_uuid: String::new(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(uuid: &str) -> DeviceIdentity {
        DeviceIdentity {
            uuid: uuid.into(),
            pci_bus_id: "00000000:3B:00.0".into(),
            name: "NVIDIA H200".into(),
            total_bytes: 150,
        }
    }

    #[test]
    fn counters_of_a_device_never_allocated_on_show_no_memory() {
        let mut c: BTreeMap<String, i64> = [
            ("reserved_bytes.all.current", 0),
            ("max_split_size", -1),
            ("allocated_bytes.all.peak", 0),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
        assert!(!holds_memory(&c));
        // Freed since (empty_cache), the peak still says it held some.
        c.insert("reserved_bytes.all.peak".into(), 2 << 20);
        assert!(holds_memory(&c));
    }

    #[test]
    fn the_devices_read_join_nvmls_placements_by_uuid() {
        let nvml = |index, uuid: &str| pb::GpuPlacement {
            index,
            uuid: uuid.into(),
            name: "NVIDIA H200".into(),
            total_bytes: 100,
            ..Default::default()
        };
        // CUDA_VISIBLE_DEVICES=3,1: ordinal 0 is NVML's 3, ordinal 1 NVML's 1.
        let mut gpus = vec![nvml(0, "GPU-a"), nvml(1, "GPU-b"), nvml(3, "GPU-d")];
        merge_placements(&mut gpus, &[(0, id("GPU-d")), (1, id("GPU-b"))]);
        let ordinals: Vec<_> = gpus.iter().map(|g| (g.index, g.ordinal)).collect();
        assert_eq!(ordinals, [(0, None), (1, Some(1)), (3, Some(0))]);
        assert_eq!(gpus[2].pci_bus_id, "00000000:3B:00.0");
        assert_eq!(gpus[2].total_bytes, 100, "NVML's figures stay");

        // No NVML: the device is placed by the agent alone, index unknown;
        // a second merge adds nothing.
        let mut gpus = Vec::new();
        merge_placements(&mut gpus, &[(2, id("GPU-c"))]);
        merge_placements(&mut gpus, &[(2, id("GPU-c"))]);
        assert_eq!(gpus.len(), 1);
        assert_eq!(
            (
                gpus[0].index,
                gpus[0].ordinal,
                gpus[0].total_bytes,
                gpus[0].uuid.as_str()
            ),
            (-1, Some(2), 150, "GPU-c")
        );
    }
}
