//! `oomscope replay`: feed a capture through the same reporter a live agent
//! uses, so the collector sees exactly what that agent would have sent.

use std::path::Path;
use std::time::{Duration, Instant};

use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{now_ns, pb};

use oomscope_replay::capture::{self, CaptureItem};

pub fn run(
    file: &Path,
    collector_url: &str,
    name: Option<String>,
    speed: f64,
    timeout: Duration,
) -> anyhow::Result<i32> {
    if !(speed >= 0.0 && speed.is_finite()) {
        anyhow::bail!("--speed must be 0 (as fast as possible) or a positive factor, not {speed}");
    }
    let base_ns = now_ns();
    let cap = capture::load(file, base_ns)?;
    let mut hello = cap.hello.clone();
    if let Some(n) = name {
        hello.name = n;
    }
    hello.agent_id = format!("replay-{}-{:x}", hello.name, base_ns);
    let reporter = Reporter::start(
        ReporterConfig {
            collector_url: collector_url.to_string(),
            ..ReporterConfig::default()
        },
        hello,
    );

    let started = Instant::now();
    let (mut samples, mut events, mut dropped) = (0u64, 0u64, 0u64);
    for (t_s, item) in cap.items {
        if speed > 0.0 {
            let due = Duration::from_secs_f64((t_s / speed).max(0.0));
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        // The queue is bounded: when it is full, wait for the reporter rather
        // than drop, since a replay must deliver everything.
        loop {
            let ok = match &item {
                CaptureItem::Sample(s) => reporter.send_sample(s.clone()),
                CaptureItem::Event(e) => reporter.send_event(e.clone()),
            };
            if ok {
                break;
            }
            dropped += 1;
            if started.elapsed() > timeout {
                anyhow::bail!("the reporter queue stayed full for {timeout:?}: is the collector at {collector_url} up?");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        match item {
            CaptureItem::Sample(_) => samples += 1,
            CaptureItem::Event(_) => events += 1,
        }
    }
    let _ = dropped;
    let agent_id = reporter.agent_id().to_string();
    let acked = reporter.shutdown(
        pb::Goodbye {
            reason: "replay finished".into(),
            exit_code: 0,
        },
        timeout,
    );
    if !acked {
        eprintln!(
            "oomscope replay: {} was not fully acked by {collector_url} within {:.0} s",
            file.display(),
            timeout.as_secs_f64()
        );
        return Ok(1);
    }
    crate::output::print_out(&format!(
        "replayed {} ({}): {samples} samples, {events} events as agent {agent_id}\n",
        file.display(),
        cap.scenario
    ))?;
    Ok(0)
}
