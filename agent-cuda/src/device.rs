//! The device under the pool: where segments come from and go back to.
//!
//! Two implementations: [`crate::Cuda`] (the CUDA driver through cudarc) and
//! [`crate::Simulated`] (host memory with a capacity, so CI exercises the
//! pool exactly as a GPU would, out-of-memory errors included).
//!
//! A device call runs in the device's context, which CUDA keeps per thread:
//! the caller's current context (another device's, in a server that drives
//! several from one thread) is saved and restored around every call by a
//! [`ContextScope`].

use std::marker::PhantomData;

/// The CUDA driver's CUDA_ERROR_OUT_OF_MEMORY.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// Which device this is, for the Hello's GPU placement and the OOM text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceInfo {
    pub index: i32,
    pub name: String,
    /// "GPU-…" as NVML writes it: the key that joins this device's readings
    /// to NVML's; empty when unknown.
    pub uuid: String,
    /// "0000:3B:00.0" as NVML writes it; empty when unknown.
    pub pci_bus_id: String,
    pub total_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The driver (or the simulated capacity) refused the allocation.
    #[error("CUDA_ERROR_OUT_OF_MEMORY: out of memory allocating {requested} bytes ({free} of {total} bytes free)")]
    OutOfMemory {
        requested: u64,
        free: u64,
        total: u64,
    },
    /// No usable device: libcuda missing, no GPU, a driver that fails to initialise.
    #[error("no CUDA device: {0}")]
    Absent(String),
    /// Any other driver error, with its code.
    #[error("CUDA driver error {code}: {message}")]
    Driver { code: i32, message: String },
}

impl DeviceError {
    /// The driver's error code (2 for out of memory), 0 when there is none.
    pub fn driver_code(&self) -> i32 {
        match self {
            DeviceError::OutOfMemory { .. } => CUDA_ERROR_OUT_OF_MEMORY,
            DeviceError::Driver { code, .. } => *code,
            DeviceError::Absent(_) => 0,
        }
    }
}

/// Raw device memory: what a caching pool needs from a device. Calls may be
/// slow (a driver call); the pool never holds its lock across one.
///
/// `alloc`, `free` and `mem_get_info` run in this device's context and may
/// leave it current on the calling thread, as the driver's calls do; callers
/// that must leave the thread as they found it hold a [`ContextScope`].
pub trait DeviceMemory: Send + Sync + 'static {
    fn info(&self) -> &DeviceInfo;
    /// Makes this device's context current on the calling thread, above the
    /// caller's (cuCtxPushCurrent). Use [`ContextScope::enter`], which pops.
    fn push_context(&self) -> Result<(), DeviceError>;
    /// Makes the context that was current before the matching
    /// [`DeviceMemory::push_context`] current again (cuCtxPopCurrent). Runs
    /// in `Drop`: never panics; a failure is logged.
    fn pop_context(&self);
    /// A new allocation of exactly `bytes` (the pool rounds sizes first).
    fn alloc(&self, bytes: u64) -> Result<u64, DeviceError>;
    /// Returns an allocation made by [`DeviceMemory::alloc`] of `bytes` bytes.
    ///
    /// # Safety
    /// `ptr` must come from this device's `alloc(bytes)` and be freed once,
    /// with no work still using it.
    unsafe fn free(&self, ptr: u64, bytes: u64) -> Result<(), DeviceError>;
    /// `(free, total)` bytes as the driver sees them (cuMemGetInfo).
    fn mem_get_info(&self) -> Result<(u64, u64), DeviceError>;
}

/// This device's context, current on the calling thread while the scope
/// lives; the caller's context is current again when it drops, on every path
/// (errors and unwinding included). Scopes nest. Not `Send`: it must drop on
/// the thread whose context stack it pushed.
#[must_use = "the device's context stays current only while the scope lives"]
pub struct ContextScope<'a, D: DeviceMemory + ?Sized> {
    device: &'a D,
    _this_thread: PhantomData<*const ()>,
}

impl<'a, D: DeviceMemory + ?Sized> ContextScope<'a, D> {
    pub fn enter(device: &'a D) -> Result<Self, DeviceError> {
        device.push_context()?;
        Ok(ContextScope {
            device,
            _this_thread: PhantomData,
        })
    }
}

impl<D: DeviceMemory + ?Sized> Drop for ContextScope<'_, D> {
    fn drop(&mut self) {
        self.device.pop_context();
    }
}
