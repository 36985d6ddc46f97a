//! The agent's sampler thread: a periodic sample of every domain, the
//! boundary messages carrying the request path's readings (agent-core
//! `boundary_ring`), heap censuses, snapshots
//! and the collector's directives. Host domains are read without the GIL;
//! the allocator and the heap with it, and only when the interpreter can be
//! attached to (never during finalisation).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oomscope_agent_core::agent::{boundary_ring, Flow, Readers};
use oomscope_agent_core::readers::HostReader;
use oomscope_agent_core::reporter::Reporter;
use oomscope_agent_core::{lock, pb};
use pyo3::prelude::*;

use crate::agent::{Agent, Job, CENSUS_IDLE_WAIT, OOM_TOP_PROCESSES};
use crate::census::{self, Why};
use crate::devices::{self, Which};
use crate::suspicion::{Reading, Reason, Suspicion};

pub use crate::context::PERIODIC_PHASE;

/// Starts `agent`'s sampler thread (agent-core's loop) with this process's readers.
pub fn start(agent: &Arc<Agent>, reader: HostReader) -> bool {
    let readers = PythonReaders {
        next_census: (agent.config.census_interval > Duration::ZERO)
            .then(|| Instant::now() + agent.config.census_interval),
        // At most once per `boundary_min_interval` (at least agent-core's
        // `MIN_BATCH_SPACING`).
        boundaries: boundary_ring::Pacing::new(agent.config.boundary_min_interval),
        census: None,
        suspicion: agent.config.census_auto.then(Suspicion::default),
        full_levels: Vec::new(),
        nvml_deferred: agent.nvml_deferred,
        agent: agent.clone(),
        reader,
    };
    agent
        .sampler
        .start(readers, agent.reporter.clone(), agent.config.interval)
}

/// What the Python agent reads on the sampling thread: host domains without
/// the GIL, the allocator and the heap with it.
struct PythonReaders {
    agent: Arc<Agent>,
    reader: HostReader,
    boundaries: boundary_ring::Pacing,
    /// A census asked for by request count, waiting for a quiet moment:
    /// (budget, the latest moment it waits until, why).
    census: Option<(Duration, Instant, Why)>,
    /// When the next census by time is due; None when they are off.
    next_census: Option<Instant>,
    /// Censuses on suspicion; None when `census_auto` is off.
    suspicion: Option<Suspicion>,
    /// The cgroup levels of the newest periodic sample, which boundary
    /// samples carry with their usage read again.
    full_levels: Vec<pb::CgroupLevel>,
    /// Started held, the reader has no NVML yet (see `Agent::nvml_deferred`).
    nvml_deferred: bool,
}

impl PythonReaders {
    /// Opens NVML once a held start has been released: the reader reads the
    /// GPUs from then on, and the Hello lists them.
    fn open_nvml_once_released(&mut self) {
        if !self.nvml_deferred || self.agent.reporter.held() {
            return;
        }
        self.nvml_deferred = false;
        self.reader = HostReader::new(self.reader.paths().clone(), self.reader.pid());
        let mut gpus = self.reader.gpu().placements();
        devices::merge_placements(&mut gpus, &self.agent.devices.identities());
        self.agent.reporter.update_hello(|h| h.gpus = gpus);
    }

    /// When a held start ends on its own, while it is still held.
    fn held_until(&self) -> Option<Instant> {
        self.agent.hold_until.filter(|_| self.agent.reporter.held())
    }

    /// Takes the boundary ring: one message carrying its readings, and
    /// each request end's reading (RSS, allocated blocks) to the suspicion.
    fn take_handoff(&mut self) {
        let agent = self.agent.clone();
        let taken = lock(&agent.handoff).take();
        if taken.readings.is_empty() && taken.thinned.thinned_requests == 0 {
            agent.count_dropped(taken.dropped);
            return;
        }
        let readings: Vec<Reading> = taken
            .ends()
            .map(|r| Reading {
                requests_done: r.context.as_ref().map_or(0, |c| c.requests_done),
                blocks: r.allocated_blocks,
                rss: r.rss_bytes,
            })
            .collect();
        agent.send_batch(
            boundary_reading(&agent, &self.reader, &self.full_levels),
            taken,
        );
        for r in readings {
            self.observe(r);
        }
    }

    /// One boundary's signals to the suspicion; a census on suspicion is
    /// asked for when they grow for certain.
    fn observe(&mut self, reading: Reading) {
        let Some(s) = self.suspicion.as_mut() else {
            return;
        };
        s.observe(reading, Instant::now());
        self.suspect();
    }

    /// A census on suspicion (or a baseline) if one is due now: asked at
    /// each boundary and at each tick, so one the duty cycle held back
    /// still runs when a burst of requests has ended (a leak in 100
    /// requests at 45 a second outran it, and no later boundary asked).
    fn suspect(&mut self) {
        let Some(s) = self.suspicion.as_mut() else {
            return;
        };
        if let Some(reason) = s.due(Instant::now()) {
            let why = match reason {
                Reason::Baseline => Why::Baseline,
                Reason::Blocks => Why::Suspicion("blocks"),
                Reason::Rss => Why::Suspicion("rss"),
                Reason::Census => Why::Suspicion("census"),
            };
            self.wait_census(self.agent.config.census_budget, why);
        }
    }

    /// Between requests the heap holds what requests left behind, not the
    /// temporaries of one mid-step: a census waits (a little) for no request
    /// in flight, looked at as each request ends (`Agent::census_waiting`).
    fn wait_census(&mut self, budget: Duration, why: Why) {
        self.census
            .get_or_insert((budget, Instant::now() + CENSUS_IDLE_WAIT, why));
        self.agent.census_waiting.store(true, Ordering::Relaxed);
    }

    /// A census now (GIL in slices); the suspicion starts over from it.
    fn census_now(&mut self, budget: Duration, why: Why) {
        self.census_if(budget, why, false);
    }

    /// A census, unless `idle_only` and a request is in flight once this
    /// thread holds the GIL: one may have begun while it waited for the GIL,
    /// and the census would count its temporaries. False if it did not run
    /// for that reason (the next request end looks again).
    fn census_if(&mut self, budget: Duration, why: Why, idle_only: bool) -> bool {
        let agent = &self.agent;
        let attempt = Python::try_attach(|py| {
            let done = {
                let c = lock(&agent.context);
                if idle_only && !c.in_flight.is_empty() {
                    return Attempt::Busy;
                }
                c.requests_done
            };
            // The census's cost to the duty cycle is this thread's CPU time
            // in it, not the GIL's wall time held: on a loaded machine the
            // thread is descheduled within its slices (207 ms held for 117
            // ms of CPU measured at load 5 on 2 cores, 4x at load 11), and
            // that wait would space the censuses out for nothing.
            let cpu = census::thread_cpu();
            match agent.census(py, budget, why, census::Sizing::of(why), idle_only) {
                Ok(_) => Attempt::Taken {
                    done,
                    cost: census::thread_cpu().saturating_sub(cpu),
                    grown: lock(&agent.baseline)
                        .as_ref()
                        .map_or(0, |b| b.top_grown_bytes),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "oomscope: heap census failed");
                    Attempt::Failed
                }
            }
        });
        match attempt.unwrap_or(Attempt::Failed) {
            Attempt::Busy => false,
            Attempt::Taken { done, cost, grown } => {
                if let Some(s) = self.suspicion.as_mut() {
                    s.censused(done, cost, grown, Instant::now());
                }
                true
            }
            // Failed, or the interpreter is gone: no point waiting.
            Attempt::Failed => true,
        }
    }
}

/// How a census the sampler asked for went.
enum Attempt {
    /// A request was in flight: not taken.
    Busy,
    /// Taken after `done` requests, at `cost` of this thread's CPU; its
    /// top type grew `grown` bytes since the census before.
    Taken {
        done: u64,
        cost: Duration,
        grown: u64,
    },
    /// The census failed, or the interpreter is gone.
    Failed,
}

impl Readers for PythonReaders {
    type Job = Job;

    fn tick(&mut self, _: &Reporter) {
        let agent = self.agent.clone();
        self.open_nvml_once_released();
        // One of the agent's messages under the cap (at most 50 ms on this
        // thread, never a request's).
        std::thread::sleep(self.boundaries.wait_left());
        self.full_levels = tick(&agent, &self.reader);
        self.boundaries.sent();
        if self.census.is_none() {
            self.suspect();
        }
        if self.next_census.is_some_and(|t| Instant::now() >= t) {
            self.next_census = Some(Instant::now() + agent.config.census_interval);
            // Held, nobody hears it, and a process that never proves to be
            // a server (a load generator, held for its whole life) should
            // not pay for one: the hour counts again from now. Only when no
            // other census ran in the whole interval: it keeps an idle
            // server's heap on record, and never adds to a busy one's.
            let held = agent.reporter.held();
            let recent = lock(&agent.last_census)
                .is_some_and(|t| t.elapsed() < agent.config.census_interval);
            if !(held || recent) {
                self.census_now(agent.config.census_budget, Why::Interval);
            }
        }
    }

    fn job(&mut self, job: Job, _: &Reporter) {
        match job {
            Job::Handoff => self.boundaries.signal(),
            Job::Census { budget, why } => {
                self.wait_census(budget, why);
            }
            Job::Snapshot { device } => {
                Python::try_attach(|py| self.agent.snapshot(py, device));
            }
            Job::ProcessList => {
                // Asked at an OOM, which released the agent: with the GPUs.
                self.open_nvml_once_released();
                self.agent.send_event(pb::event::Kind::ProcessList(
                    self.reader.process_list(OOM_TOP_PROCESSES),
                ));
            }
        }
    }

    fn directive(&mut self, d: pb::Directive, _: &Reporter) {
        use pb::directive::Kind;
        let agent = self.agent.clone();
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
                self.census_now(budget, Why::Directive);
            }
            _ => {}
        }
    }

    fn poll(&mut self, reporter: &Reporter) -> Flow {
        let agent = self.agent.clone();
        if self.held_until().is_some_and(|t| Instant::now() >= t) {
            // The process has lasted: it is no passing helper.
            reporter.release();
        }
        // The requests' events and sample first: a census due now (or made
        // due by this sample's readings) follows them on the stream.
        if self.boundaries.take_due() {
            self.take_handoff();
        }
        if let Some((budget, until, why)) = self.census {
            let waited = Instant::now() >= until;
            if (waited || lock(&agent.context).in_flight.is_empty())
                && self.census_if(budget, why, !waited)
            {
                self.census = None;
                self.agent.census_waiting.store(false, Ordering::Relaxed);
            }
        }
        Flow::Continue
    }

    fn next_wake(&self) -> Option<Instant> {
        let census = self.census.map(|(_, until, _)| until);
        [self.boundaries.due(), census, self.held_until()]
            .into_iter()
            .flatten()
            .min()
    }

    fn stop(&mut self, _: &Reporter) {
        // The last requests' events and state are not lost to the spacing.
        self.take_handoff();
    }
}

/// The host reading of a boundary message, taken on the agent's thread a
/// moment after the batch's newest end. Only a process with CUDA in use
/// (seen by the periodic tick, which installs the torch hooks) has an
/// allocator to read; the rest never take the GIL here.
fn boundary_reading(
    agent: &Agent,
    reader: &HostReader,
    full_levels: &[pb::CgroupLevel],
) -> pb::Sample {
    let allocator = if agent.torch_hooks.load(Ordering::Relaxed) {
        Python::try_attach(|py| agent.devices.read(py, Which::Known)).unwrap_or_default()
    } else {
        Vec::new()
    };
    let mut s = reader.boundary_sample(full_levels);
    s.allocator = allocator;
    s
}

/// One periodic sample: host domains first (no GIL), then the allocator of
/// every device the process uses. A held process is only asked whether it
/// uses one (CUDA in use releases it: see `install_torch_hooks`); its devices
/// are not read while it stays held. Returns its cgroup levels.
fn tick(agent: &Agent, reader: &HostReader) -> Vec<pb::CgroupLevel> {
    let mut sample = reader.sample();
    let levels = sample.cgroup.clone();
    let context = {
        let mut c = lock(&agent.context);
        let phase = if c.phase.is_empty() {
            PERIODIC_PHASE
        } else {
            ""
        };
        c.take_pb(phase)
    };
    Python::try_attach(|py| {
        let hooked = agent.torch_hooks.load(Ordering::Relaxed);
        if agent.reporter.held() && !hooked && agent.devices.any_in_use(py) {
            crate::install_torch_hooks(py, agent);
        }
        if !agent.reporter.held() {
            sample.allocator = agent.devices.read(py, Which::Scan);
            if !sample.allocator.is_empty() && !agent.torch_hooks.load(Ordering::Relaxed) {
                crate::install_torch_hooks(py, agent);
            }
            if let Some(ours) = agent.devices.unannounced() {
                agent
                    .reporter
                    .update_hello(|h| devices::merge_placements(&mut h.gpus, &ours));
            }
        }
        agent.orphan_oom(py);
    });
    sample.context = Some(context);
    agent.reporter.send_sample(sample);
    levels
}
