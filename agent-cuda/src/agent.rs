//! The agent around a pool: a Hello that says what runs where, periodic and
//! request-boundary samples in PyTorch's vocabulary, load phases, and the
//! OOM event (sent with `send_urgent` before the pool returns its error).
//!
//! Request-path calls ([`CudaAgent::request`], [`CudaAgent::sample`],
//! [`CudaAgent::phase`], [`CudaAgent::set_context`]) only read the pool's
//! counters (and, at a request end, the RSS from `/proc/self/statm`) and
//! queue: no network. Request begins and ends go into agent-core's
//! boundary ring, and [`CudaAgent::sample`] into one pending slot; the
//! sampler thread sends them as one message at most every
//! [`MIN_BATCH_SPACING`] (20 a second at any request rate). Host readings
//! (procfs, cgroup, NVML) are taken on that thread.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use oomscope_agent_core::agent::boundary_ring::{
    self, BoundaryRing, Pacing, RssReader, Taken, MIN_BATCH_SPACING,
};
use oomscope_agent_core::agent::{
    check_interval, Flow, Identity, IntervalTooShort, Readers, Sampler,
};
use oomscope_agent_core::readers::{HostPaths, HostReader};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{lock, now_ns};

use crate::device::DeviceMemory;
use crate::pb;
use crate::pool::Pool;
use oomscope_proto::Role;

/// A full reading (host domains and allocator) this often; the collector
/// can change it with a SetSampleInterval directive. At least
/// [`oomscope_agent_core::agent::MIN_SAMPLE_INTERVAL`].
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// How long an OOM waits for the collector's ack before the error returns:
/// long enough for a loopback or LAN round trip, short enough that a dead
/// collector delays the failing request by at most this.
pub const DEFAULT_OOM_ACK_WAIT: Duration = Duration::from_secs(2);
/// The collector's default address, overridden by `OOMSCOPE_COLLECTOR`.
pub const COLLECTOR_ENV: &str = "OOMSCOPE_COLLECTOR";
/// The cudarc versions this agent builds against (reported in the Hello):
/// the application's cudarc picks the one within.
pub const CUDARC_VERSION: &str = ">=0.19.10, <0.20";

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub name: String,
    /// None: `OOMSCOPE_COLLECTOR`, else the default local collector.
    pub collector_url: Option<String>,
    pub role: String,
    pub models: Vec<pb::Model>,
    pub sample_interval: Duration,
    pub oom_ack_wait: Duration,
    pub spool_dir: Option<PathBuf>,
    pub labels: Vec<(String, String)>,
}

impl AgentConfig {
    pub fn new(name: impl Into<String>) -> Self {
        AgentConfig {
            name: name.into(),
            collector_url: None,
            role: Role::Server.into(),
            models: Vec::new(),
            sample_interval: DEFAULT_SAMPLE_INTERVAL,
            oom_ack_wait: DEFAULT_OOM_ACK_WAIT,
            spool_dir: None,
            labels: Vec::new(),
        }
    }

    fn url(&self) -> String {
        self.collector_url
            .clone()
            .or_else(|| std::env::var(COLLECTOR_ENV).ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| oomscope_proto::DEFAULT_COLLECTOR_URL.to_string())
    }
}

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

struct Inner {
    reporter: Reporter,
    context: Mutex<pb::RequestContext>,
    stats: StatsFn,
    /// The counters without their `raw` map, read at each request end.
    stats_named: StatsFn,
    snapshot: SnapshotFn,
    oom_ack_wait: Duration,
    pending: Mutex<Pending>,
    /// The RSS read at each request end, on the request's thread.
    rss: RssReader,
    pid: u32,
    /// The sampler's queue (one `Handoff` at most waits in it).
    sampler: Sampler<Job>,
    /// Whether its thread runs (false: none could be made, or it stopped).
    sampling: AtomicBool,
}

/// Reports one pool to the collector. Cheap to clone.
#[derive(Clone)]
pub struct CudaAgent {
    inner: Arc<Inner>,
}

impl CudaAgent {
    /// Starts reporting `pool`: sends the Hello, installs the pool's OOM
    /// hook, starts the sampler thread. Returns at once whether or not a
    /// collector is reachable; refuses only an interval under the floor.
    pub fn start<D: DeviceMemory, const TRACK: bool>(
        cfg: AgentConfig,
        pool: &Pool<D, TRACK>,
    ) -> Result<CudaAgent, IntervalTooShort> {
        let interval = check_interval(cfg.sample_interval)?;
        let reader = HostReader::new(HostPaths::system(), std::process::id());
        let info = pool.device().info().clone();
        let mut hello = Identity {
            name: cfg.name.clone(),
            role: cfg.role.clone(),
            rank: 0,
            runtime: "cudarc".into(),
        }
        .hello(&reader);
        hello
            .versions
            .insert("cudarc".into(), CUDARC_VERSION.into());
        hello.models = cfg.models.clone();
        // The pool's own device, not NVML's view: it is what the pool allocates on.
        hello.gpus = vec![pb::GpuPlacement {
            index: info.index,
            uuid: info.uuid.clone(),
            name: info.name.clone(),
            total_bytes: info.total_bytes,
            cap_bytes: 0,
            pci_bus_id: info.pci_bus_id.clone(),
            ordinal: Some(info.index),
            // A MIG instance's parent is not read through the driver API.
            parent_uuid: String::new(),
        }];
        hello.allocator_settings = Some(pool.settings());
        hello.labels = cfg.labels.iter().cloned().collect();
        let mut rcfg = ReporterConfig::new(cfg.url());
        rcfg.spool_dir = cfg.spool_dir.clone();
        // Its threads share the inference server's cores.
        rcfg.thread_priority = oomscope_agent_core::priority::ThreadPriority::IN_PROCESS;
        let reporter = Reporter::start(rcfg, hello);
        let (p1, p2, p3) = (pool.clone(), pool.clone(), pool.clone());
        let inner = Arc::new(Inner {
            reporter,
            context: Mutex::new(pb::RequestContext::default()),
            stats: Box::new(move || p1.stats()),
            stats_named: Box::new(move || p3.stats_named()),
            snapshot: Box::new(move || p2.snapshot()),
            oom_ack_wait: cfg.oom_ack_wait,
            pending: Mutex::new(Pending::default()),
            rss: RssReader::open(),
            pid: std::process::id(),
            sampler: Sampler::new(1),
            sampling: AtomicBool::new(false),
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        if !pool.set_oom_hook(Box::new(move |oom| {
            if let Some(inner) = weak.upgrade() {
                inner.report_oom(oom);
            }
        })) {
            tracing::warn!("oomscope: this pool already reports its OOMs elsewhere");
        }
        let reporter = inner.reporter.clone();
        let started = inner.sampler.start(
            PoolReaders {
                inner: inner.clone(),
                reader,
                full_levels: Vec::new(),
                pacing: Pacing::new(MIN_BATCH_SPACING),
            },
            reporter,
            interval,
        );
        inner.sampling.store(started, Relaxed);
        Ok(CudaAgent { inner })
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
            allocator: vec![(self.inner.stats_named)()],
            context: Some(self.context()),
            ..Default::default()
        };
        self.inner.hand_off(|p| p.sample = Some(sample));
        true
    }

    /// A phase edge (a weights load: `name` "load"), with the allocated
    /// bytes at this edge.
    pub fn phase(&self, name: &str, start: bool, model: Option<pb::Model>, error: &str) -> bool {
        let allocated = (self.inner.stats)().allocated_bytes;
        self.inner.reporter.send_event(pb::Event {
            time_ns: now_ns(),
            kind: Some(pb::event::Kind::Phase(pb::Phase {
                name: name.into(),
                start,
                model,
                allocated_bytes: allocated,
                host_rss_bytes: 0,
                error: error.into(),
            })),
        })
    }

    /// A request's begin (`boundary.start`) or end. Either goes into the
    /// boundary ring; an end with its reading (the RSS, the pool's
    /// counters, the context as set now), which the collector shows as a
    /// point. The sampler sends the ring at its pace; past
    /// `MAX_REQUESTS_PER_BATCH` ends in one message the ring keeps the
    /// extremes and counts the rest. Never blocks; true.
    pub fn request(&self, boundary: pb::RequestBoundary) -> bool {
        let time_ns = now_ns();
        if boundary.start {
            self.inner.hand_off(|p| p.ring.begin(time_ns, boundary));
            return true;
        }
        // The pool's counters before the context's lock: never both held.
        let allocator = vec![(self.inner.stats_named)()];
        let context = lock(&self.inner.context).clone();
        let end = pb::RequestReading {
            time_ns,
            boundary: Some(boundary),
            rss_bytes: self.inner.rss.read(),
            context: Some(context),
            allocator,
            ..Default::default()
        };
        self.inner.hand_off(|p| p.ring.end(end, fold_peaks));
        true
    }

    pub fn cache_release(&self, release: pb::CacheRelease) -> bool {
        self.inner.reporter.send_event(pb::Event {
            time_ns: now_ns(),
            kind: Some(pb::event::Kind::CacheRelease(release)),
        })
    }

    /// Stops the sampler, says goodbye and waits up to `timeout` for every
    /// message to be acked. Returns whether they all were.
    pub fn shutdown(self, reason: &str, exit_code: i32, timeout: Duration) -> bool {
        // The sampler sends what waits as it stops; without one, send it here.
        self.inner.sampling.store(false, Relaxed);
        self.inner.sampler.stop();
        self.inner.forward();
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
    fn allocator_sample(&self) -> pb::Sample {
        pb::Sample {
            time_ns: now_ns(),
            allocator: vec![(self.stats)()],
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
        self.send_pending(host);
    }

    /// One boundary message: `host` (the host reading taken for it)
    /// carrying what waits. It is the point of the newest reading: the
    /// pending sample if newer than the ring's newest end, else that end
    /// (its time, context and allocator); the other ends ride in it as
    /// `requests`, each a point of its own at the collector.
    fn send_pending(&self, mut host: pb::Sample) {
        let (taken, sample) = {
            let mut p = lock(&self.pending);
            (p.ring.take(), p.sample.take())
        };
        let Some(point) = boundary_point(taken, sample) else {
            return;
        };
        host.time_ns = point.time_ns;
        host.allocator = point.allocator;
        host.context = point.context;
        host.requests = point.requests;
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
/// batch. None when nothing waited.
fn boundary_point(taken: Taken, sample: Option<pb::Sample>) -> Option<pb::Sample> {
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
        (Some(s), _) => s,
        (None, Some(end)) => pb::Sample {
            time_ns: end.time_ns,
            allocator: std::mem::take(&mut end.allocator),
            context: end.context.take(),
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
struct PoolReaders {
    inner: Arc<Inner>,
    reader: HostReader,
    /// The cgroup levels of the newest periodic sample, which boundary
    /// messages carry with their usage read again.
    full_levels: Vec<pb::CgroupLevel>,
    pacing: Pacing,
}

impl Readers for PoolReaders {
    type Job = Job;

    fn tick(&mut self, reporter: &Reporter) {
        let inner = &self.inner;
        let mut sample = self.reader.sample();
        self.full_levels = sample.cgroup.clone();
        let a = inner.allocator_sample();
        sample.time_ns = a.time_ns;
        sample.allocator = a.allocator;
        sample.context = a.context;
        reporter.send_sample(sample);
    }

    fn job(&mut self, job: Job, _: &Reporter) {
        match job {
            Job::Handoff => self.pacing.signal(),
        }
    }

    fn directive(&mut self, d: pb::Directive, reporter: &Reporter) {
        let inner = &self.inner;
        if let Some(pb::directive::Kind::TakeSnapshot(_)) = d.kind {
            reporter.send_event(pb::Event {
                time_ns: now_ns(),
                kind: Some(pb::event::Kind::Snapshot((inner.snapshot)())),
            });
        }
    }

    fn poll(&mut self, _: &Reporter) -> Flow {
        if self.pacing.take_due() {
            self.inner
                .send_pending(self.reader.boundary_sample(&self.full_levels));
        }
        Flow::Continue
    }

    fn next_wake(&self) -> Option<Instant> {
        self.pacing.due()
    }

    fn stop(&mut self, _: &Reporter) {
        // The last requests are not lost to the spacing.
        self.inner
            .send_pending(self.reader.boundary_sample(&self.full_levels));
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
        let p = boundary_point(ring.take(), Some(sample(15, "decode"))).unwrap();
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
    fn a_sample_after_the_newest_end_is_the_message_and_the_ends_ride_in_it() {
        let mut ring = BoundaryRing::default();
        end(&mut ring, "a", 10, 1);
        let p = boundary_point(ring.take(), Some(sample(30, "decode"))).unwrap();
        assert_eq!(p.time_ns, 30);
        assert_eq!(p.context.unwrap().phase, "decode");
        let batch = p.requests.unwrap();
        assert_eq!(batch.readings[0].context.as_ref().unwrap().requests_done, 1);
        // Nothing waiting: no message; a sample alone: itself, no batch.
        assert!(boundary_point(BoundaryRing::default().take(), None).is_none());
        let alone = boundary_point(BoundaryRing::default().take(), Some(sample(5, "load")));
        assert!(alone.unwrap().requests.is_none());
    }
}
