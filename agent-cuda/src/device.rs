//! The device under the pool: where segments come from and go back to.
//!
//! Two implementations: [`crate::Cuda`] (the CUDA driver through cudarc) and
//! [`crate::Simulated`] (host memory with a capacity, so CI exercises the
//! pool exactly as a GPU would, out-of-memory errors included).

/// The CUDA driver's CUDA_ERROR_OUT_OF_MEMORY.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// Which device this is, for the Hello's GPU placement and the OOM text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceInfo {
    pub index: i32,
    pub name: String,
    pub uuid: String,
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
pub trait DeviceMemory: Send + Sync + 'static {
    fn info(&self) -> &DeviceInfo;
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
