//! The replay driver behind `oomscope replay`: feed a capture through the
//! same reporter a live agent uses, so the collector sees exactly what that
//! agent would have sent.

use std::path::Path;
use std::time::{Duration, Instant};

use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{now_ns, pb};

use crate::capture::{self, CaptureItem};

/// What one replay sent, and whether the collector acked all of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Replayed {
    /// The capture's scenario.
    pub scenario: String,
    pub agent_id: String,
    pub samples: u64,
    pub events: u64,
    /// False when the collector had not acked every message within the
    /// timeout (the reporter spooled or dropped the rest).
    pub acked: bool,
}

/// Replays the capture `file` into the collector at `collector_url` as agent
/// `name` (default: the capture's scenario), at `speed` times the capture's
/// pace (0: as fast as possible); waits up to `timeout` for the acks.
pub fn replay(
    file: &Path,
    collector_url: &str,
    name: Option<String>,
    speed: f64,
    timeout: Duration,
) -> anyhow::Result<Replayed> {
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
    Ok(Replayed {
        scenario: cap.scenario,
        agent_id,
        samples,
        events,
        acked,
    })
}
