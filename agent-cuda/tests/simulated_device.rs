//! The simulated device: capacity and granularity enforced, memory usable,
//! and untouched capacity costing the host no RAM (CI runs servers on a
//! simulated GPU of many GiB).

use oomscope_agent_cuda::{DeviceError, DeviceMemory, Simulated};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib * 1024
}

#[test]
fn a_large_allocation_is_zeroed_usable_and_costs_no_ram_until_touched() {
    const GIB: u64 = 1 << 30;
    let dev = Simulated::new(8 * GIB);
    let before = rss_bytes();
    let ptr = dev.alloc(4 * GIB).unwrap();
    assert_eq!(ptr % 256, 0, "CUDA's alignment at least");
    assert!(
        rss_bytes() < before + 64 * (1 << 20),
        "4 GiB allocated, RSS grew from {before} to {}",
        rss_bytes()
    );
    // SAFETY: both bytes lie inside the 4 GiB just allocated.
    unsafe {
        let first = ptr as *mut u8;
        let last = (ptr + 4 * GIB - 1) as *mut u8;
        assert_eq!((*first, *last), (0, 0), "zeroed");
        *first = 7;
        *last = 9;
        assert_eq!((*first, *last), (7, 9));
    }
    assert_eq!(dev.mem_get_info().unwrap(), (4 * GIB, 8 * GIB));
    match dev.alloc(4 * GIB + 1) {
        Err(DeviceError::OutOfMemory {
            requested, free, ..
        }) => assert_eq!((requested, free), (4 * GIB + 1, 4 * GIB)),
        other => panic!("expected an OOM, got {other:?}"),
    }
    // SAFETY: `ptr` came from `alloc(4 GiB)` and is freed once.
    unsafe { dev.free(ptr, 4 * GIB).unwrap() };
    assert_eq!(dev.mem_get_info().unwrap(), (8 * GIB, 8 * GIB));
}
