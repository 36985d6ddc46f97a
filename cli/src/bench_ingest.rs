//! `oomscope bench ingest`: the verb over `oomscope_replay::ingest_load`,
//! the load generator that sizes a collector.

use anyhow::Result;
use oomscope_replay::ingest_load::{self, Figures};
pub use oomscope_replay::ingest_load::{Load, DEFAULT_AGENTS, DEFAULT_SAMPLES, DEFAULT_WINDOW};

use crate::output::print_out;

/// `oomscope bench ingest`.
pub fn run(collector_url: &str, load: Load, json: bool) -> Result<i32> {
    let figures = ingest_load::measure(collector_url, load)?;
    match json {
        true => print_out(&format!("{}\n", to_json(&figures)))?,
        false => print_out(&text(&figures, collector_url))?,
    }
    Ok(0)
}

fn to_json(f: &Figures) -> serde_json::Value {
    serde_json::json!({
        "acked_samples_per_s": f.acked_samples_per_s,
        "p50_ack_ms": f.p50_ack_ms,
        "p99_ack_ms": f.p99_ack_ms,
        "collector_cpu_us_per_sample": f.collector_cpu_us_per_sample,
        "agents": f.agents,
        "samples": f.samples,
        "wire_bytes_per_sample": f.wire_bytes_per_sample,
        "p99_send_late_ms": f.p99_send_late_ms,
        "generator_cpu_us_per_sample": f.generator_cpu_us_per_sample,
    })
}

fn text(f: &Figures, url: &str) -> String {
    let cpu = match f.collector_cpu_us_per_sample {
        Some(us) => format!("{us:.1} µs of collector CPU per sample"),
        None => "collector CPU unknown (not a process on this host)".to_string(),
    };
    let generator = match (f.generator_cpu_us_per_sample, f.p99_send_late_ms) {
        (Some(us), Some(late)) => {
            format!("\nthis generator: {us:.1} µs of CPU per sample, p99 {late:.2} ms late sending")
        }
        (Some(us), None) => format!("\nthis generator: {us:.1} µs of CPU per sample"),
        _ => String::new(),
    };
    format!(
        "{url}: {} agents x {} samples ({:.0} bytes each on the wire)\n\
         {:.0} acked samples/s; ack latency p50 {:.2} ms, p99 {:.2} ms; {cpu}{generator}\n",
        f.agents,
        f.samples,
        f.wire_bytes_per_sample,
        f.acked_samples_per_s,
        f.p50_ack_ms,
        f.p99_ack_ms,
    )
}
