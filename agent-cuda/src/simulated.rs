//! A device backed by host memory, with a capacity and the CUDA driver's
//! allocation granularity, failing with the same out-of-memory error, and
//! CUDA's per-thread current context.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::{DeviceError, DeviceInfo, DeviceMemory};

thread_local! {
    /// The calling thread's context stack, as the CUDA driver keeps one per
    /// thread: the ordinals of the devices whose contexts are on it, the
    /// current one last.
    static CONTEXT_STACK: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
}

/// The ordinal of the simulated device whose context is current on the
/// calling thread (cuCtxGetCurrent); None when none is.
pub fn current_context() -> Option<i32> {
    CONTEXT_STACK.with(|s| s.borrow().last().copied())
}

/// cuMemAlloc hands out (and counts) memory in 2 MiB pages on current GPUs;
/// the simulated capacity is charged the same way.
pub const SEGMENT_GRANULARITY: u64 = 2 << 20;
/// Host memory posing as a GPU of `capacity` bytes. Each allocation is its
/// own anonymous mapping: page-aligned (CUDA promises 256 bytes), zeroed
/// lazily by the OS, so untouched capacity costs no RAM. (`alloc_zeroed`
/// with page alignment memsets, and would touch every byte.)
///
/// Every device call makes this device's context current on the calling
/// thread and leaves it so, as the CUDA driver path does (cudarc binds the
/// context before each call): only a [`crate::device::ContextScope`] gives
/// the caller its own context back.
#[derive(Debug)]
pub struct Simulated {
    info: DeviceInfo,
    used: AtomicU64,
}

impl Simulated {
    /// Device 0 with `capacity` bytes.
    pub fn new(capacity: u64) -> Simulated {
        Simulated::with_info(DeviceInfo {
            index: 0,
            name: "oomscope simulated device".into(),
            uuid: "SIM-00000000".into(),
            pci_bus_id: String::new(),
            total_bytes: capacity,
        })
    }

    /// The device `info` describes (its ordinal is its context's identity),
    /// with `info.total_bytes` of capacity.
    pub fn with_info(info: DeviceInfo) -> Simulated {
        Simulated {
            info,
            used: AtomicU64::new(0),
        }
    }

    /// Makes this device's context current on the calling thread in place
    /// of the current one (cuCtxSetCurrent, cudarc's `bind_to_thread`).
    pub fn set_current(&self) {
        let ordinal = self.info.index;
        CONTEXT_STACK.with(|s| {
            let mut stack = s.borrow_mut();
            match stack.last_mut() {
                Some(top) => *top = ordinal,
                None => stack.push(ordinal),
            }
        });
    }

    /// Bytes charged against the capacity (whole 2 MiB pages).
    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    fn charge(bytes: u64) -> u64 {
        bytes.div_ceil(SEGMENT_GRANULARITY).max(1) * SEGMENT_GRANULARITY
    }
}

impl DeviceMemory for Simulated {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn push_context(&self) -> Result<(), DeviceError> {
        CONTEXT_STACK.with(|s| s.borrow_mut().push(self.info.index));
        Ok(())
    }

    fn pop_context(&self) {
        CONTEXT_STACK.with(|s| s.borrow_mut().pop());
    }

    fn alloc(&self, bytes: u64) -> Result<u64, DeviceError> {
        self.set_current();
        let charge = Self::charge(bytes);
        let total = self.info.total_bytes;
        let oom = |used: u64| DeviceError::OutOfMemory {
            requested: bytes,
            free: total.saturating_sub(used),
            total,
        };
        // Reserve the capacity first, so concurrent allocations never overshoot it.
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(charge).filter(|n| *n <= total)
            })
            .map_err(oom)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is involved.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                charge as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            self.used.fetch_sub(charge, Ordering::AcqRel);
            return Err(oom(self.used_bytes()));
        }
        Ok(ptr as u64)
    }

    unsafe fn free(&self, ptr: u64, bytes: u64) -> Result<(), DeviceError> {
        self.set_current();
        let charge = Self::charge(bytes);
        // SAFETY: the caller passes a pointer from `alloc(bytes)`, a mapping of `charge` bytes.
        if unsafe { libc::munmap(ptr as *mut libc::c_void, charge as usize) } != 0 {
            return Err(DeviceError::Driver {
                code: 1,
                message: format!("munmap: {}", std::io::Error::last_os_error()),
            });
        }
        self.used.fetch_sub(charge, Ordering::AcqRel);
        Ok(())
    }

    fn mem_get_info(&self) -> Result<(u64, u64), DeviceError> {
        self.set_current();
        let total = self.info.total_bytes;
        Ok((total.saturating_sub(self.used_bytes()), total))
    }
}
