//! The agent's sampler thread: a periodic sample of every domain, the
//! boundary samples the request path hands over, heap censuses, snapshots
//! and the collector's directives. Host domains are read without the GIL;
//! the allocator and the heap with it, and only when the interpreter can be
//! attached to (never during finalisation).

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oomscope_agent_core::pb;
use oomscope_agent_core::probe::HostProbe;
use pyo3::prelude::*;

use crate::agent::{lock, Agent, Job, OOM_TOP_PROCESSES};
use crate::torchread;

/// The phase of a sample taken on the clock rather than at a boundary.
pub const PERIODIC_PHASE: &str = "periodic";
/// The longest a census due by request count waits for a moment with no
/// request in flight; a server that is never idle gets it anyway, and a
/// few in-flight temporaries in it.
pub const CENSUS_IDLE_WAIT: Duration = Duration::from_secs(2);

pub fn spawn(agent: Arc<Agent>, probe: HostProbe, jobs: Receiver<Job>) -> Option<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("oomscope-sampler".into())
        .spawn(move || run(agent, probe, jobs))
        .map_err(|e| tracing::error!(error = %e, "oomscope: cannot start the sampler thread"))
        .ok()
}

/// Request boundaries waiting for their sample: at most one sample per
/// `boundary_min_interval`; a boundary that comes sooner replaces the one
/// waiting, so the sample taken carries the newest context (requests_done
/// only grows) and a burst of requests costs one host reading, not one each.
struct Boundaries {
    min_interval: Duration,
    last: Option<Instant>,
    waiting: Option<(i64, Box<pb::RequestContext>)>,
}

impl Boundaries {
    /// When the waiting boundary is due, if one waits.
    fn due(&self) -> Option<Instant> {
        self.waiting.as_ref()?;
        Some(
            self.last
                .map_or_else(Instant::now, |t| t + self.min_interval),
        )
    }

    /// The waiting boundary if it is due now, counted as sampled now.
    fn take_due(&mut self) -> Option<(i64, Box<pb::RequestContext>)> {
        if self.due()? > Instant::now() {
            return None;
        }
        self.last = Some(Instant::now());
        self.waiting.take()
    }
}

fn run(agent: Arc<Agent>, probe: HostProbe, jobs: Receiver<Job>) {
    let directives = agent.reporter.directives();
    let mut next_tick = Instant::now();
    let mut next_census = (agent.config.census_interval > Duration::ZERO)
        .then(|| Instant::now() + agent.config.census_interval);
    let mut boundaries = Boundaries {
        min_interval: agent.config.boundary_min_interval,
        last: None,
        waiting: None,
    };
    // A census asked for by request count, waiting for a quiet moment.
    let mut census: Option<(Duration, Instant)> = None;
    loop {
        if let Some((budget, until)) = census {
            if Instant::now() >= until || lock(&agent.context).in_flight.is_empty() {
                census = None;
                Python::try_attach(|py| {
                    if let Err(e) = agent.census(py, budget) {
                        tracing::warn!(error = %e, "oomscope: heap census failed");
                    }
                });
            }
        }
        let mut wake = boundaries.due().map_or(next_tick, |d| d.min(next_tick));
        if let Some((_, until)) = census {
            wake = wake.min(until);
        }
        match jobs.recv_timeout(wake.saturating_duration_since(Instant::now())) {
            Ok(Job::Stop) | Err(RecvTimeoutError::Disconnected) => {
                // The last requests' state is not lost to the spacing.
                if let Some((time_ns, context)) = boundaries.waiting.take() {
                    boundary_sample(&agent, &probe, time_ns, *context);
                }
                return;
            }
            Ok(Job::Boundary { time_ns, context }) => {
                boundaries.waiting = Some((time_ns, context));
                if let Some((time_ns, context)) = boundaries.take_due() {
                    boundary_sample(&agent, &probe, time_ns, *context);
                }
            }
            Ok(Job::Census { budget }) => {
                // Between requests the heap holds what requests left behind,
                // not the temporaries of one mid-step: wait (a little) for
                // no request in flight; the next request end wakes us.
                census.get_or_insert((budget, Instant::now() + CENSUS_IDLE_WAIT));
            }
            Ok(Job::Snapshot { device }) => {
                Python::try_attach(|py| agent.snapshot(py, device));
            }
            Ok(Job::ProcessList) => {
                agent.send_event(pb::event::Kind::ProcessList(
                    probe.process_list(OOM_TOP_PROCESSES),
                ));
            }
            Err(RecvTimeoutError::Timeout) if Instant::now() < next_tick => {
                // Woken for a waiting boundary (or a census), not the tick.
                if let Some((time_ns, context)) = boundaries.take_due() {
                    boundary_sample(&agent, &probe, time_ns, *context);
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                tick(&agent, &probe);
                let interval =
                    Duration::from_millis(agent.interval_ms.load(Ordering::Relaxed).max(10));
                next_tick += interval;
                if next_tick < Instant::now() {
                    next_tick = Instant::now() + interval; // fell behind: do not burst
                }
                if let Some(rx) = &directives {
                    while let Ok(d) = rx.try_recv() {
                        directive(&agent, d);
                    }
                }
                if next_census.is_some_and(|t| Instant::now() >= t) {
                    next_census = Some(Instant::now() + agent.config.census_interval);
                    let recent = lock(&agent.last_census)
                        .is_some_and(|t| t.elapsed() < agent.config.census_interval / 2);
                    if !recent {
                        Python::try_attach(|py| agent.census(py, agent.config.census_budget).ok());
                    }
                }
            }
        }
    }
}

/// A sample at a request boundary. Its allocator reading is taken here, on
/// the agent's thread, a moment after the request ended rather than on its
/// thread. Only a process with CUDA in use (seen by the periodic tick, which
/// installs the torch hooks) has an allocator to read; the rest never take
/// the GIL here.
fn boundary_sample(agent: &Agent, probe: &HostProbe, time_ns: i64, context: pb::RequestContext) {
    let allocator = if agent.torch_hooks.load(Ordering::Relaxed) {
        Python::try_attach(torchread::read_all).unwrap_or_default()
    } else {
        Vec::new()
    };
    let mut s = probe.sample();
    s.time_ns = time_ns;
    s.allocator = allocator;
    s.context = Some(context);
    agent.reporter.send_sample(s);
}

/// One periodic sample: host domains first (no GIL), then the allocator.
fn tick(agent: &Agent, probe: &HostProbe) {
    let mut sample = probe.sample();
    let context = {
        let c = lock(&agent.context);
        let phase = if c.phase.is_empty() {
            PERIODIC_PHASE
        } else {
            ""
        };
        c.to_pb(phase)
    };
    Python::try_attach(|py| {
        sample.allocator = torchread::read_all(py);
        if !sample.allocator.is_empty() && !agent.torch_hooks.load(Ordering::Relaxed) {
            crate::install_torch_hooks(py, agent);
        }
        agent.orphan_oom(py);
    });
    sample.context = Some(context);
    agent.reporter.send_sample(sample);
}

fn directive(agent: &Agent, d: pb::Directive) {
    use pb::directive::Kind;
    match d.kind {
        Some(Kind::TakeSnapshot(t)) => {
            Python::try_attach(|py| agent.snapshot(py, Some(t.device)));
        }
        Some(Kind::RunHeapCensus(c)) => {
            let budget = if c.time_budget_ms > 0 {
                Duration::from_millis(u64::from(c.time_budget_ms))
            } else {
                agent.config.census_budget
            };
            Python::try_attach(|py| agent.census(py, budget).ok());
        }
        Some(Kind::SetSampleInterval(s)) if s.interval_ms >= 10 => {
            agent.interval_ms.store(s.interval_ms, Ordering::Relaxed);
        }
        _ => {}
    }
}
