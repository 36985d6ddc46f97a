//! The agent around a pool: a Hello that says what runs where, periodic and
//! request-boundary samples in PyTorch's vocabulary, load phases, and the
//! OOM event (sent with `send_urgent` before the pool returns its error).
//!
//! Request-path calls ([`CudaAgent::sample`], [`CudaAgent::phase`],
//! [`CudaAgent::set_context`]) only read the pool's counters and queue a
//! message: no network, no file reads. Host readings (procfs, cgroup, NVML)
//! are taken on the agent's own sampler thread.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use oomscope_agent_core::agent::{check_interval, Identity, IntervalTooShort, Readers, Sampler};
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
/// The cudarc version this agent is built against (reported in the Hello).
pub const CUDARC_VERSION: &str = "0.19.10";

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

struct Inner {
    reporter: Reporter,
    context: Mutex<pb::RequestContext>,
    stats: StatsFn,
    snapshot: SnapshotFn,
    oom_ack_wait: Duration,
}

/// Reports one pool to the collector. Cheap to clone.
#[derive(Clone)]
pub struct CudaAgent {
    inner: Arc<Inner>,
    // The pool's agent takes no jobs: its request path sends directly.
    sampler: Arc<Sampler<Infallible>>,
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
        let (p1, p2) = (pool.clone(), pool.clone());
        let inner = Arc::new(Inner {
            reporter,
            context: Mutex::new(pb::RequestContext::default()),
            stats: Box::new(move || p1.stats()),
            snapshot: Box::new(move || p2.snapshot()),
            oom_ack_wait: cfg.oom_ack_wait,
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        if !pool.set_oom_hook(Box::new(move |oom| {
            if let Some(inner) = weak.upgrade() {
                inner.report_oom(oom);
            }
        })) {
            tracing::warn!("oomscope: this pool already reports its OOMs elsewhere");
        }
        let sampler = Sampler::new(1);
        let reporter = inner.reporter.clone();
        sampler.start(
            PoolReaders {
                inner: inner.clone(),
                reader,
            },
            reporter,
            interval,
        );
        Ok(CudaAgent {
            inner,
            sampler: Arc::new(sampler),
        })
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

    /// A boundary sample: the allocator counters and the context. Never
    /// blocks; false when the reporter's queue is full.
    pub fn sample(&self) -> bool {
        self.inner
            .reporter
            .send_sample(self.inner.allocator_sample())
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

    pub fn request(&self, boundary: pb::RequestBoundary) -> bool {
        self.inner.reporter.send_event(pb::Event {
            time_ns: now_ns(),
            kind: Some(pb::event::Kind::Request(boundary)),
        })
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
        self.sampler.stop();
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

    fn report_oom(&self, oom: &pb::Oom) {
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

/// What the sampler thread reads: the host domains, then the pool's
/// counters, in one sample.
struct PoolReaders {
    inner: Arc<Inner>,
    reader: HostReader,
}

impl Readers for PoolReaders {
    type Job = Infallible;

    fn tick(&mut self, reporter: &Reporter) {
        let mut sample = self.reader.sample();
        let a = self.inner.allocator_sample();
        sample.time_ns = a.time_ns;
        sample.allocator = a.allocator;
        sample.context = a.context;
        reporter.send_sample(sample);
    }

    fn directive(&mut self, d: pb::Directive, reporter: &Reporter) {
        if let Some(pb::directive::Kind::TakeSnapshot(_)) = d.kind {
            reporter.send_event(pb::Event {
                time_ns: now_ns(),
                kind: Some(pb::event::Kind::Snapshot((self.inner.snapshot)())),
            });
        }
    }
}
