//! A server that drives several devices from one thread keeps its own
//! current context across every pool and agent call on another device. The
//! simulated device keeps CUDA's per-thread context stack and, like the
//! driver path, makes itself current on every device call, so a pool that
//! did not restore the caller's context fails here.

use std::time::Duration;

use oomscope_agent_cuda::simulated::current_context;
use oomscope_agent_cuda::{
    AgentConfig, CudaAgent, DeviceError, DeviceInfo, DeviceMemory, PoolError, Simulated, Tag,
    TrackingPool,
};

const MIB: u64 = 1 << 20;

fn device(index: i32, capacity: u64) -> Simulated {
    Simulated::with_info(DeviceInfo {
        index,
        name: format!("simulated {index}"),
        uuid: format!("GPU-5a1e0000-0000-0000-0000-00000000000{index}"),
        pci_bus_id: format!("0000:{:02X}:00.0", 0x3B + index),
        total_bytes: capacity,
    })
}

/// Runs `f` on a fresh thread whose current context is device 1's, and
/// returns what `f` returns; each step checks the context is still device 1's.
fn on_thread_with_device_1_current<T: Send + 'static>(
    f: impl FnOnce(&dyn Fn(&str)) -> T + Send + 'static,
) -> T {
    std::thread::spawn(move || {
        assert_eq!(current_context(), None, "a new thread has no context");
        device(1, 64 * MIB).set_current();
        let still_device_1 = |after: &str| {
            assert_eq!(
                current_context(),
                Some(1),
                "after {after} the caller's context (device 1's) is no longer current"
            );
        };
        f(&still_device_1)
    })
    .join()
    .expect("the thread's checks passed")
}

#[test]
fn the_simulated_device_makes_itself_current_like_the_driver() {
    // The premise of the other tests: without a scope a device call leaves
    // device 0's context current on the calling thread.
    on_thread_with_device_1_current(|_| {
        let dev0 = device(0, 64 * MIB);
        dev0.mem_get_info().unwrap();
        assert_eq!(current_context(), Some(0));
    });
}

#[test]
fn pool_calls_on_device_0_leave_the_callers_context_current() {
    on_thread_with_device_1_current(|still_device_1| {
        let pool = TrackingPool::new(device(0, 64 * MIB));
        let stats = pool.stats();
        still_device_1("stats()");
        assert_eq!(
            (stats.driver_free_bytes, stats.driver_total_bytes),
            (64 * MIB, 64 * MIB),
            "stats() read device 0's free/total"
        );
        // A cache miss: a new 20 MiB segment from the device.
        let big = pool.alloc::<u8>(3 << 20, Tag::KvCache).unwrap();
        still_device_1("alloc() of a new segment");
        assert_eq!(pool.device().used_bytes(), 20 * MIB);
        drop(big);
        still_device_1("free");
        let (free, total) = pool.device().mem_get_info().unwrap();
        assert_eq!(current_context(), Some(0), "a raw device call binds");
        device(1, 0).set_current();
        assert_eq!((free, total), (44 * MIB, 64 * MIB));
        let release = pool.empty_cache();
        still_device_1("empty_cache()");
        assert_eq!(
            (release.reserved_before_bytes, release.reserved_after_bytes),
            (20 * MIB, 0)
        );
        assert_eq!(pool.device().used_bytes(), 0);
    });
}

#[test]
fn a_retried_and_a_failed_allocation_restore_the_callers_context() {
    on_thread_with_device_1_current(|still_device_1| {
        let pool = TrackingPool::new(device(0, 40 * MIB));
        drop(pool.alloc::<u8>(30 << 20, Tag::Weights).unwrap());
        // Device full of cache: released, then retried.
        let b = pool.alloc::<u8>(36 << 20, Tag::Weights).unwrap();
        still_device_1("alloc() that released the cache and retried");
        assert_eq!(pool.stats().num_alloc_retries, 1);
        // The error path: nothing left to release.
        let err = pool.alloc::<u8>(8 << 20, Tag::Activation).unwrap_err();
        still_device_1("alloc() that failed with an OOM");
        assert!(matches!(err, PoolError::OutOfMemory(_)), "{err}");
        drop(b);
    });
}

#[test]
fn agent_sample_on_the_request_path_leaves_the_callers_context_current() {
    on_thread_with_device_1_current(|still_device_1| {
        let pool = TrackingPool::new(device(0, 64 * MIB));
        let mut cfg = AgentConfig::new("context-restore");
        // Nothing listens here: the agent queues and never blocks.
        cfg.collector_url = Some("http://127.0.0.1:9".into());
        cfg.sample_interval = Duration::from_secs(3600);
        let agent = CudaAgent::start_with_pool(cfg, &pool).unwrap();
        still_device_1("CudaAgent::start_with_pool()");
        let _kv = pool.alloc::<u8>(2 << 20, Tag::KvCache).unwrap();
        agent.sample();
        still_device_1("sample()");
        agent.phase_edge("load", true, None, "");
        still_device_1("phase()");
        agent.shutdown("test", 0, Duration::from_millis(10));
    });
}

#[test]
fn stats_and_oom_carry_the_devices_uuid_and_bus_id() {
    let pool = TrackingPool::new(device(2, 40 * MIB));
    let s = pool.stats();
    assert_eq!(s.device, 2);
    assert_eq!(s.device_uuid, "GPU-5a1e0000-0000-0000-0000-000000000002");
    assert_eq!(s.pci_bus_id, "0000:3D:00.0");
    let _w = pool.alloc::<u8>(30 << 20, Tag::Weights).unwrap();
    let Err(PoolError::OutOfMemory(oom)) = pool.alloc::<u8>(16 << 20, Tag::Activation) else {
        panic!("expected an OOM on a 40 MiB device holding 30 MiB")
    };
    let event = &oom.event;
    assert_eq!(event.device, 2);
    assert_eq!(
        event.device_uuid,
        "GPU-5a1e0000-0000-0000-0000-000000000002"
    );
    let stats = event.stats.as_ref().unwrap();
    assert_eq!(stats.device_uuid, event.device_uuid);
    assert_eq!(stats.pci_bus_id, "0000:3D:00.0");
    // The evidence: 30 MiB allocated in a 30 MiB segment; 10 MiB free.
    assert_eq!(
        (stats.allocated_bytes, stats.driver_free_bytes),
        (30 * MIB, 10 * MIB)
    );
    assert!(
        oom.message
            .contains("GPU 2 has a total capacity of 40.00 MiB"),
        "{}",
        oom.message
    );
}

#[test]
fn a_scope_pops_what_it_pushed_on_the_error_path_too() {
    use oomscope_agent_cuda::ContextScope;
    on_thread_with_device_1_current(|still_device_1| {
        let dev0 = device(0, 4 * MIB);
        let err = (|| -> Result<u64, DeviceError> {
            let _scope = ContextScope::enter(&dev0)?;
            assert_eq!(current_context(), Some(0), "device 0 current inside");
            dev0.alloc(8 * MIB)
        })()
        .unwrap_err();
        assert!(matches!(err, DeviceError::OutOfMemory { .. }));
        still_device_1("a scope whose device call failed");
    });
}
