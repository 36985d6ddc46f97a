//! `TrackingPool`: a caching allocator in PyTorch's mould over any
//! [`DeviceMemory`], that knows what every live block is for.
//!
//! Mechanics as in c10's CUDACachingAllocator: sizes round to 512 bytes;
//! requests up to 1 MiB come from 2 MiB small-pool segments, larger ones
//! from 20 MiB segments (or a segment of their own from 10 MiB up); a
//! cached block is split when the rest is worth keeping and merged with
//! free neighbours when freed; free lists are per stream; on a device
//! out-of-memory every fully free cached segment is released and the
//! allocation retried once.
//!
//! Locking: one mutex per pool guards the bookkeeping and is never held
//! across a device call or any I/O. A cache hit takes it once.
//!
//! Contexts: every call that reaches the device holds a [`ContextScope`], so
//! the calling thread's current context (another device's, in a server that
//! drives several) is the same after the call as before. A cache hit makes
//! no device call.

mod counters;
mod sizes;
mod snapshot;
mod state;

use std::marker::PhantomData;
use std::panic::Location;
use std::sync::{Arc, Mutex, OnceLock};

use oomscope_agent_core::lock;

pub use sizes::{
    round_size, segment_size, LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE,
    SMALL_BUFFER, SMALL_SIZE,
};
pub use snapshot::site_name;

use crate::device::{ContextScope, DeviceError, DeviceMemory, CUDA_ERROR_OUT_OF_MEMORY};
use crate::pb;
use crate::tag::Tag;
use state::{Owner, State};

/// A stream's identity for the per-stream free lists (a `CUstream` as an
/// integer, or any number the caller uses consistently). Blocks freed on one
/// stream are only reused on that stream.
pub type StreamId = u64;
/// The stream of [`Pool::alloc`].
pub const DEFAULT_STREAM: StreamId = 0;

/// The allocator backend named in the Hello and in snapshots.
pub const BACKEND: &str = oomscope_proto::TRACKING_POOL_BACKEND;

/// What the pool calls with the OOM event before returning the error
/// (the agent's reporter, a test's recorder).
pub type OomHook = Box<dyn Fn(&pb::Oom) + Send + Sync>;

/// The pool that records tags, sites and PyTorch's counters.
pub type TrackingPool<D> = Pool<D, true>;
/// The same allocator without tags, sites or counters: the baseline that
/// the benchmarks compare tracking against.
pub type UntrackedPool<D> = Pool<D, false>;

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The device is full even after releasing the cache; the event (with
    /// stats and snapshot summary) was handed to the OOM hook first.
    #[error("{}", .0.message)]
    OutOfMemory(Box<OomError>),
    /// A driver failure other than out-of-memory.
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("allocation of {len} elements of {elem} bytes overflows")]
    TooLarge { len: usize, elem: usize },
}

/// An out-of-memory with the evidence captured at the moment it happened.
#[derive(Debug, Clone)]
pub struct OomError {
    pub requested_bytes: u64,
    /// PyTorch's wording: "CUDA out of memory. Tried to allocate ...".
    pub message: String,
    pub event: pb::Oom,
}

struct Inner<D: DeviceMemory, const TRACK: bool> {
    device: D,
    state: Mutex<State>,
    oom_hook: OnceLock<OomHook>,
    last_oom: Mutex<Option<pb::Oom>>,
}

/// A caching pool over device `D`. Cheap to clone (one `Arc`).
pub struct Pool<D: DeviceMemory, const TRACK: bool> {
    inner: Arc<Inner<D, TRACK>>,
}

impl<D: DeviceMemory, const TRACK: bool> Clone for Pool<D, TRACK> {
    fn clone(&self) -> Self {
        Pool {
            inner: self.inner.clone(),
        }
    }
}

/// PyTorch's format_size: "96.00 MiB".
pub fn format_size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b < KIB {
        format!("{bytes} bytes")
    } else if b < KIB * KIB {
        format!("{:.2} KiB", b / KIB)
    } else if b < KIB * KIB * KIB {
        format!("{:.2} MiB", b / KIB / KIB)
    } else {
        format!("{:.2} GiB", b / KIB / KIB / KIB)
    }
}

/// One block as the invariant checks see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub addr: u64,
    pub size: u64,
    pub requested: u64,
    pub allocated: bool,
    pub segment_addr: u64,
    pub segment_size: u64,
    pub stream: StreamId,
}

impl<D: DeviceMemory, const TRACK: bool> Pool<D, TRACK> {
    pub fn new(device: D) -> Self {
        Pool {
            inner: Arc::new(Inner {
                device,
                state: Mutex::new(State::default()),
                oom_hook: OnceLock::new(),
                last_oom: Mutex::new(None),
            }),
        }
    }

    pub fn device(&self) -> &D {
        &self.inner.device
    }

    /// Installs the OOM hook; false when one is already set.
    pub fn set_oom_hook(&self, hook: OomHook) -> bool {
        self.inner.oom_hook.set(hook).is_ok()
    }

    /// The most recent OOM event, kept here whether or not a hook took it.
    pub fn last_oom(&self) -> Option<pb::Oom> {
        lock(&self.inner.last_oom).clone()
    }

    /// `len` elements of `T` on the default stream, owned by `tag`; the
    /// caller's source line is the allocation site.
    #[track_caller]
    pub fn alloc<T>(&self, len: usize, tag: Tag) -> Result<TrackedSlice<T>, PoolError> {
        self.alloc_at(DEFAULT_STREAM, len, tag, Location::caller())
    }

    /// [`Pool::alloc`] on a given stream.
    #[track_caller]
    pub fn alloc_on<T>(
        &self,
        stream: StreamId,
        len: usize,
        tag: Tag,
    ) -> Result<TrackedSlice<T>, PoolError> {
        self.alloc_at(stream, len, tag, Location::caller())
    }

    /// [`Pool::alloc`] with an explicit site (for wrappers that pass their
    /// own caller's location on).
    pub fn alloc_at<T>(
        &self,
        stream: StreamId,
        len: usize,
        tag: Tag,
        site: &'static Location<'static>,
    ) -> Result<TrackedSlice<T>, PoolError> {
        let elem = std::mem::size_of::<T>().max(1);
        let bytes = len
            .checked_mul(elem)
            .ok_or(PoolError::TooLarge { len, elem })? as u64;
        let (block, ptr) = self.alloc_bytes(stream, bytes, tag, site)?;
        let owner: Arc<dyn BlockOwner> = self.inner.clone();
        Ok(TrackedSlice {
            ptr,
            len,
            bytes,
            block,
            owner,
            _elem: PhantomData,
        })
    }

    fn owner(tag: Tag, site: &'static Location<'static>) -> Owner {
        if TRACK {
            Owner {
                tag: Some(tag),
                site: Some(site),
            }
        } else {
            Owner {
                tag: None,
                site: None,
            }
        }
    }

    fn alloc_bytes(
        &self,
        stream: StreamId,
        bytes: u64,
        tag: Tag,
        site: &'static Location<'static>,
    ) -> Result<(u32, u64), PoolError> {
        let size = round_size(bytes);
        {
            let mut st = lock(&self.inner.state);
            if let Some(id) = st.take_cached(stream, size, TRACK) {
                let ptr = st.allocate(id, size, bytes, Self::owner(tag, site), TRACK);
                return Ok((id, ptr));
            }
        }
        let seg = segment_size(size);
        let _scope = ContextScope::enter(&self.inner.device)?;
        let addr = match self.inner.device.alloc(seg) {
            Ok(addr) => addr,
            Err(DeviceError::OutOfMemory { .. }) => {
                lock(&self.inner.state).counters.num_alloc_retries += 1;
                self.release_cached();
                match self.inner.device.alloc(seg) {
                    Ok(addr) => addr,
                    Err(DeviceError::OutOfMemory { free, total, .. }) => {
                        return Err(self.out_of_memory(size, free, total));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        };
        let mut st = lock(&self.inner.state);
        let id = st.add_segment(addr, seg, stream, TRACK);
        let ptr = st.allocate(id, size, bytes, Self::owner(tag, site), TRACK);
        Ok((id, ptr))
    }

    /// Gives every fully free cached segment back to the device; returns
    /// the bytes released.
    fn release_cached(&self) -> u64 {
        // Before draining: segments stay cached when the device is unreachable.
        let _scope = match ContextScope::enter(&self.inner.device) {
            Ok(scope) => scope,
            Err(e) => {
                tracing::warn!(error = %e, "oomscope pool: cannot release cached segments");
                return 0;
            }
        };
        let drained = lock(&self.inner.state).drain_free_segments(TRACK);
        let mut released = 0;
        let mut freed = 0;
        for (addr, size) in drained {
            // SAFETY: the segment came from this device's alloc(size) and
            // has no allocated block left.
            match unsafe { self.inner.device.free(addr, size) } {
                Ok(()) => {
                    released += size;
                    freed += 1;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "oomscope pool: releasing a cached segment failed")
                }
            }
        }
        lock(&self.inner.state).counters.num_device_free += freed;
        released
    }

    /// `torch.cuda.empty_cache()`: releases the cached segments and says
    /// how much was reserved before and after.
    pub fn empty_cache(&self) -> pb::CacheRelease {
        let before = self.reserved_bytes();
        self.release_cached();
        pb::CacheRelease {
            device: self.inner.device.info().index,
            reserved_before_bytes: before,
            reserved_after_bytes: self.reserved_bytes(),
            caller: "empty_cache".into(),
        }
    }

    fn reserved_bytes(&self) -> u64 {
        let st = lock(&self.inner.state);
        st.segments.iter().map(|(_, s)| s.size).sum()
    }

    /// The pool's configuration, as the Hello and snapshots carry it.
    pub fn settings(&self) -> pb::AllocatorSettings {
        let mut other = std::collections::HashMap::new();
        other.insert("tracking".into(), TRACK.to_string());
        other.insert("small_segment_bytes".into(), SMALL_BUFFER.to_string());
        other.insert("large_segment_bytes".into(), LARGE_BUFFER.to_string());
        pb::AllocatorSettings {
            backend: BACKEND.into(),
            max_split_size_bytes: -1,
            other,
            ..Default::default()
        }
    }

    /// The counters in PyTorch's vocabulary, with the driver's free/total
    /// (read outside the lock).
    pub fn stats(&self) -> pb::AllocatorStats {
        // `_scope` (not `_`) keeps the context current through the call.
        let driver = ContextScope::enter(&self.inner.device)
            .and_then(|_scope| self.inner.device.mem_get_info())
            .ok();
        let st = lock(&self.inner.state);
        st.counters
            .to_pb(self.inner.device.info(), driver, st.largest_free_block())
    }

    /// [`Pool::stats`] without its `raw` map (every counter by PyTorch's
    /// name): the named fields only, for a point per request end.
    pub fn stats_named(&self) -> pb::AllocatorStats {
        let driver = ContextScope::enter(&self.inner.device)
            .and_then(|_scope| self.inner.device.mem_get_info())
            .ok();
        let st = lock(&self.inner.state);
        st.counters.to_pb_named(self.inner.device.info(), driver)
    }

    pub fn snapshot(&self) -> pb::SnapshotSummary {
        let settings = self.settings();
        let st = lock(&self.inner.state);
        snapshot::summarize(&st, self.inner.device.info().index, settings)
    }

    /// Every block, in no particular order (for checks and tests).
    pub fn blocks(&self) -> Vec<BlockInfo> {
        let st = lock(&self.inner.state);
        st.blocks
            .iter()
            .map(|(_, b)| {
                let seg = st.segments.at(b.segment);
                BlockInfo {
                    addr: b.addr,
                    size: b.size,
                    requested: b.requested,
                    allocated: b.allocated,
                    segment_addr: seg.addr,
                    segment_size: seg.size,
                    stream: seg.stream,
                }
            })
            .collect()
    }

    /// Checks the bookkeeping: blocks tile their segments without overlap,
    /// no two free neighbours are left unmerged, the free lists hold exactly
    /// the free blocks, and (when tracking) every counter equals the sum over
    /// blocks. Returns the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = lock(&self.inner.state);
        let mut free_blocks = std::collections::BTreeSet::new();
        let (mut allocated, mut requested, mut reserved, mut count) = (0u64, 0u64, 0u64, 0u64);
        let (mut split_bytes, mut split_n) = (0u64, 0u64);
        for (seg_id, seg) in st.segments.iter() {
            reserved += seg.size;
            let mut at = seg.addr;
            let mut prev: Option<(u32, bool)> = None;
            for (id, b) in st.segment_blocks(seg_id) {
                if b.addr != at {
                    return Err(format!(
                        "block {id} at {:#x}, expected {at:#x} (gap or overlap)",
                        b.addr
                    ));
                }
                if b.segment != seg_id {
                    return Err(format!(
                        "block {id} names segment {} not {seg_id}",
                        b.segment
                    ));
                }
                if let Some((p, p_alloc)) = prev {
                    if !p_alloc && !b.allocated {
                        return Err(format!(
                            "free blocks {p} and {id} are adjacent but not merged"
                        ));
                    }
                }
                at += b.size;
                if b.allocated {
                    allocated += b.size;
                    requested += b.requested;
                    count += 1;
                } else {
                    free_blocks.insert(id);
                    if b.prev != state::NIL || b.next != state::NIL {
                        split_bytes += b.size;
                        split_n += 1;
                    }
                }
                prev = Some((id, b.allocated));
            }
            if at != seg.addr + seg.size {
                return Err(format!(
                    "segment {seg_id} blocks end at {at:#x}, not {:#x}",
                    seg.addr + seg.size
                ));
            }
        }
        let listed: std::collections::BTreeSet<u32> =
            st.free_listed().iter().map(|f| f.4).collect();
        if listed != free_blocks {
            return Err(format!(
                "free lists {listed:?} != free blocks {free_blocks:?}"
            ));
        }
        for (stream, small, size, addr, id) in st.free_listed() {
            let b = st
                .blocks
                .get(id)
                .ok_or(format!("listed block {id} is gone"))?;
            let seg = st.segments.at(b.segment);
            if b.size != size || b.addr != addr || seg.stream != stream || seg.small != small {
                return Err(format!("free list entry of block {id} is stale"));
            }
        }
        if TRACK {
            let c = &st.counters;
            let checks = [
                (
                    "allocated_bytes",
                    c.allocated_bytes.all().current,
                    allocated,
                ),
                ("active_bytes", c.active_bytes.all().current, allocated),
                (
                    "requested_bytes",
                    c.requested_bytes.all().current,
                    requested,
                ),
                ("reserved_bytes", c.reserved_bytes.all().current, reserved),
                ("allocation", c.allocation.all().current, count),
                (
                    "segment",
                    c.segment.all().current,
                    st.segments.iter().count() as u64,
                ),
                (
                    "inactive_split_bytes",
                    c.inactive_split_bytes.all().current,
                    split_bytes,
                ),
                ("inactive_split", c.inactive_split.all().current, split_n),
            ];
            for (name, counter, sum) in checks {
                if counter != sum as i64 {
                    return Err(format!("{name} counter {counter} != sum over blocks {sum}"));
                }
            }
        }
        Ok(())
    }

    /// Counts the OOM, captures the evidence, hands it to the hook, and
    /// returns the typed error. Runs without the pool lock held.
    fn out_of_memory(&self, size: u64, free: u64, total: u64) -> PoolError {
        lock(&self.inner.state).counters.num_ooms += 1;
        let stats = self.stats();
        let snapshot = self.snapshot();
        let device = self.inner.device.info().index;
        let unallocated = stats.reserved_bytes.saturating_sub(stats.allocated_bytes);
        let message = format!(
            "CUDA out of memory. Tried to allocate {}. GPU {device} has a total capacity of {} of which {} is free. \
             Of the allocated memory {} is allocated by {BACKEND}, and {} is reserved by {BACKEND} but unallocated. \
             The largest free cached block is {}.",
            format_size(size),
            format_size(total),
            format_size(free),
            format_size(stats.allocated_bytes),
            format_size(unallocated),
            format_size(snapshot.largest_free_block_bytes),
        );
        let event = pb::Oom {
            device,
            requested_bytes: size,
            observer: Some(pb::OomObserver {
                device: i64::from(device),
                alloc: size as i64,
                device_allocated: total as i64,
                device_free: free as i64,
            }),
            error_type: "OutOfMemoryError".into(),
            error_text: message.clone(),
            stats: Some(stats),
            snapshot: Some(snapshot),
            context: None,
            driver_error: CUDA_ERROR_OUT_OF_MEMORY,
            device_uuid: self.inner.device.info().uuid.clone(),
        };
        *lock(&self.inner.last_oom) = Some(event.clone());
        if let Some(hook) = self.inner.oom_hook.get() {
            // A hook that panics must not turn an OOM into a crash.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&event))).is_err() {
                tracing::error!("oomscope pool: the OOM hook panicked");
            }
        }
        PoolError::OutOfMemory(Box::new(OomError {
            requested_bytes: size,
            message,
            event,
        }))
    }
}

/// What a [`TrackedSlice`] frees itself through (the pool, type-erased).
trait BlockOwner: Send + Sync {
    fn release(&self, block: u32);
}

impl<D: DeviceMemory, const TRACK: bool> BlockOwner for Inner<D, TRACK> {
    fn release(&self, block: u32) {
        lock(&self.state).release(block, TRACK);
    }
}

/// `len` elements of `T` in device memory from the pool; goes back to the
/// pool's cache (not the driver) when dropped.
pub struct TrackedSlice<T> {
    ptr: u64,
    len: usize,
    bytes: u64,
    block: u32,
    owner: Arc<dyn BlockOwner>,
    _elem: PhantomData<*const T>,
}

// SAFETY: the slice is a device address plus a handle to a thread-safe pool.
unsafe impl<T> Send for TrackedSlice<T> {}
unsafe impl<T> Sync for TrackedSlice<T> {}

impl<T> TrackedSlice<T> {
    /// The device address (a `CUdeviceptr` on a CUDA device).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes asked for (`len * size_of::<T>()`), before rounding.
    pub fn num_bytes(&self) -> u64 {
        self.bytes
    }
}

impl<T> std::fmt::Debug for TrackedSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TrackedSlice({:#x}, {} elements)", self.ptr, self.len)
    }
}

impl<T> Drop for TrackedSlice<T> {
    fn drop(&mut self) {
        self.owner.release(self.block);
    }
}

// A TrackedSlice is a kernel argument like a CudaSlice: the kernel receives
// its device pointer. Ordering is the caller's to manage (launch and free on
// the same stream), as with any raw pointer.
unsafe impl<'a, 'b: 'a, T> cudarc::driver::PushKernelArg<&'b TrackedSlice<T>>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b TrackedSlice<T>) -> &mut Self {
        <Self as cudarc::driver::PushKernelArg<&'b u64>>::arg(self, &arg.ptr)
    }
}

unsafe impl<'a, 'b: 'a, T> cudarc::driver::PushKernelArg<&'b mut TrackedSlice<T>>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut TrackedSlice<T>) -> &mut Self {
        <Self as cudarc::driver::PushKernelArg<&'b u64>>::arg(self, &arg.ptr)
    }
}
