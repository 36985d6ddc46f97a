//! The agent of a Rust inference process: one per process, with or
//! without a device. It sends a Hello that says what runs where, periodic
//! and request-boundary samples in PyTorch's vocabulary, phases, and, for
//! each attached [`crate::TrackingPool`], its counters and OOM events (sent
//! with `send_urgent` before the pool returns its error).
//!
//! Request-path calls ([`Agent::request`] and its drop, [`Agent::sample`],
//! [`Agent::phase`], [`Agent::set_context`]) only read the pools' counters
//! (and, at a request end, the RSS from `/proc/self/statm`) and queue: no
//! network. Request begins and ends go into agent-core's boundary ring, and
//! [`Agent::sample`] into one pending slot; the sampler thread sends them
//! as one message at most every [`MIN_BATCH_SPACING`] (20 a second at any
//! request rate). Host readings (procfs, cgroup, and NVML's per-process
//! device memory in the periodic sample) are taken on that thread.

mod config;
mod guards;
mod one_per_process;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use oomscope_agent_core::agent::boundary_ring::{
    self, BoundaryRing, Pacing, RssReader, Taken, MIN_BATCH_SPACING,
};
use oomscope_agent_core::agent::{Flow, Identity, Readers, Sampler};
use oomscope_agent_core::readers::{HostPaths, HostReader};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{lock, now_ns};

use one_per_process::Registration;
/// The NVML reader [`Agent::start_with_nvml`] takes (`GpuReader::absent`: none).
pub use oomscope_agent_core::readers::gpu::GpuReader;

use crate::device::DeviceMemory;
use crate::pb;
use crate::pool::Pool;

pub use config::{
    AgentConfig, StartError, COLLECTOR_ENV, DEFAULT_OOM_ACK_WAIT, DEFAULT_SAMPLE_INTERVAL,
    DEFAULT_SHUTDOWN_WAIT, NAME_ENV, SPOOL_ENV, SUPERVISOR_ENV,
};
pub use guards::{Phase, Request, AFTER_REQUEST_PHASE};

/// The cudarc versions this agent builds against (reported in the Hello):
/// the application's cudarc picks the one within.
pub const CUDARC_VERSION: &str = ">=0.19.10, <0.20";
/// The runtime a Hello names: what reads the memory. Without a pool,
/// "rust" (host domains only); with one attached, "cudarc".
pub use oomscope_proto::{RUNTIME_CUDARC as RUNTIME_POOL, RUNTIME_RUST as RUNTIME_HOST};

type StatsFn = Box<dyn Fn() -> pb::AllocatorStats + Send + Sync>;
type SnapshotFn = Box<dyn Fn() -> pb::SnapshotSummary + Send + Sync>;

/// What the request path hands the sampler thread: the boundary ring or
/// the pending sample was empty and now holds something.
enum Job {
    Handoff,
}

/// The request path's readings, waiting for the next boundary message.
#[derive(Default)]
struct Pending {
    ring: BoundaryRing,
    /// The newest [`CudaAgent::sample`] since the last message: a newer
    /// one replaces it (only the state at the message's time is sent).
    sample: Option<pb::Sample>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.ring.is_empty() && self.sample.is_none()
    }
}

/// One attached pool, read through these.
struct Attached {
    stats: StatsFn,
    /// The counters without their `raw` map, read at each request end.
    stats_named: StatsFn,
    snapshot: SnapshotFn,
}

struct Inner {
    reporter: Reporter,
    context: Mutex<pb::RequestContext>,
    /// Every pool attached, one allocator reading each; none for a
    /// host-only agent. Written only by [`Agent::attach`].
    pools: RwLock<Vec<Attached>>,
    oom_ack_wait: Duration,
    pending: Mutex<Pending>,
    /// The RSS read at each request end, on the request's thread.
    rss: RssReader,
    pid: u32,
    /// The sampler's queue (one `Handoff` at most waits in it).
    sampler: Sampler<Job>,
    /// Whether its thread runs (false: none could be made, or it stopped).
    sampling: AtomicBool,
    /// This process's one agent until shutdown.
    registration: Registration,
}

/// This process's agent: host readings, requests and phases, and every
/// pool attached to it. Cheap to clone; one per process.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

/// The name this agent had when it served one pool only.
pub type CudaAgent = Agent;

impl Agent {
    /// Starts the agent with no device: host domains, requests, phases;
    /// the Hello reports no GPU. Sends the Hello and starts the sampler
    /// thread; returns at once whether or not a collector is reachable
    /// (an unreachable one is one warning, and messages wait in memory or
    /// the spool). Refuses a bad setting: an interval under the floor, a
    /// collector URL that is not `http://host[:port]`, and a second agent
    /// while one runs in this process ([`StartError::AlreadyRunning`]).
    pub fn start(cfg: AgentConfig) -> Result<Agent, StartError> {
        Agent::start_with_nvml(cfg, GpuReader::open)
    }

    /// [`Agent::start`] with the NVML reader `gpu` makes (called once the
    /// settings are accepted): `GpuReader::absent` where NVML must not be
    /// read (a driver that hangs on it), a scripted one in tests.
    pub fn start_with_nvml(
        cfg: AgentConfig,
        gpu: impl FnOnce() -> GpuReader,
    ) -> Result<Agent, StartError> {
        let resolved = cfg.resolve()?;
        let registration =
            Registration::take(&resolved.name).map_err(StartError::AlreadyRunning)?;
        let reader = HostReader::with_gpu(HostPaths::system(), std::process::id(), gpu());
        let mut hello = Identity {
            name: resolved.name,
            role: cfg.role.clone(),
            rank: 0,
            runtime: RUNTIME_HOST.into(),
        }
        .hello(&reader);
        hello.models = cfg.models.clone();
        hello.labels = resolved.labels.into_iter().collect();
        // The GPUs NVML sees (none on a host without one): the periodic
        // sample reads their memory per process, what a framework that
        // allocates outside any pool (candle through cudarc) uses included.
        hello.gpus = reader.gpu().placements();
        let mut rcfg = ReporterConfig::new(resolved.url);
        rcfg.spool_dir = resolved.spool_dir;
        // Its threads share the inference server's cores.
        rcfg.thread_priority = oomscope_agent_core::priority::ThreadPriority::IN_PROCESS;
        let reporter = Reporter::start(rcfg, hello);
        let inner = Arc::new(Inner {
            reporter,
            context: Mutex::new(pb::RequestContext::default()),
            pools: RwLock::new(Vec::new()),
            oom_ack_wait: cfg.oom_ack_wait,
            pending: Mutex::new(Pending::default()),
            rss: RssReader::open(),
            pid: std::process::id(),
            sampler: Sampler::new(1),
            sampling: AtomicBool::new(false),
            registration,
        });
        let reporter = inner.reporter.clone();
        let started = inner.sampler.start(
            AgentReaders {
                inner: inner.clone(),
                reader,
                full_levels: Vec::new(),
                last_gpus: Vec::new(),
                pacing: Pacing::new(MIN_BATCH_SPACING),
            },
            reporter,
            resolved.interval,
        );
        inner.sampling.store(started, Relaxed);
        Ok(Agent { inner })
    }

    /// [`Agent::start`] with `pool` attached.
    pub fn start_with_pool<D: DeviceMemory, const TRACK: bool>(
        cfg: AgentConfig,
        pool: &Pool<D, TRACK>,
    ) -> Result<Agent, StartError> {
        let agent = Agent::start(cfg)?;
        agent.attach(pool);
        Ok(agent)
    }

    /// Reports `pool` too: its device joins the Hello's GPUs, its counters
    /// every reading, its OOMs go out as events before its error returns.
    /// False when the pool already reports its OOMs to an agent (its
    /// counters are read here all the same).
    pub fn attach<D: DeviceMemory, const TRACK: bool>(&self, pool: &Pool<D, TRACK>) -> bool {
        let info = pool.device().info().clone();
        let settings = pool.settings();
        self.inner.reporter.update_hello(|h| {
            h.runtime = RUNTIME_POOL.into();
            h.versions.insert("cudarc".into(), CUDARC_VERSION.into());
            // The pool's own device, not NVML's view: it is what the pool
            // allocates on (its ordinal), in place of NVML's entry for it.
            h.gpus
                .retain(|g| info.uuid.is_empty() || g.uuid != info.uuid);
            h.gpus.push(pb::GpuPlacement {
                index: info.index,
                uuid: info.uuid.clone(),
                name: info.name.clone(),
                total_bytes: info.total_bytes,
                cap_bytes: 0,
                pci_bus_id: info.pci_bus_id.clone(),
                ordinal: Some(info.index),
                // A MIG instance's parent is not read through the driver API.
                parent_uuid: String::new(),
            });
            h.allocator_settings = Some(settings);
        });
        let (p1, p2, p3) = (pool.clone(), pool.clone(), pool.clone());
        self.inner
            .pools
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(Attached {
                stats: Box::new(move || p1.stats()),
                stats_named: Box::new(move || p3.stats_named()),
                snapshot: Box::new(move || p2.snapshot()),
            });
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let hooked = pool.set_oom_hook(Box::new(move |oom| {
            if let Some(inner) = weak.upgrade() {
                inner.report_oom(oom);
            }
        }));
        if !hooked {
            tracing::warn!("oomscope: this pool already reports its OOMs elsewhere");
        }
        hooked
    }

    /// A request begins: `let _r = agent.request(id, prompt_tokens);`. It
    /// ends when the returned [`Request`] drops (set its output tokens
    /// first). Never blocks.
    pub fn request(&self, id: impl ToString, prompt_tokens: u64) -> Request {
        Request::begin(self, id.to_string(), prompt_tokens)
    }

    /// A phase begins: `let _p = agent.phase("load");`. It ends when the
    /// returned [`Phase`] drops.
    pub fn phase(&self, name: impl Into<String>) -> Phase {
        Phase::begin(self, name.into(), None)
    }

    /// A model's load: the phase "load" naming `model`.
    pub fn load(&self, model: pb::Model) -> Phase {
        Phase::begin(self, "load".into(), Some(model))
    }

    /// Ends a request begun with [`Agent::request`]: one more done, the end
    /// reading in the ring with the context at this moment.
    fn end_request(&self, boundary: pb::RequestBoundary) {
        let context = {
            let mut c = lock(&self.inner.context);
            c.requests_done += 1;
            c.request_id = boundary.request_id.clone();
            c.prompt_tokens = boundary.prompt_tokens;
            c.output_tokens = boundary.output_tokens;
            let mut now = c.clone();
            now.phase = AFTER_REQUEST_PHASE.into();
            now
        };
        self.inner.push_end(boundary, context);
    }

    pub fn reporter(&self) -> &Reporter {
        &self.inner.reporter
    }

    /// Updates what the server says it is doing; carried by every later
    /// sample and by an OOM event.
    pub fn set_context(&self, f: impl FnOnce(&mut pb::RequestContext)) {
        f(&mut lock(&self.inner.context));
    }

    pub fn context(&self) -> pb::RequestContext {
        lock(&self.inner.context).clone()
    }

    /// A point: the allocator counters and the context now. It waits in
    /// one slot for the next boundary message (at most
    /// [`MIN_BATCH_SPACING`] away), replacing the one waiting there, so a
    /// sample per decode step costs no message of its own; a request end
    /// ([`CudaAgent::request`]) is a point by itself. Never blocks; true
    /// (kept for source compatibility: it once said the queue had room).
    pub fn sample(&self) -> bool {
        // The named counters: the periodic sample and an OOM carry `raw`.
        let sample = pb::Sample {
            time_ns: now_ns(),
            allocator: self.inner.allocators(|p| (p.stats_named)()),
            context: Some(self.context()),
            ..Default::default()
        };
        self.inner.hand_off(|p| p.sample = Some(sample));
        true
    }

    /// A phase edge (a weights load: `name` "load"), with the allocated
    /// bytes (all pools) and the RSS at this edge. [`Agent::phase`] sends
    /// both edges for you.
    pub fn phase_edge(
        &self,
        name: &str,
        start: bool,
        model: Option<pb::Model>,
        error: &str,
    ) -> bool {
        let allocated = self
            .inner
            .allocators(|p| (p.stats)())
            .iter()
            .map(|a| a.allocated_bytes)
            .sum();
        self.inner.reporter.send_event(pb::Event {
            time_ns: now_ns(),
            kind: Some(pb::event::Kind::Phase(pb::Phase {
                name: name.into(),
                start,
                model,
                allocated_bytes: allocated,
                host_rss_bytes: self.inner.rss.read(),
                error: error.into(),
            })),
        })
    }

    /// A request's begin (`boundary.start`) or end, for a program that
    /// counts its own requests (`requests_done` in [`Agent::set_context`]);
    /// [`Agent::request`] does both and the counting. Either goes into the
    /// boundary ring; an end with its reading (the RSS, the pools'
    /// counters, the context as set now), which the collector shows as a
    /// point. The sampler sends the ring at its pace; past
    /// `MAX_REQUESTS_PER_BATCH` ends in one message the ring keeps the
    /// extremes and counts the rest. Never blocks; true.
    pub fn request_boundary(&self, boundary: pb::RequestBoundary) -> bool {
        if boundary.start {
            let time_ns = now_ns();
            self.inner.hand_off(|p| p.ring.begin(time_ns, boundary));
            return true;
        }
        let context = lock(&self.inner.context).clone();
        self.inner.push_end(boundary, context);
        true
    }

    pub fn cache_release(&self, release: pb::CacheRelease) -> bool {
        self.inner.reporter.send_event(pb::Event {
            time_ns: now_ns(),
            kind: Some(pb::event::Kind::CacheRelease(release)),
        })
    }

    /// Stops the sampler, says goodbye and waits up to `timeout` for every
    /// message to be acked ([`DEFAULT_SHUTDOWN_WAIT`] is a fair one).
    /// Returns whether they all were; returns within `timeout` plus the
    /// time to stop the sampler and the reporter's threads, which never
    /// wait on the network (at most 50 ms past `timeout` for the reporter).
    pub fn shutdown(self, reason: &str, exit_code: i32, timeout: Duration) -> bool {
        // The sampler sends what waits as it stops; without one, send it here.
        self.inner.sampling.store(false, Relaxed);
        self.inner.sampler.stop();
        self.inner.forward();
        self.inner.registration.release();
        self.inner.reporter.clone().shutdown(
            pb::Goodbye {
                reason: reason.into(),
                exit_code,
            },
            timeout,
        )
    }
}

impl Inner {
    /// One reading of each attached pool.
    fn allocators<T>(&self, read: impl Fn(&Attached) -> T) -> Vec<T> {
        let pools = self.pools.read().unwrap_or_else(|e| e.into_inner());
        pools.iter().map(read).collect()
    }

    /// A request's end reading into the ring: the RSS and the pools'
    /// counters now, with `context`.
    fn push_end(&self, boundary: pb::RequestBoundary, context: pb::RequestContext) {
        let time_ns = now_ns();
        let end = pb::RequestReading {
            time_ns,
            boundary: Some(boundary),
            rss_bytes: self.rss.read(),
            context: Some(context),
            allocator: self.allocators(|p| (p.stats_named)()),
            ..Default::default()
        };
        self.hand_off(|p| p.ring.end(end, fold_peaks));
    }

    fn allocator_sample(&self) -> pb::Sample {
        pb::Sample {
            time_ns: now_ns(),
            allocator: self.allocators(|p| (p.stats)()),
            context: Some(lock(&self.context).clone()),
            ..Default::default()
        }
    }

    /// Leaves a reading in the pending slot or ring, and wakes the sampler
    /// only if nothing waited before (once per message at most). Without a
    /// sampler to take it (no thread), it is sent from here.
    fn hand_off(&self, leave: impl FnOnce(&mut Pending)) {
        let was_empty = {
            let mut p = lock(&self.pending);
            let was_empty = p.is_empty();
            leave(&mut p);
            was_empty
        };
        // A full queue already holds a Handoff for the running loop.
        if was_empty && !self.sampler.submit(Job::Handoff) && !self.sampling.load(Relaxed) {
            self.forward();
        }
    }

    /// What waits, to the reporter now, from this thread, ahead of what
    /// follows it (an OOM, a Goodbye): the RSS read here stands for the
    /// host reading the sampler would have taken.
    fn forward(&self) {
        let host = pb::Sample {
            process: Some(pb::ProcessMemory {
                pid: self.pid,
                vm_rss_bytes: self.rss.read(),
                ..Default::default()
            }),
            ..Default::default()
        };
        // No NVML here: this may be a request's thread.
        self.send_pending(host, Vec::new());
    }

    /// One boundary message: `host` (the host reading taken for it)
    /// carrying what waits. It is the point of the newest reading: the
    /// pending sample if newer than the ring's newest end, else that end
    /// (its time, context and allocator); the other ends ride in it as
    /// `requests`, each a point of its own at the collector. `gpu` (this
    /// process's NVML entries, read for this message) goes with the newest
    /// end.
    fn send_pending(&self, mut host: pb::Sample, gpu: Vec<pb::GpuProcess>) {
        let (taken, sample) = {
            let mut p = lock(&self.pending);
            (p.ring.take(), p.sample.take())
        };
        let Some(point) = boundary_point(taken, sample, gpu) else {
            return;
        };
        host.time_ns = point.time_ns;
        host.allocator = point.allocator;
        host.context = point.context;
        host.requests = point.requests;
        host.gpu_processes = point.gpu_processes;
        self.reporter.send_sample(host);
    }

    fn report_oom(&self, oom: &pb::Oom) {
        // The requests before it go first: the OOM must find them.
        self.forward();
        let mut oom = oom.clone();
        oom.context = Some(lock(&self.context).clone());
        let event = pb::Event {
            time_ns: now_ns(),
            kind: Some(pb::event::Kind::Oom(oom)),
        };
        if !self.reporter.send_urgent(event, self.oom_ack_wait) {
            tracing::warn!(
                "oomscope: the OOM event was not acked in time (kept in the spool, if any)"
            );
        }
    }
}

/// The peaks of a request end the ring thinned, carried by the next end it
/// kept: the most KV bytes, sequences and tokens any of them saw.
fn fold_peaks(newer: &mut pb::RequestContext, older: &pb::RequestContext) {
    newer.kv_cache_bytes = newer.kv_cache_bytes.max(older.kv_cache_bytes);
    newer.active_sequences = newer.active_sequences.max(older.active_sequences);
    newer.active_tokens = newer.active_tokens.max(older.active_tokens);
    newer.queued = newer.queued.max(older.queued);
    newer.batch_size = newer.batch_size.max(older.batch_size);
}

/// The sample one boundary message is (its `host` reading aside): the
/// newest of `sample` and the ring's newest end, carrying the ring's
/// batch, and `gpu` on that end (the point itself where it is the end).
/// None when nothing waited.
fn boundary_point(
    taken: Taken,
    sample: Option<pb::Sample>,
    gpu: Vec<pb::GpuProcess>,
) -> Option<pb::Sample> {
    let empty = taken.readings.is_empty() && taken.thinned.thinned_requests == 0;
    if taken.dropped > 0 {
        tracing::debug!(
            dropped = taken.dropped,
            "oomscope: request begins past the ring's bound"
        );
    }
    if empty {
        return sample;
    }
    let mut batch = taken.into_batch(fold_peaks);
    let newest_end = batch
        .readings
        .iter_mut()
        .rev()
        .find(|r| boundary_ring::is_end(r));
    // A sample after the newest end is the state now; the end stays in
    // the batch, a point of its own. Begins alone: a point now, with
    // nothing read but the host.
    let sample = sample.filter(|s| newest_end.as_ref().is_none_or(|e| s.time_ns > e.time_ns));
    let mut point = match (sample, newest_end) {
        (Some(s), end) => {
            if let Some(end) = end {
                end.gpu_processes = gpu;
            }
            s
        }
        (None, Some(end)) => pb::Sample {
            time_ns: end.time_ns,
            allocator: std::mem::take(&mut end.allocator),
            context: end.context.take(),
            gpu_processes: gpu,
            ..Default::default()
        },
        (None, None) => pb::Sample {
            time_ns: now_ns(),
            ..Default::default()
        },
    };
    point.requests = Some(batch);
    Some(point)
}

/// What the sampler thread reads: the host domains, then the pool's
/// counters, in one sample; and the request path's readings at their pace.
struct AgentReaders {
    inner: Arc<Inner>,
    reader: HostReader,
    /// The cgroup levels of the newest periodic sample, which boundary
    /// messages carry with their usage read again.
    full_levels: Vec<pb::CgroupLevel>,
    /// The newest periodic sample's NVML reading: the devices where a
    /// boundary message reads this process's entries.
    last_gpus: Vec<pb::GpuDevice>,
    pacing: Pacing,
}

impl Readers for AgentReaders {
    type Job = Job;

    fn tick(&mut self, reporter: &Reporter) {
        let inner = &self.inner;
        // One of the agent's messages under the cap (see `Pacing::wait_left`).
        std::thread::sleep(self.pacing.wait_left());
        let mut sample = self.reader.sample();
        self.full_levels = sample.cgroup.clone();
        self.last_gpus = sample.gpus.clone();
        let a = inner.allocator_sample();
        sample.time_ns = a.time_ns;
        sample.allocator = a.allocator;
        sample.context = a.context;
        reporter.send_sample(sample);
        self.pacing.sent();
    }

    fn job(&mut self, job: Job, _: &Reporter) {
        match job {
            Job::Handoff => self.pacing.signal(),
        }
    }

    fn directive(&mut self, d: pb::Directive, reporter: &Reporter) {
        let inner = &self.inner;
        if let Some(pb::directive::Kind::TakeSnapshot(_)) = d.kind {
            for snapshot in inner.allocators(|p| (p.snapshot)()) {
                reporter.send_event(pb::Event {
                    time_ns: now_ns(),
                    kind: Some(pb::event::Kind::Snapshot(snapshot)),
                });
            }
        }
    }

    fn poll(&mut self, _: &Reporter) -> Flow {
        if self.pacing.take_due() {
            self.send_boundary();
        }
        Flow::Continue
    }

    fn next_wake(&self) -> Option<Instant> {
        self.pacing.due()
    }

    fn stop(&mut self, _: &Reporter) {
        // The last requests are not lost to the spacing.
        self.send_boundary();
    }
}

impl AgentReaders {
    /// One boundary message with its host reading and this process's
    /// device memory as NVML lists it now.
    fn send_boundary(&self) {
        let host = self.reader.boundary_sample(&self.full_levels);
        let gpu = self.reader.own_gpu_processes(&self.last_gpus);
        self.inner.send_pending(host, gpu);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(ring: &mut BoundaryRing, id: &str, time_ns: i64, done: u64) {
        ring.end(
            pb::RequestReading {
                time_ns,
                boundary: Some(pb::RequestBoundary {
                    request_id: id.into(),
                    ..Default::default()
                }),
                context: Some(pb::RequestContext {
                    requests_done: done,
                    ..Default::default()
                }),
                allocator: vec![pb::AllocatorStats {
                    allocated_bytes: done,
                    ..Default::default()
                }],
                ..Default::default()
            },
            fold_peaks,
        );
    }

    fn sample(time_ns: i64, phase: &str) -> pb::Sample {
        pb::Sample {
            time_ns,
            context: Some(pb::RequestContext {
                phase: phase.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_message_is_the_newest_end_when_no_sample_came_after_it() {
        let mut ring = BoundaryRing::default();
        end(&mut ring, "a", 10, 1);
        end(&mut ring, "b", 20, 2);
        let p = boundary_point(ring.take(), Some(sample(15, "decode")), Vec::new()).unwrap();
        // The end's own time, context and counters: the collector takes it
        // for that end's point; the older sample is superseded.
        assert_eq!(p.time_ns, 20);
        assert_eq!(p.context.unwrap().requests_done, 2);
        assert_eq!(p.allocator[0].allocated_bytes, 2);
        let batch = p.requests.unwrap();
        assert_eq!(batch.readings.len(), 2);
        assert!(batch.readings[1].context.is_none(), "taken into the point");
        assert_eq!(batch.readings[0].context.as_ref().unwrap().requests_done, 1);
    }

    #[test]
    fn the_device_reading_goes_with_the_newest_end() {
        let own = |used| {
            vec![pb::GpuProcess {
                pid: 7,
                used_bytes: Some(used),
                device_uuid: "GPU-1".into(),
                ..Default::default()
            }]
        };
        // The end is the point: the point carries it.
        let mut ring = BoundaryRing::default();
        end(&mut ring, "a", 10, 1);
        end(&mut ring, "b", 20, 2);
        let p = boundary_point(ring.take(), None, own(5)).unwrap();
        assert_eq!(p.gpu_processes, own(5));
        assert!(p.requests.unwrap().readings[0].gpu_processes.is_empty());
        // A later sample is the point: the end, riding in it, carries it.
        let mut ring = BoundaryRing::default();
        end(&mut ring, "a", 10, 1);
        let p = boundary_point(ring.take(), Some(sample(30, "decode")), own(6)).unwrap();
        assert!(p.gpu_processes.is_empty());
        assert_eq!(p.requests.unwrap().readings[0].gpu_processes, own(6));
    }

    #[test]
    fn a_sample_after_the_newest_end_is_the_message_and_the_ends_ride_in_it() {
        let mut ring = BoundaryRing::default();
        end(&mut ring, "a", 10, 1);
        let p = boundary_point(ring.take(), Some(sample(30, "decode")), Vec::new()).unwrap();
        assert_eq!(p.time_ns, 30);
        assert_eq!(p.context.unwrap().phase, "decode");
        let batch = p.requests.unwrap();
        assert_eq!(batch.readings[0].context.as_ref().unwrap().requests_done, 1);
        // Nothing waiting: no message; a sample alone: itself, no batch.
        assert!(boundary_point(BoundaryRing::default().take(), None, Vec::new()).is_none());
        let alone = boundary_point(
            BoundaryRing::default().take(),
            Some(sample(5, "load")),
            Vec::new(),
        );
        assert!(alone.unwrap().requests.is_none());
    }
}
