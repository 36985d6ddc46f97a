//! The CUDA driver through cudarc, linked as the application chose (loaded
//! at run time by default, so a binary built here runs where there is no
//! GPU and reports the device absent).

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use oomscope_agent_core::readers::gpu::nvml_pci_bus_id;

use crate::device::{ContextScope, DeviceError, DeviceInfo, DeviceMemory};

/// One CUDA device's primary context. Segments come from `cuMemAlloc`
/// (synchronous: a segment outlives any one stream's work, as in PyTorch).
/// Every call here leaves the calling thread's current context as it was.
pub struct Cuda {
    // Dropped by hand, inside a RestoreCurrent: cudarc binds it to release it.
    ctx: ManuallyDrop<Arc<CudaContext>>,
    info: DeviceInfo,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").field("info", &self.info).finish()
    }
}

/// The names cudarc loads libcuda by on Linux.
const LIBCUDA_NAMES: [&std::ffi::CStr; 2] = [c"libcuda.so.1", c"libcuda.so"];

/// True when libcuda can be loaded. cudarc panics on its first driver call
/// without it, so every path checks this first. Asked of the dynamic loader
/// here, not of cudarc: cudarc's own check exists only when it loads libcuda
/// at run time, and the application may link it instead (then it is loaded
/// already and this is true).
pub fn libcuda_present() -> bool {
    LIBCUDA_NAMES.iter().any(|name| {
        // SAFETY: dlopen/dlclose of a library by name; RTLD_LAZY resolves no
        // symbol and the handle is closed at once (libcuda stays loaded if
        // anything else holds it).
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if handle.is_null() {
                return false;
            }
            libc::dlclose(handle);
            true
        }
    })
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

/// The calling thread's current context when saved, made current again on
/// drop: for cudarc calls that bind a context themselves (creating and
/// releasing one), which have no push/pop form.
struct RestoreCurrent(Option<sys::CUcontext>);

impl RestoreCurrent {
    fn save() -> Result<RestoreCurrent, DeviceError> {
        guarded("cuCtxGetCurrent", || {
            result::ctx::get_current()
                .map(RestoreCurrent)
                .map_err(|e| driver_error(e, 0))
        })
    }
}

impl Drop for RestoreCurrent {
    fn drop(&mut self) {
        // Null pops what was bound onto an empty stack: the thread had none.
        let ctx = self.0.unwrap_or(std::ptr::null_mut());
        // SAFETY: `ctx` was current on this thread (or is null); a context
        // the caller had current is one the caller keeps alive.
        let set = std::panic::catch_unwind(|| unsafe { result::ctx::set_current(ctx) });
        if !matches!(set, Ok(Ok(()))) {
            tracing::warn!("oomscope: restoring the caller's CUDA context failed: {set:?}");
        }
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
            // cuCtxGetCurrent needs an initialised driver.
            result::init().map_err(|e| DeviceError::Absent(format!("{e:?}")))?;
            // CudaContext::new binds the new context to this thread.
            let _restore = RestoreCurrent::save()?;
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
                pci_bus_id: pci_bus_id(&ctx).unwrap_or_default(),
                total_bytes: ctx.total_mem().map_or(0, |t| t as u64),
            };
            Ok(Cuda {
                ctx: ManuallyDrop::new(ctx),
                info,
            })
        })
    }

    /// cudarc's context, for kernels and streams. cudarc's own calls bind
    /// it to the calling thread and leave it current.
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
            let _scope = ContextScope::enter(self)?;
            unsafe { result::memcpy_htod_sync(dst, src) }.map_err(|e| driver_error(e, 0))
        })
    }

    /// Copies device memory at `src` into `dst` (synchronously).
    ///
    /// # Safety
    /// `src` must point at `size_of_val(dst)` bytes of this device's memory.
    pub unsafe fn copy_to_host<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), DeviceError> {
        guarded("dtoh", || {
            let _scope = ContextScope::enter(self)?;
            unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(|e| driver_error(e, 0))
        })
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        // Releasing the primary context binds it first. When the caller has
        // this very context current it stays as the driver leaves it.
        let restore = RestoreCurrent::save()
            .ok()
            .filter(|r| r.0 != Some(self.ctx.cu_ctx()));
        // SAFETY: dropped once, here; `self.ctx` is not used after.
        unsafe { ManuallyDrop::drop(&mut self.ctx) };
        drop(restore);
    }
}

/// The device's PCI address in NVML's `busId` form, "00000000:3B:00.0".
fn pci_bus_id(ctx: &CudaContext) -> Result<String, DriverError> {
    use sys::CUdevice_attribute::*;
    let domain = ctx.attribute(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = ctx.attribute(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let device = ctx.attribute(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Ok(nvml_pci_bus_id(domain as u32, bus as u32, device as u32))
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

    fn push_context(&self) -> Result<(), DeviceError> {
        guarded("cuCtxPushCurrent", || {
            // An earlier asynchronous error of this context fails the call, as cudarc's bind does.
            self.ctx.check_err().map_err(|e| driver_error(e, 0))?;
            // SAFETY: our primary context, retained for as long as `self` lives.
            unsafe { sys::cuCtxPushCurrent_v2(self.ctx.cu_ctx()) }
                .result()
                .map_err(|e| driver_error(e, 0))
        })
    }

    fn pop_context(&self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes the popped context into `popped`, nothing else.
        let pop = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }.result()
        }));
        if !matches!(pop, Ok(Ok(()))) {
            tracing::warn!("oomscope: restoring the caller's CUDA context failed: {pop:?}");
        }
    }

    fn alloc(&self, bytes: u64) -> Result<u64, DeviceError> {
        guarded("alloc", || {
            let _scope = ContextScope::enter(self)?;
            // SAFETY: a plain cuMemAlloc in this device's context.
            unsafe { result::malloc_sync(bytes as usize) }.map_err(|e| driver_error(e, bytes))
        })
    }

    unsafe fn free(&self, ptr: u64, _bytes: u64) -> Result<(), DeviceError> {
        guarded("free", || {
            let _scope = ContextScope::enter(self)?;
            // SAFETY: the caller guarantees `ptr` came from `alloc` and is unused.
            unsafe { result::free_sync(ptr) }.map_err(|e| driver_error(e, 0))
        })
    }

    fn mem_get_info(&self) -> Result<(u64, u64), DeviceError> {
        guarded("mem_get_info", || {
            let _scope = ContextScope::enter(self)?;
            result::mem_get_info()
                .map(|(f, t)| (f as u64, t as u64))
                .map_err(|e| driver_error(e, 0))
        })
    }
}
