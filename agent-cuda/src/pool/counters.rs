//! The pool's counters in PyTorch's `memory_stats()` vocabulary: each stat
//! has current, peak, allocated (sum of increases) and freed (sum of
//! decreases), for all pools, the small pool and the large pool.

use std::collections::HashMap;

use crate::device::DeviceInfo;
use crate::pb;

#[derive(Clone, Copy, Debug, Default)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

impl Stat {
    #[inline]
    fn add(&mut self, delta: i64) {
        self.current += delta;
        if delta >= 0 {
            self.allocated += delta;
        } else {
            self.freed -= delta;
        }
        self.peak = self.peak.max(self.current);
    }
}

/// `[all, small_pool, large_pool]`, like PyTorch's StatArray.
#[derive(Clone, Copy, Debug, Default)]
pub struct StatArray(pub [Stat; 3]);

impl StatArray {
    #[inline]
    pub fn add(&mut self, small: bool, delta: i64) {
        self.0[0].add(delta);
        self.0[if small { 1 } else { 2 }].add(delta);
    }
    pub fn all(&self) -> &Stat {
        &self.0[0]
    }
}

#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
}

fn u(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl Counters {
    /// As `torch.cuda.memory_stats()` would report them for `device`, plus
    /// the driver's `(free, total)` and the largest free cached block.
    pub fn to_pb(
        &self,
        device: &DeviceInfo,
        mem_get_info: Option<(u64, u64)>,
        largest_free_block: u64,
    ) -> pb::AllocatorStats {
        let mut stats = self.to_pb_named(device, mem_get_info);
        let raw = &mut stats.raw;
        let named: [(&str, &StatArray); 9] = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        for (name, arr) in named {
            for (pool, stat) in ["all", "small_pool", "large_pool"].iter().zip(arr.0.iter()) {
                raw.insert(format!("{name}.{pool}.current"), stat.current);
                raw.insert(format!("{name}.{pool}.peak"), stat.peak);
                raw.insert(format!("{name}.{pool}.allocated"), stat.allocated);
                raw.insert(format!("{name}.{pool}.freed"), stat.freed);
            }
        }
        raw.insert("num_alloc_retries".into(), self.num_alloc_retries as i64);
        raw.insert("num_ooms".into(), self.num_ooms as i64);
        raw.insert("num_device_alloc".into(), self.num_device_alloc as i64);
        raw.insert("num_device_free".into(), self.num_device_free as i64);
        raw.insert("largest_free_block_bytes".into(), largest_free_block as i64);
        stats
    }

    /// The named fields of [`Counters::to_pb`] without its `raw` dump of
    /// every counter: what a request end's point needs, at a fraction of
    /// the cost (the dump's ~110 formatted keys are most of it).
    pub fn to_pb_named(
        &self,
        device: &DeviceInfo,
        mem_get_info: Option<(u64, u64)>,
    ) -> pb::AllocatorStats {
        let (driver_free_bytes, driver_total_bytes) = mem_get_info.unwrap_or((0, 0));
        pb::AllocatorStats {
            device: device.index,
            allocated_bytes: u(self.allocated_bytes.all().current),
            allocated_peak_bytes: u(self.allocated_bytes.all().peak),
            reserved_bytes: u(self.reserved_bytes.all().current),
            reserved_peak_bytes: u(self.reserved_bytes.all().peak),
            active_bytes: u(self.active_bytes.all().current),
            active_peak_bytes: u(self.active_bytes.all().peak),
            inactive_split_bytes: u(self.inactive_split_bytes.all().current),
            inactive_split_peak_bytes: u(self.inactive_split_bytes.all().peak),
            requested_bytes: u(self.requested_bytes.all().current),
            requested_peak_bytes: u(self.requested_bytes.all().peak),
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            segments: u(self.segment.all().current),
            segments_peak: u(self.segment.all().peak),
            allocations: u(self.allocation.all().current),
            inactive_split_blocks: u(self.inactive_split.all().current),
            driver_free_bytes,
            driver_total_bytes,
            raw: HashMap::new(),
            raw_changes: None,
            device_uuid: device.uuid.clone(),
            pci_bus_id: device.pci_bus_id.clone(),
        }
    }
}
