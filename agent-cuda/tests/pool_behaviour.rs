//! The pool's mechanics and evidence on the simulated device.

use oomscope_agent_cuda::pool::{round_size, LARGE_BUFFER, SMALL_BUFFER};
use oomscope_agent_cuda::{
    libcuda_present, Cuda, DeviceError, PoolError, Simulated, Tag, TrackingPool,
};

const MIB: u64 = 1 << 20;

#[test]
fn cached_block_is_reused_and_split_like_pytorch() {
    let pool = TrackingPool::new(Simulated::new(64 * MIB));
    let a = pool.alloc::<f32>(1000, Tag::Activation).unwrap(); // 4000 B -> 4096, small pool
    assert_eq!(round_size(4000), 4096);
    let s = pool.stats();
    assert_eq!(
        (s.allocated_bytes, s.requested_bytes, s.reserved_bytes),
        (4096, 4000, SMALL_BUFFER)
    );
    assert_eq!(
        s.inactive_split_bytes,
        SMALL_BUFFER - 4096,
        "the rest of the segment is a split free block"
    );
    let ptr = a.device_ptr();
    drop(a);
    let b = pool.alloc::<u8>(4096, Tag::Workspace).unwrap();
    assert_eq!(
        b.device_ptr(),
        ptr,
        "a freed block is served from the cache"
    );
    let s = pool.stats();
    assert_eq!((s.num_device_alloc, s.segments), (1, 1));
    // A 3 MiB request comes from a 20 MiB large-pool segment.
    let c = pool.alloc::<u8>(3 << 20, Tag::KvCache).unwrap();
    let s = pool.stats();
    assert_eq!(s.reserved_bytes, SMALL_BUFFER + LARGE_BUFFER);
    assert_eq!(
        s.raw["reserved_bytes.large_pool.current"],
        LARGE_BUFFER as i64
    );
    drop((b, c));
    assert_eq!(
        pool.stats().inactive_split_bytes,
        0,
        "freed blocks merged back into whole segments"
    );
    pool.check_invariants().unwrap();
}

#[test]
fn oom_releases_cache_then_retries() {
    let pool = TrackingPool::new(Simulated::new(40 * MIB));
    let a = pool.alloc::<u8>(30 << 20, Tag::Weights).unwrap();
    drop(a); // cached: 30 MiB reserved, nothing allocated
    let b = pool.alloc::<u8>(36 << 20, Tag::Weights).unwrap();
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.reserved_bytes, 36 << 20);
    drop(b);
}

/// Interleaved keep/free, then a larger request: the device is full of
/// segments whose free space is in pieces too small for it.
#[test]
fn fragmentation_oom_has_the_evidence() {
    let pool = TrackingPool::new(Simulated::new(200 * MIB));
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    assert!(pool.set_oom_hook(Box::new(move |oom| {
        let _ = seen_tx.send(oom.clone());
    })));
    let mut all = Vec::new();
    for _ in 0..30 {
        match pool.alloc::<u8>(6 << 20, Tag::Activation) {
            Ok(s) => all.push(s),
            Err(_) => break,
        }
    }
    let kept: Vec<_> = all
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 2 == 0)
        .map(|(_, s)| s)
        .collect();
    let request = 16u64 << 20;
    let err = pool
        .alloc::<u8>(request as usize, Tag::Workspace)
        .unwrap_err();
    let PoolError::OutOfMemory(oom) = err else {
        panic!("expected an OOM, got {err}")
    };
    let stats = oom.event.stats.clone().unwrap();
    let snap = oom.event.snapshot.clone().unwrap();
    assert_eq!(oom.requested_bytes, request);
    assert!(
        stats.reserved_bytes - stats.allocated_bytes >= request,
        "{stats:?}"
    );
    assert!(snap.largest_free_block_bytes < request);
    // 20 MiB segments hold three 6 MiB blocks and a 2 MiB tail; in every
    // other segment a freed block merges with the tail: 8 MiB holes.
    assert_eq!(snap.largest_free_block_bytes, 8 << 20);
    assert_eq!(stats.num_ooms, 1);
    assert_eq!(stats.allocated_bytes, kept.len() as u64 * (6 << 20));
    assert!(stats.inactive_split_bytes >= request);
    assert!(
        oom.message
            .starts_with("CUDA out of memory. Tried to allocate 16.00 MiB."),
        "{}",
        oom.message
    );
    assert_eq!(
        oomscope_agent_core::torch::tried_to_allocate(&oom.message),
        Some(request)
    );
    assert_eq!(snap.live_by_tag[0].site, "activation");
    assert_eq!(snap.live_by_tag[0].bytes, stats.allocated_bytes);
    assert!(
        snap.live_by_site[0].site.contains("pool_behaviour.rs"),
        "{:?}",
        snap.live_by_site
    );
    let active = snap
        .blocks
        .iter()
        .find(|b| b.state == "active_allocated")
        .unwrap();
    assert_eq!(active.count, kept.len() as u64);
    assert!(!snap.segments_free.is_empty());
    let hooked = seen_rx
        .try_recv()
        .expect("the hook saw the OOM before the error returned");
    assert_eq!(hooked.requested_bytes, request);
    assert_eq!(pool.last_oom().unwrap().error_text, oom.message);
    pool.check_invariants().unwrap();
}

#[test]
fn blocks_are_tagged_by_owner() {
    let pool = TrackingPool::new(Simulated::new(64 * MIB));
    let _w = pool.alloc::<u8>(12 << 20, Tag::Weights).unwrap();
    let _k = pool.alloc::<u8>(2 << 20, Tag::KvCache).unwrap();
    let _r = pool.alloc::<u8>(1 << 20, Tag::Request(7)).unwrap();
    let _l = pool.alloc::<u8>(512, Tag::label("lora")).unwrap();
    let snap = pool.snapshot();
    let tags: Vec<(&str, u64)> = snap
        .live_by_tag
        .iter()
        .map(|t| (t.site.as_str(), t.bytes))
        .collect();
    assert_eq!(
        tags,
        vec![
            ("weights", 12 << 20),
            ("kv_cache", 2 << 20),
            ("request:7", 1 << 20),
            ("lora", 512)
        ]
    );
    assert_eq!(snap.settings.unwrap().backend, "oomscope-pool");
}

#[test]
fn simulated_device_enforces_capacity_and_granularity() {
    use oomscope_agent_cuda::DeviceMemory;
    let dev = Simulated::new(5 * MIB);
    let a = dev.alloc(MIB + 1).unwrap(); // charged 2 MiB
    assert_eq!(dev.mem_get_info().unwrap(), (3 * MIB, 5 * MIB));
    let err = dev.alloc(4 * MIB).unwrap_err();
    assert_eq!(
        err,
        DeviceError::OutOfMemory {
            requested: 4 * MIB,
            free: 3 * MIB,
            total: 5 * MIB
        }
    );
    assert_eq!(err.driver_code(), 2);
    unsafe { dev.free(a, MIB + 1).unwrap() };
    assert_eq!(dev.used_bytes(), 0);
}

#[test]
fn cuda_reports_itself_absent_without_libcuda() {
    if libcuda_present() {
        eprintln!("libcuda is present here; the absent path is not exercised");
        return;
    }
    match Cuda::open(0) {
        Err(DeviceError::Absent(why)) => assert!(why.contains("libcuda"), "{why}"),
        other => panic!("expected Absent, got {other:?}"),
    }
}
