//! The running agent: one per process. Its reporter (agent-core) streams to
//! the collector from its own thread; its sampler thread reads the host
//! domains without the GIL and the allocator with it, briefly.
//!
//! Locking rules, which keep `fork()` safe: the global slot is only taken
//! with the GIL held and never across a GIL release; the agent's own mutexes
//! are never held while waiting for the GIL. A forked child never touches the
//! parent's agent (its mutexes may have been held by a thread that does not
//! exist in the child): it leaks it and starts its own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oomscope_agent_core::agent::boundary_ring::{self, BoundaryRing, RssReader, Taken};
use oomscope_agent_core::agent::{Identity, Lineage, Sampler};
use oomscope_agent_core::priority::ThreadPriority;
use oomscope_agent_core::readers::gpu::GpuReader;
use oomscope_agent_core::readers::{HostPaths, HostReader};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{lock, now_ns, pb, torch};
use pyo3::prelude::*;

use crate::census::{self, Baseline};
use crate::config::Config;
use crate::context::{self, fold_peaks, ContextState};
use crate::devices::{Devices, Which};
use crate::torchread::{self, TorchCuda};

/// Jobs waiting for the sampler thread; past this, boundary samples are
/// dropped (and counted by the caller) rather than queued without bound.
pub const JOB_QUEUE: usize = 1024;
/// An OOM observer call with no exception seen this long after it is sent
/// on its own (the server caught the error itself).
pub const ORPHAN_OOM_AFTER: Duration = Duration::from_secs(2);
/// The share of wall time the request path may spend reading allocated
/// blocks (see `Agent::read_blocks`): at ~30 µs a read (torch imported), one
/// read every 15 ms at most. A server whose requests take longer than that
/// gets a reading at every end; a tight loop of short requests one in many,
/// and pays a fraction of a microsecond a request.
pub const BLOCKS_TIME_SHARE: f64 = 0.002;
/// Allocated blocks are read at least this often while requests end (a read
/// that happened to be slow, descheduled, does not space the next by more).
pub const MAX_BLOCKS_SPACING: Duration = Duration::from_secs(1);
/// The longest a census due by request count waits for a moment with no
/// request in flight, before it begins and again between its slices; a
/// server that is never idle gets it anyway, and a few in-flight
/// temporaries in it.
pub const CENSUS_IDLE_WAIT: Duration = Duration::from_secs(2);
/// Host processes listed at an OOM: the largest by RSS.
pub const OOM_TOP_PROCESSES: usize = 10;

/// The context phase of the sample sent just before each heap census.
pub use oomscope_proto::CENSUS_PHASE;

pub enum Job {
    /// The boundary ring was empty and now holds something: take it when
    /// the next boundary message is due (agent-core `boundary_ring`).
    Handoff,
    Census {
        budget: Duration,
        why: census::Why,
    },
    Snapshot {
        device: Option<i32>,
    },
    ProcessList,
}

/// What the OOM observer saw, waiting for the exception's text.
pub struct PendingOom {
    pub at: Instant,
    pub observer: pb::OomObserver,
    pub stats: Option<pb::AllocatorStats>,
    pub snapshot: Option<pb::SnapshotSummary>,
}

pub struct Agent {
    pub config: Config,
    pub reporter: Reporter,
    pub agent_id: String,
    pub pid: u32,
    pub context: Mutex<ContextState>,
    pub pending_oom: Mutex<Option<PendingOom>>,
    /// The request path's begin and end readings, which the sampler sends
    /// as one message at its pace (agent-core `boundary_ring`).
    pub handoff: Mutex<BoundaryRing>,
    /// The RSS read at each request end, on the request's thread.
    pub rss: RssReader,
    pub baseline: Mutex<Option<Baseline>>,
    pub torch_hooks: AtomicBool,
    /// Children forked so far, for the next child's rank.
    pub lineage: Lineage,
    /// Boundary samples and request events dropped for lack of room.
    pub boundary_dropped: AtomicU64,
    /// No allocated-blocks read at a request end before this (`now_ns`
    /// time; `read_blocks`).
    pub blocks_next_ns: AtomicI64,
    pub last_census: Mutex<Option<Instant>>,
    /// Censuses taken, and the longest any of them held the GIL at a time
    /// with the thread's CPU time in that hold, in ns (shown by `stats()`).
    /// One lock for the pair: two censuses (the sampler's and a caller's
    /// `census()`) can interleave between their slices.
    pub censuses: AtomicU64,
    pub census_longest_hold: Mutex<(u64, u64)>,
    /// Why each census ran (`stats()["census_reasons"]`).
    pub census_reasons: Mutex<census::Reasons>,
    /// A census waits for a moment with no request in flight: every request
    /// end wakes the sampler to look, not only those that find the hand-off
    /// empty.
    pub census_waiting: AtomicBool,
    /// The sampling thread (agent-core's loop; `sampler.rs` plugs in its readers).
    pub sampler: Sampler<Job>,
    /// When a held start ends on its own (None: not held, or held until
    /// something releases it). The sampler releases the reporter then,
    /// unless something released it before.
    pub hold_until: Option<Instant>,
    /// The settings a later `start()` gave this agent in place, where only
    /// its identity changed (`Config::same_identity`); a forked child
    /// starts from them. Taken only with the GIL held and never across a
    /// GIL release, like the process's slot, so a fork never finds it locked.
    pub reconfigured: Mutex<Option<Config>>,
    /// The devices the process uses, and who they are.
    pub devices: Devices,
    /// The torch hooks that could not be installed, with torch's words
    /// (`cudaMallocAsync` takes no OOM observer and keeps no history).
    pub hooks_missing: Mutex<BTreeMap<String, String>>,
    /// Started held: NVML is opened only once released (the sampler opens
    /// it), so a passing helper never reads it.
    pub nvml_deferred: bool,
    paths: HostPaths,
}

impl Agent {
    /// Starts the reporter; returns at once whether or not a collector is
    /// there. Needs the GIL for the Hello's Python facts. The sampler is
    /// started by the caller with the returned reader (see `sampler.rs`).
    pub fn start(py: Python<'_>, config: Config) -> (Arc<Agent>, HostReader) {
        let pid = std::process::id();
        let paths = HostPaths::system();
        let held = !config.hold.is_zero();
        let reader = if held {
            HostReader::with_gpu(paths.clone(), pid, GpuReader::absent())
        } else {
            HostReader::new(paths.clone(), pid)
        };
        let mut hello = Identity {
            name: config.name.clone(),
            role: config.role.clone(),
            rank: config.rank,
            runtime: "pytorch".into(),
        }
        .hello(&reader);
        let agent_id = hello.agent_id.clone();
        hello.gpus = reader.gpu().placements();
        hello.allocator_settings = Some(torchread::settings(py));
        hello.labels = config.labels.clone().into_iter().collect();
        if let Ok(v) = py
            .import("sys")
            .and_then(|s| s.getattr("version"))
            .and_then(|v| v.extract::<String>())
        {
            hello.versions.insert(
                "python".into(),
                v.split_whitespace().next().unwrap_or("").to_string(),
            );
        }
        hello.versions.extend(torchread::versions(py));
        if let Ok(argv) = py
            .import("sys")
            .and_then(|s| s.getattr("argv"))
            .and_then(|a| a.extract::<Vec<String>>())
        {
            hello.command = argv;
        }
        if let Some(m) = &config.model {
            hello.models.push(context::model_pb(m, 0));
        }
        let mut rc = ReporterConfig::new(config.collector.clone());
        rc.spool_dir = config.spool_dir.clone();
        rc.unacked_max_bytes = usize::try_from(config.buffer_max_bytes).unwrap_or(usize::MAX);
        rc.spool_max_bytes = config.spool_max_bytes;
        rc.hold = held;
        rc.thread_priority = ThreadPriority {
            nice: config.thread_nice,
            ..ThreadPriority::IN_PROCESS
        };
        // Only a supervised process is released by lasting (see
        // `DEFAULT_AUTOSTART_HOLD`); any other stays held until it serves a
        // request, uses CUDA, hits an OOM or calls start()/flush().
        let hold_until = (rc.hold && config.supervised).then(|| Instant::now() + config.hold);
        let reporter = Reporter::start(rc, hello);
        let agent = Arc::new(Agent {
            config,
            reporter,
            agent_id,
            pid,
            context: Mutex::new(ContextState::default()),
            pending_oom: Mutex::new(None),
            handoff: Mutex::new(BoundaryRing::default()),
            rss: RssReader::open(),
            baseline: Mutex::new(None),
            torch_hooks: AtomicBool::new(false),
            lineage: Lineage::default(),
            boundary_dropped: AtomicU64::new(0),
            blocks_next_ns: AtomicI64::new(0),
            last_census: Mutex::new(None),
            censuses: AtomicU64::new(0),
            census_longest_hold: Mutex::new((0, 0)),
            census_reasons: Mutex::new(census::Reasons::default()),
            census_waiting: AtomicBool::new(false),
            sampler: Sampler::new(JOB_QUEUE),
            hold_until,
            reconfigured: Mutex::new(None),
            devices: Devices::default(),
            hooks_missing: Mutex::new(BTreeMap::new()),
            nvml_deferred: held,
            paths,
        });
        (agent, reader)
    }

    /// Hands a job to the sampler; false (and counted) when its queue is full.
    pub fn submit(&self, job: Job) -> bool {
        let queued = self.sampler.submit(job);
        if !queued {
            self.boundary_dropped.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    /// Leaves a request boundary's reading in the ring, and wakes the
    /// sampler only if it was empty (or, at a request `end`, while a census
    /// waits for no request in flight). Without a sampler to take it (no
    /// thread, or its queue full) the ring is sent from here.
    fn hand_off(&self, end: bool, leave: impl FnOnce(&mut BoundaryRing)) {
        let was_empty = {
            let mut h = lock(&self.handoff);
            let was_empty = h.is_empty();
            leave(&mut h);
            was_empty
        };
        let census = end && self.census_waiting.load(Ordering::Relaxed);
        if !(was_empty || census) {
            return;
        }
        if !self.sampler.submit(Job::Handoff) && was_empty {
            self.forward_events();
        }
    }

    /// The ring's readings to the reporter now, from this thread, ahead of
    /// what follows them (an OOM, a flush): one message with the process's
    /// RSS read here (the sampler's host reading is not waited for).
    pub fn forward_events(&self) {
        let taken = lock(&self.handoff).take();
        if taken.readings.is_empty() && taken.thinned.thinned_requests == 0 {
            self.count_dropped(taken.dropped);
            return;
        }
        let host = pb::Sample {
            process: oomscope_agent_core::readers::process::read(&self.paths, self.pid).ok(),
            ..Default::default()
        };
        self.send_batch(host, taken);
    }

    /// One boundary message: `host` (the readings taken for it) carrying
    /// the batch `taken`. It is the boundary point of the batch's newest
    /// end (that end's time and context); a batch of begins alone is a
    /// point now, with the context now.
    pub fn send_batch(&self, mut host: pb::Sample, taken: Taken) {
        self.count_dropped(taken.dropped);
        let mut batch = taken.into_batch(fold_peaks);
        match batch
            .readings
            .iter_mut()
            .rev()
            .find(|r| boundary_ring::is_end(r))
        {
            Some(newest) => {
                host.time_ns = newest.time_ns;
                host.context = newest.context.take();
            }
            None => {
                host.time_ns = now_ns();
                let c = lock(&self.context);
                let phase = if c.phase.is_empty() {
                    context::PERIODIC_PHASE
                } else {
                    ""
                };
                host.context = Some(c.to_pb(phase));
            }
        }
        host.requests = Some(batch);
        self.reporter.send_sample(host);
    }

    /// Readings the ring had no room for (`stats()["boundary_dropped"]`).
    pub fn count_dropped(&self, dropped: u64) {
        if dropped > 0 {
            self.boundary_dropped.fetch_add(dropped, Ordering::Relaxed);
        }
    }

    pub fn send_event(&self, kind: pb::event::Kind) -> bool {
        self.reporter.send_event(pb::Event {
            time_ns: now_ns(),
            kind: Some(kind),
        })
    }

    pub fn host_rss(&self) -> u64 {
        oomscope_agent_core::readers::process::read(&self.paths, self.pid)
            .map_or(0, |p| p.vm_rss_bytes)
    }

    /// The settings it runs with: as started, or as a later `start()`
    /// re-configured its identity. Needs the GIL (see `reconfigured`).
    pub fn settings(&self, _py: Python<'_>) -> Config {
        lock(&self.reconfigured)
            .clone()
            .unwrap_or_else(|| self.config.clone())
    }

    /// Says the identity in `config` (name, role, rank, model, labels) in a
    /// new Hello, on the open stream and at every reconnect; the agent id,
    /// spool and stream stay. Needs the GIL (see `reconfigured`).
    pub fn reconfigure_identity(&self, _py: Python<'_>, config: Config) {
        self.reporter.update_hello(|h| {
            h.name.clone_from(&config.name);
            h.role.clone_from(&config.role);
            h.rank = config.rank;
            h.models = config
                .model
                .iter()
                .map(|m| context::model_pb(m, 0))
                .collect();
            h.labels.extend(config.labels.clone());
        });
        *lock(&self.reconfigured) = Some(config);
    }

    /// Ends a held start now: this process is no passing helper. One
    /// atomic load once released, so the request path calls it every time.
    pub fn release(&self) {
        self.reporter.release();
    }

    /// A request the runtime reports once it finished (a vLLM stat logger
    /// sees requests only then): its start event stamped `started_ns_ago`
    /// back, then its end as `request_end` records it.
    pub fn record_request(
        &self,
        id: &str,
        started_ns_ago: i64,
        prompt_tokens: u64,
        output_tokens: u64,
        max_tokens: u64,
    ) {
        self.begin_at(
            now_ns().saturating_sub(started_ns_ago.max(0)),
            id,
            prompt_tokens,
            max_tokens,
        );
        self.request_end(id, output_tokens, "");
    }

    pub fn request_begin(&self, id: &str, prompt_tokens: u64, max_tokens: u64) {
        self.begin_at(now_ns(), id, prompt_tokens, max_tokens);
    }

    /// A request in flight from `time_ns`: counted, and its begin left in
    /// the ring. The thread's current device is noted (spaced).
    fn begin_at(&self, time_ns: i64, id: &str, prompt_tokens: u64, max_tokens: u64) {
        self.release();
        Python::attach(|py| self.devices.note_current_spaced(py));
        lock(&self.context).begin(id, prompt_tokens, max_tokens);
        let start = pb::RequestBoundary {
            request_id: id.to_string(),
            start: true,
            prompt_tokens,
            max_tokens,
            ..Default::default()
        };
        self.hand_off(false, |ring| ring.begin(time_ns, start));
    }

    /// The request's end reading (its facts, the RSS, the context and, so
    /// often, the allocated blocks) into the ring, for the sampler thread
    /// to send with the others at its pace (agent-core `boundary_ring`).
    /// The allocator is read there, once a message: it costs ~250 us on a
    /// GPU (measured on the H200), which a request thread must not pay.
    pub fn request_end(&self, id: &str, output_tokens: u64, error: &str) {
        let time_ns = now_ns();
        let (context, done) = {
            let mut c = lock(&self.context);
            c.end(id, output_tokens, !error.is_empty());
            (c.take_pb("after_request"), c.requests_done)
        };
        let end = pb::RequestReading {
            time_ns,
            boundary: Some(pb::RequestBoundary {
                request_id: id.to_string(),
                start: false,
                output_tokens,
                error: error.to_string(),
                ..Default::default()
            }),
            rss_bytes: self.rss.read(),
            context: Some(context),
            allocated_blocks: self.read_blocks(time_ns),
            ..Default::default()
        };
        self.hand_off(true, |ring| ring.end(end, fold_peaks));
        let every = self.config.census_every;
        if every > 0 && done % every == 0 {
            self.submit(Job::Census {
                budget: self.config.census_budget,
                why: census::Why::Every,
            });
        }
    }

    /// `sys.getallocatedblocks()` on the request thread (which holds the GIL
    /// already) at `now`, unless too soon: CPython walks every arena for it
    /// (30 to 40 µs with torch imported), so the next read waits its measured
    /// cost over [`BLOCKS_TIME_SHARE`]. Spaced by time, not by a count of
    /// requests, so slow requests are read at every end and a tight loop
    /// pays the same share of its time. 0 when not read this time.
    fn read_blocks(&self, now: i64) -> u64 {
        if now < self.blocks_next_ns.load(Ordering::Relaxed) {
            return 0;
        }
        let t = Instant::now();
        let blocks = Python::attach(allocated_blocks);
        let wait = t
            .elapsed()
            .div_f64(BLOCKS_TIME_SHARE)
            .min(MAX_BLOCKS_SPACING);
        self.blocks_next_ns.store(
            now.saturating_add(wait.as_nanos() as i64),
            Ordering::Relaxed,
        );
        blocks
    }

    /// A load (or other phase) edge: device and host bytes now, over every
    /// device the process uses (a load may spread a model over several).
    /// Returns the device bytes, so the end can tell how much the load added.
    pub fn phase_edge(
        &self,
        py: Python<'_>,
        name: &str,
        start: bool,
        model: Option<crate::config::ModelSpec>,
        error: &str,
        before: u64,
    ) -> u64 {
        self.devices.note_current(py);
        let allocated = self
            .devices
            .read(py, Which::Scan)
            .iter()
            .fold(0u64, |sum, a| sum.saturating_add(a.allocated_bytes));
        {
            let mut c = lock(&self.context);
            c.phase = if start {
                name.to_string()
            } else {
                String::new()
            };
            if let (false, true, Some(m)) = (start, error.is_empty(), &model) {
                c.loaded(m.clone(), allocated.saturating_sub(before));
            }
        }
        let bytes = if start {
            0
        } else {
            allocated.saturating_sub(before)
        };
        self.send_event(pb::event::Kind::Phase(pb::Phase {
            name: name.to_string(),
            start,
            model: model.as_ref().map(|m| context::model_pb(m, bytes)),
            allocated_bytes: allocated,
            host_rss_bytes: self.host_rss(),
            error: error.to_string(),
        }));
        allocated
    }

    /// The OOM observer: the allocator as it failed, kept until the
    /// exception's text arrives (or sent alone, see [`ORPHAN_OOM_AFTER`]).
    pub fn oom_observed(&self, py: Python<'_>, observer: pb::OomObserver) {
        self.release();
        let device = i32::try_from(observer.device).ok();
        let stats = device.and_then(|d| self.devices.read_one(py, d));
        let snapshot = device.and_then(|d| torchread::snapshot(py, d));
        *lock(&self.pending_oom) = Some(PendingOom {
            at: Instant::now(),
            observer,
            stats,
            snapshot,
        });
    }

    /// An out-of-memory exception on its way up: everything known about it,
    /// spooled and acked (bounded by `oom_wait`) before it propagates. Called
    /// on the thread that caught it. Without the observer (it did not fire,
    /// or cannot attach: `cudaMallocAsync`) the failing device is the one its
    /// text names, else this thread's current device.
    pub fn oom_exception(&self, py: Python<'_>, error_type: &str, error_text: &str) -> bool {
        let pending = lock(&self.pending_oom)
            .take()
            .filter(|p| p.at.elapsed() < Duration::from_secs(30));
        let (observer, mut stats, mut snapshot) = match pending {
            Some(p) => (Some(p.observer), p.stats, p.snapshot),
            None => (None, None, None),
        };
        if stats.is_none() {
            let device = oomscope_analysis::oom_text_ordinal(error_text)
                .or_else(|| TorchCuda::get(py).and_then(|c| c.current_device()))
                .or_else(|| self.devices.first_in_use());
            stats = device.and_then(|d| self.devices.read_one(py, d));
        }
        if snapshot.is_none() {
            snapshot = stats
                .as_ref()
                .and_then(|s| torchread::snapshot(py, s.device));
        }
        let context = lock(&self.context).to_pb("oom"); // vocab: a phase
        let oom = torch::oom_event(
            observer,
            error_type,
            error_text,
            stats,
            snapshot,
            Some(context),
        );
        self.deliver_oom(py, oom)
    }

    /// An observer call that no exception followed.
    pub fn orphan_oom(&self, py: Python<'_>) {
        let stale = {
            let mut p = lock(&self.pending_oom);
            if p.as_ref()
                .is_some_and(|p| p.at.elapsed() >= ORPHAN_OOM_AFTER)
            {
                p.take()
            } else {
                None
            }
        };
        if let Some(p) = stale {
            let context = lock(&self.context).to_pb("oom"); // vocab: a phase
            let oom =
                torch::oom_event(Some(p.observer), "", "", p.stats, p.snapshot, Some(context));
            self.deliver_oom(py, oom);
        }
    }

    fn deliver_oom(&self, py: Python<'_>, mut oom: pb::Oom) -> bool {
        // A device failed (the observer fired, or a device was read for it):
        // say which by identity.
        oom.device_uuid = match &oom.stats {
            Some(s) if s.device == oom.device && !s.device_uuid.is_empty() => s.device_uuid.clone(),
            _ if oom.observer.is_some() || oom.stats.is_some() => self.devices.uuid(py, oom.device),
            _ => String::new(),
        };
        let event = pb::Event {
            time_ns: now_ns(),
            kind: Some(pb::event::Kind::Oom(oom)),
        };
        // The requests in flight start before the OOM on the stream.
        self.forward_events();
        let wait = self.config.oom_wait;
        let reporter = self.reporter.clone();
        let acked = py.detach(move || reporter.send_urgent(event, wait));
        self.submit(Job::ProcessList);
        acked
    }

    /// A heap census now, on this thread (GIL held in slices), sent as an event.
    /// A sample with the context goes first, so the census's place in the
    /// request count is on record (the census message has no field for it).
    pub fn census(
        &self,
        py: Python<'_>,
        budget: Duration,
        why: census::Why,
        sizing: census::Sizing,
        between_requests: bool,
    ) -> PyResult<pb::HeapCensus> {
        let (done, context) = {
            let c = lock(&self.context);
            (c.requests_done, c.to_pb(CENSUS_PHASE))
        };
        self.reporter.send_sample(pb::Sample {
            time_ns: now_ns(),
            process: oomscope_agent_core::readers::process::read(&self.paths, self.pid).ok(),
            allocator: self.devices.read(py, Which::Known),
            context: Some(context),
            ..Default::default()
        });
        let mut baseline = lock(&self.baseline).take();
        let idle = || lock(&self.context).in_flight.is_empty();
        let between = between_requests.then_some((&idle as census::Idle, CENSUS_IDLE_WAIT));
        let result = census::run(py, budget, done, &mut baseline, sizing, between).map(|mut c| {
            // Its slices let requests run: one that ended after the sample
            // above may have left its objects in the counts, or not.
            c.requests_ended_during = lock(&self.context).requests_done.saturating_sub(done);
            c
        });
        *lock(&self.baseline) = baseline;
        if self.config.census_trim {
            py.detach(crate::own_heap::trim_after_census);
        }
        *lock(&self.last_census) = Some(Instant::now());
        let c = result?;
        self.censuses.fetch_add(1, Ordering::Relaxed);
        lock(&self.census_reasons).record(why, done);
        {
            let mut longest = lock(&self.census_longest_hold);
            if c.longest_hold_ns > longest.0 {
                *longest = (c.longest_hold_ns, c.longest_hold_cpu_ns);
            }
        }
        self.send_event(pb::event::Kind::HeapCensus(c.clone()));
        Ok(c)
    }

    /// A snapshot summary of `device` (None: the first device in use).
    pub fn snapshot(&self, py: Python<'_>, device: Option<i32>) -> Option<pb::SnapshotSummary> {
        let s = torchread::snapshot(py, device.or_else(|| self.devices.first_in_use())?)?;
        self.send_event(pb::event::Kind::Snapshot(s.clone()));
        Some(s)
    }

    /// Stops the sampler, sends the Goodbye and waits (GIL released) up to
    /// `exit_flush` for the collector's acks.
    /// A held agent says nothing, not even Goodbye (see agent-core's reporter).
    pub fn stop(&self, py: Python<'_>, reason: &str, exit_code: i32) -> bool {
        // The sampler takes the GIL for its readings: it must be released
        // while the sampler finishes.
        py.detach(|| {
            self.sampler.stop();
            self.goodbye(reason, exit_code)
        })
    }

    /// Stops the sampler (GIL released), leaving the stream open for a
    /// Goodbye that comes later, without Python (see `exit`).
    pub fn stop_sampler(&self, py: Python<'_>) {
        py.detach(|| self.sampler.stop());
    }

    /// Sends the Goodbye and waits up to `exit_flush` for the acks. Touches
    /// no Python: the caller has released the GIL, or the interpreter is gone.
    pub fn goodbye(&self, reason: &str, exit_code: i32) -> bool {
        let goodbye = pb::Goodbye {
            reason: reason.to_string(),
            exit_code,
        };
        self.reporter
            .clone()
            .shutdown(goodbye, self.config.exit_flush)
    }
}

/// `sys.getallocatedblocks()`: the interpreter's live small-object blocks,
/// 0 where it cannot be read.
pub fn allocated_blocks(py: Python<'_>) -> u64 {
    py.import("sys")
        .and_then(|s| s.getattr("getallocatedblocks")?.call0()?.extract::<u64>())
        .unwrap_or(0)
}
