//! The agent's costs inside a host process, each against the raw operation it
//! wraps, as ratios from one run. Run with:
//!     cargo bench -p oomscope-agent-core --bench hot_path
//! (a plain bench binary: no harness, no timing asserts; figures go in BENCHMARKS.md).

use std::hint::black_box;
use std::time::{Duration, Instant};

use oomscope_agent_core::pb;
use oomscope_agent_core::readers::{HostPaths, HostReader};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};

/// Median of `rounds` timings of `iters` calls, in ns per call.
fn per_call(rounds: usize, iters: u32, mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn sample() -> pb::Sample {
    pb::Sample {
        time_ns: 1,
        step: 1,
        ..Default::default()
    }
}

fn main() {
    // 1. The hot path: Reporter::send_sample (seq + try_send under one short
    //    lock) vs a raw tokio bounded channel try_send of the same message.
    // Both channels are sized past what is sent, so neither fills up or drains.
    let (tx, _rx) = tokio::sync::mpsc::channel::<pb::AgentMessage>(15 * 4096 + 16);
    let raw = per_call(15, 4096, || {
        let _ = black_box(tx.try_send(pb::AgentMessage {
            seq: 1,
            body: Some(pb::agent_message::Body::Sample(sample())),
        }));
    });
    // A collector that is never there: the reporter's worker takes nothing off the
    // queue without a spool, so drain by sizing the queue past what we send.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = ReporterConfig::new(format!("http://127.0.0.1:{port}"));
    cfg.queue_capacity = 15 * 4096 + 16;
    let reporter = Reporter::start(
        cfg,
        pb::Hello {
            agent_id: "bench".into(),
            ..Default::default()
        },
    );
    let tracked = per_call(15, 4096, || {
        black_box(reporter.send_sample(sample()));
    });
    println!(
        "send_sample         {tracked:8.1} ns/call   raw try_send {raw:8.1} ns/call   ratio {:.2}",
        tracked / raw
    );

    // 2. One full host sample (process, cgroup levels, system, PSI) vs one raw
    //    read of /proc/self/status, the cheapest file it reads.
    let reader = HostReader::new(HostPaths::system(), std::process::id());
    let full = per_call(9, 200, || {
        black_box(reader.sample());
    });
    let raw_read = per_call(9, 200, || {
        black_box(std::fs::read_to_string("/proc/self/status").unwrap());
    });
    println!(
        "HostReader::sample   {:8.1} us/call   raw status read {:8.1} us/call   ratio {:.1}",
        full / 1e3,
        raw_read / 1e3,
        full / raw_read
    );
    // Its parts, to see what a lighter sample would save.
    let (paths, pid) = (reader.paths(), reader.pid());
    let process = per_call(9, 200, || {
        black_box(oomscope_agent_core::readers::process::read(paths, pid).ok());
    });
    let cgroup = per_call(9, 200, || {
        black_box(
            reader
                .memory_cgroup()
                .map(|cg| oomscope_agent_core::readers::cgroup::read_levels(paths, cg)),
        );
    });
    let system = per_call(9, 200, || {
        black_box(oomscope_agent_core::readers::system::read(paths));
    });
    let gpus = per_call(9, 200, || {
        black_box(reader.gpu().read());
    });
    let devices = reader.gpu().read().len();
    println!(
        "  parts: process {:.1} us, cgroup levels {:.1} us, system {:.1} us, gpus {:.1} us ({devices} NVML devices{})",
        process / 1e3,
        cgroup / 1e3,
        system / 1e3,
        gpus / 1e3,
        if devices > 0 {
            format!(", {:.1} us per device", gpus / 1e3 / devices as f64)
        } else {
            String::new()
        }
    );
    // 3. A request boundary's reading (process and each level's usage, the
    //    rest carried from the last full sample) against the full sample.
    let last_levels = reader.sample().cgroup;
    let boundary = per_call(9, 200, || {
        black_box(reader.boundary_sample(&last_levels));
    });
    println!(
        "HostReader::boundary_sample {:8.1} us/call   full sample {:8.1} us/call   ratio {:.2}",
        boundary / 1e3,
        full / 1e3,
        boundary / full
    );
    let levels = last_levels.len();
    println!(
        "  ({levels} cgroup levels; a full sample a second is {:.3}% of one core, boundary samples at their most (50 a second) {:.2}%)",
        full / 1e7,
        boundary * 50.0 / 1e7
    );
    drop(reporter);
    std::thread::sleep(Duration::from_millis(10));
}
