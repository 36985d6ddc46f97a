//! The CUDA driver through cudarc (dynamically loaded, so a binary built
//! here runs where there is no GPU and reports the device absent).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use crate::device::{DeviceError, DeviceInfo, DeviceMemory};

/// One CUDA device's primary context. Segments come from `cuMemAlloc`
/// (synchronous: a segment outlives any one stream's work, as in PyTorch).
pub struct Cuda {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").field("info", &self.info).finish()
    }
}

/// True when libcuda can be loaded. cudarc panics on its first driver call
/// without it, so every path checks this first.
pub fn libcuda_present() -> bool {
    // SAFETY: only tries to dlopen the library names; no driver call.
    unsafe { sys::is_culib_present() }
}

fn driver_error(e: DriverError, requested: u64) -> DeviceError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        // The free/total at the moment of failure, when the driver answers.
        let (free, total) = result::mem_get_info().map_or((0, 0), |(f, t)| (f as u64, t as u64));
        return DeviceError::OutOfMemory {
            requested,
            free,
            total,
        };
    }
    DeviceError::Driver {
        code: e.0 as i32,
        message: format!("{e:?}"),
    }
}

/// cudarc panics in some paths where a driver is half-present; a panic
/// must never reach the caller (or cross FFI), so it becomes an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, DeviceError>) -> Result<T, DeviceError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(DeviceError::Absent(format!(
            "{what}: the CUDA driver panicked"
        )))
    })
}

impl Cuda {
    /// Opens device `ordinal`, or says why it cannot: `Absent` without
    /// libcuda or a GPU. Never panics.
    pub fn open(ordinal: usize) -> Result<Cuda, DeviceError> {
        if !libcuda_present() {
            return Err(DeviceError::Absent("libcuda.so not found".into()));
        }
        guarded("open", || {
            let ctx =
                CudaContext::new(ordinal).map_err(|e| DeviceError::Absent(format!("{e:?}")))?;
            let uuid = ctx
                .uuid()
                .map(|u| format_uuid(&u.bytes))
                .unwrap_or_default();
            let info = DeviceInfo {
                index: ordinal as i32,
                name: ctx.name().unwrap_or_default(),
                uuid,
                total_bytes: ctx.total_mem().map_or(0, |t| t as u64),
            };
            Ok(Cuda { ctx, info })
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.ctx.default_stream()
    }

    /// Copies `src` into device memory at `dst` (synchronously).
    ///
    /// # Safety
    /// `dst` must point at `size_of_val(src)` bytes of this device's memory.
    pub unsafe fn copy_to_device<T: Copy>(&self, dst: u64, src: &[T]) -> Result<(), DeviceError> {
        guarded("htod", || {
            self.ctx.bind_to_thread().map_err(|e| driver_error(e, 0))?;
            unsafe { result::memcpy_htod_sync(dst, src) }.map_err(|e| driver_error(e, 0))
        })
    }

    /// Copies device memory at `src` into `dst` (synchronously).
    ///
    /// # Safety
    /// `src` must point at `size_of_val(dst)` bytes of this device's memory.
    pub unsafe fn copy_to_host<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), DeviceError> {
        guarded("dtoh", || {
            self.ctx.bind_to_thread().map_err(|e| driver_error(e, 0))?;
            unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(|e| driver_error(e, 0))
        })
    }
}

/// The driver's 16 UUID bytes as nvidia-smi prints them: GPU-xxxxxxxx-xxxx-...
pub fn format_uuid(bytes: &[std::ffi::c_char; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

impl DeviceMemory for Cuda {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: u64) -> Result<u64, DeviceError> {
        guarded("alloc", || {
            self.ctx
                .bind_to_thread()
                .map_err(|e| driver_error(e, bytes))?;
            // SAFETY: a plain cuMemAlloc in a bound context.
            unsafe { result::malloc_sync(bytes as usize) }.map_err(|e| driver_error(e, bytes))
        })
    }

    unsafe fn free(&self, ptr: u64, _bytes: u64) -> Result<(), DeviceError> {
        guarded("free", || {
            self.ctx.bind_to_thread().map_err(|e| driver_error(e, 0))?;
            // SAFETY: the caller guarantees `ptr` came from `alloc` and is unused.
            unsafe { result::free_sync(ptr) }.map_err(|e| driver_error(e, 0))
        })
    }

    fn mem_get_info(&self) -> Result<(u64, u64), DeviceError> {
        guarded("mem_get_info", || {
            self.ctx.bind_to_thread().map_err(|e| driver_error(e, 0))?;
            result::mem_get_info()
                .map(|(f, t)| (f as u64, t as u64))
                .map_err(|e| driver_error(e, 0))
        })
    }
}
