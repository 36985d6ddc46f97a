//! The pool's bookkeeping under random alloc/free sequences, on the
//! simulated device (real host memory, a real capacity).

use oomscope_agent_cuda::pool::{round_size, segment_size};
use oomscope_agent_cuda::{PoolError, Simulated, Tag, TrackedSlice, TrackingPool};
use proptest::prelude::*;

const CAPACITY: u64 = 256 << 20;

#[derive(Debug, Clone)]
enum Op {
    Alloc { bytes: u64, stream: u64 },
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop_oneof![1u64..4096, 4096u64..(1 << 20), (1u64 << 20)..(12 << 20), (12u64 << 20)..(40 << 20)], 0u64..2)
            .prop_map(|(bytes, stream)| Op::Alloc { bytes, stream }),
        2 => any::<usize>().prop_map(Op::Free),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn stats_equal_blocks_no_overlap_frees_coalesce(ops in prop::collection::vec(op(), 1..120)) {
        let pool = TrackingPool::new(Simulated::new(CAPACITY));
        let mut live: Vec<TrackedSlice<u8>> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc { bytes, stream } => match pool.alloc_on::<u8>(stream, bytes as usize, Tag::Activation) {
                    Ok(s) => live.push(s),
                    Err(PoolError::OutOfMemory(e)) => {
                        // An OOM only when the cache was released and the new segment still does not fit.
                        let reserved = e.event.stats.as_ref().unwrap().reserved_bytes;
                        prop_assert!(reserved + segment_size(e.requested_bytes) > CAPACITY, "reserved {reserved}");
                        prop_assert!(pool.blocks().iter().all(|b| b.allocated || b.size != b.segment_size));
                    }
                    Err(e) => prop_assert!(false, "unexpected error {e}"),
                },
                Op::Free(i) => {
                    if !live.is_empty() {
                        live.swap_remove(i % live.len());
                    }
                }
            }
            pool.check_invariants().map_err(TestCaseError::fail)?;
            let stats = pool.stats();
            prop_assert!(stats.reserved_bytes <= CAPACITY);
            let blocks = pool.blocks();
            let allocated: u64 = blocks.iter().filter(|b| b.allocated).map(|b| b.size).sum();
            prop_assert_eq!(stats.allocated_bytes, allocated);
            prop_assert_eq!(stats.reserved_bytes, pool.device().used_bytes());
            for b in blocks.iter().filter(|b| b.allocated) {
                prop_assert!(b.size >= round_size(b.requested));
            }
            prop_assert_eq!(stats.requested_bytes, live.iter().map(|s| s.num_bytes()).sum::<u64>());
            prop_assert_eq!(stats.allocations, live.len() as u64);
            // No two live slices overlap.
            let mut spans: Vec<(u64, u64)> = blocks.iter().map(|b| (b.addr, b.addr + b.size)).collect();
            spans.sort();
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
            }
        }
        drop(live);
        pool.check_invariants().map_err(TestCaseError::fail)?;
        // With everything freed, each segment is one free block again.
        let blocks = pool.blocks();
        prop_assert!(blocks.iter().all(|b| !b.allocated && b.size == b.segment_size && b.addr == b.segment_addr));
        let released = pool.empty_cache();
        prop_assert_eq!(released.reserved_after_bytes, 0);
        prop_assert_eq!(pool.device().used_bytes(), 0);
        prop_assert_eq!(pool.stats().reserved_bytes, 0);
    }
}
