//! A cached alloc+free through the tracking pool, the same allocator
//! untracked, and a raw simulated device alloc+free. Run with:
//!     cargo bench -p oomscope-agent-cuda --bench pool
//! Figures go in BENCHMARKS.md (target: tracking adds < 50 ns to a cache hit).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use oomscope_agent_cuda::{DeviceMemory, Simulated, Tag, TrackingPool, UntrackedPool};

const BYTES: usize = 1 << 20;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_1MiB");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let tracked = TrackingPool::new(Simulated::new(1 << 30));
    drop(tracked.alloc::<u8>(BYTES, Tag::Activation).unwrap()); // warm the cache
    g.bench_function("tracking_pool_cache_hit", |b| {
        b.iter(|| {
            drop(black_box(
                tracked.alloc::<u8>(BYTES, Tag::Activation).unwrap(),
            ))
        })
    });
    let untracked = UntrackedPool::new(Simulated::new(1 << 30));
    drop(untracked.alloc::<u8>(BYTES, Tag::Activation).unwrap());
    g.bench_function("untracked_pool_cache_hit", |b| {
        b.iter(|| {
            drop(black_box(
                untracked.alloc::<u8>(BYTES, Tag::Activation).unwrap(),
            ))
        })
    });
    let raw = Simulated::new(1 << 30);
    g.bench_function("raw_simulated_device", |b| {
        b.iter(|| {
            let p = raw.alloc(BYTES as u64).unwrap();
            unsafe { raw.free(black_box(p), BYTES as u64).unwrap() };
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
