//! How long one `/metrics` scrape takes with N agents' series (the issue's
//! bar: 1,000 agents under 100 ms). Each agent's sample reads one GPU, one
//! allocator device, the process, a cgroup with a limit and host swap: 10
//! series an agent. Prints the median and worst of 20 renders.
//!
//! `cargo run --release -p oomscope-collector --example metrics_scrape [N]`

use std::time::Instant;

use oomscope_collector::metrics::Metrics;
use oomscope_collector::pb;

fn main() {
    let agents: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let m = Metrics::new();
    let now = Instant::now();
    for i in 0..agents {
        let hello = pb::Hello {
            agent_id: format!("agent-{i:05}-0123456789abcdef"),
            name: format!("svc-{}", i % 50),
            host: format!("gpu-host-{:04}", i / 8),
            ..Default::default()
        };
        let gib = 1u64 << 30;
        let sample = pb::Sample {
            gpus: vec![pb::GpuDevice {
                index: (i % 8) as i32,
                total_bytes: 141 * gib,
                used_bytes: 70 * gib + i as u64,
                ..Default::default()
            }],
            allocator: vec![pb::AllocatorStats {
                device: (i % 8) as i32,
                allocated_bytes: 60 * gib,
                reserved_bytes: 66 * gib,
                ..Default::default()
            }],
            process: Some(pb::ProcessMemory {
                vm_rss_bytes: 12 * gib,
                ..Default::default()
            }),
            cgroup: vec![pb::CgroupLevel {
                limit_bytes: 64 * gib,
                usage_bytes: 20 * gib,
                ..Default::default()
            }],
            system: Some(pb::SystemMemory {
                swap_total_bytes: 8 * gib,
                swap_free_bytes: 7 * gib,
                ..Default::default()
            }),
            ..Default::default()
        };
        m.sample(&hello, &sample, now);
    }
    let mut times = Vec::new();
    let mut text = String::new();
    for _ in 0..20 {
        let t = Instant::now();
        text = m.render(agents as i64);
        times.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let series = text
        .lines()
        .filter(|l| l.starts_with("oomscope_agent_memory_bytes{"))
        .count();
    let bytes = text.len();
    times.sort_by(f64::total_cmp);
    println!(
        "agents={agents} agent_series={} bytes={bytes} median_ms={:.2} max_ms={:.2}",
        series,
        times[times.len() / 2],
        times[times.len() - 1]
    );
}
