//! What a request costs its own thread in `CudaAgent`: a begin and an end
//! (with a decode-step `sample()` between), the agent running, its
//! collector an address nothing listens on (messages queue in memory).
//! Run with:
//!     cargo bench -p oomscope-agent-cuda --bench request
//! Figures go in BENCHMARKS.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use oomscope_agent_cuda::{pb, Agent, AgentConfig, CudaAgent, Simulated, TrackingPool};

fn bench(c: &mut Criterion) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let pool = TrackingPool::new(Simulated::new(1 << 30));
    let mut cfg = AgentConfig::new("bench");
    cfg.collector_url = Some(url.clone());
    let agent = CudaAgent::start_with_pool(cfg, &pool).unwrap();
    let mut g = c.benchmark_group("agent_request");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let mut i = 0u64;
    g.bench_function("begin_sample_end", |b| {
        b.iter(|| {
            i += 1;
            let id = i.to_string();
            agent.request_boundary(pb::RequestBoundary {
                request_id: id.clone(),
                start: true,
                ..Default::default()
            });
            agent.set_context(|c| c.requests_done = i);
            black_box(agent.sample());
            agent.request_boundary(pb::RequestBoundary {
                request_id: id,
                ..Default::default()
            });
        })
    });
    // The guard a program holds: its begin, its end on drop (the agent
    // counts the request and reads the pool at the end).
    g.bench_function("guard", |b| {
        b.iter(|| {
            i += 1;
            let mut r = agent.request(i, 8);
            r.set_output_tokens(4);
            drop(black_box(r));
        })
    });
    // What an end reads besides the RSS: the pool's counters.
    g.bench_function("pool_stats", |b| b.iter(|| black_box(pool.stats())));
    g.bench_function("pool_stats_named", |b| {
        b.iter(|| black_box(pool.stats_named()))
    });
    g.finish();
    agent.shutdown("bench", 0, Duration::from_millis(10));
    // The same guard with no device at all (a CPU-only program).
    let mut cfg = AgentConfig::new("bench-host");
    cfg.collector_url = Some(url);
    let host = Agent::start(cfg).unwrap();
    let mut g = c.benchmark_group("agent_request_host_only");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    g.bench_function("guard", |b| {
        b.iter(|| {
            i += 1;
            drop(black_box(host.request(i, 8)));
        })
    });
    g.finish();
    host.shutdown("bench", 0, Duration::from_millis(10));
}

criterion_group!(benches, bench);
criterion_main!(benches);
