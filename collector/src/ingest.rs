//! The collector's shared state and its ingest: agents stream in
//! (`AgentService.Connect`); `serve.rs` puts this beside `QueryService`.
//!
//! Ingest rule: a batch of messages is written in one durable transaction and
//! only then acked, so an ack is the agent's licence to forget a message.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Result};
// No poisoning: a panic in one call must not stop the collector serving;
// the data behind these locks (a connection, a map) stays usable.
use futures::FutureExt;
use oomscope_proto::MAX_MESSAGE_BYTES;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::auth::TokenName;
use crate::correlate;
use crate::incidents;
use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::agent_service_server::AgentService;
use crate::pb::collector_message::Body as Reply;
use crate::store::{
    now_ns, Backend, Correlation, FileWatch, ReaderPool, Received, Store, StreamPlace, WriterLock,
    MAX_RETENTION_BATCH, MAX_SEQ,
};

/// How long a new stream may take to send its Hello before it is closed: an
/// agent opens its stream when its Hello is ready (agent-core queues it
/// first), so a silent stream is a stuck or hostile client holding a task.
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after a stream ends the collector hands freed memory back to
/// the system (and so at most how often): long enough that a herd of
/// agents leaving costs one trim, short enough that RSS follows within
/// seconds.
pub const TRIM_INTERVAL: Duration = Duration::from_secs(1);

/// How many times a trim waits another [`TRIM_INTERVAL`] for streams to
/// stop ending: RSS follows a fleet that leaves over a minute, too.
pub const MAX_TRIM_DELAYS: usize = 10;

/// Gives the allocator's free memory back to the system (glibc only; a
/// no-op elsewhere).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heap; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Messages decoded and not yet stored, across every stream: a PyTorch
/// sample rebuilt with complete counters is ~10 KB in memory (122 keyed
/// counters), 20x its wire form, so 2,000 agents with 32 in flight each
/// held 1.3 GB. A stream woken by a message takes permits for a whole batch
/// ([`MAX_BATCH`]) before it decodes the rest, and returns those it did not
/// use; past this many it waits, the rest staying in the connection's
/// buffers as they came (flow control slows the agent). So at most this
/// many plus one per stream are held decoded (~2.8 KB each: ~23 MB, and
/// ~6 MB more for 2,000 streams). Taking the permits after a stream had
/// decoded its batch held 2,000 x 32 in the closed-loop bench (179 MiB of
/// the collector's 448 MiB heap peak).
pub const MAX_DECODED_MESSAGES: usize = 8192;

/// At most this many ready messages go into one transaction (and one ack run).
const MAX_BATCH: usize = 256;

/// What a collector with a shared store keeps of the streams it serves in
/// its own (in-memory) store, for its detectors: the longest window one reads
/// is 5 minutes (`FleetPolicy`'s crash-loop and baseline windows), so an
/// hour keeps them whole with room, and bounds the memory by an hour of the
/// streams this collector serves. Queries read the shared store.
pub const DEFAULT_WORKING_WINDOW: Duration = Duration::from_secs(3600);

/// How a shared store correlates the incidents collectors file: the rule
/// the embedded store runs, over the longest span it relates incidents
/// across (a crash loop gathers its service's failed starts that far back).
const SHARED_CORRELATION: Correlation = Correlation {
    settle: correlate::settle,
    window_ns: correlate::CRASH_LOOP_FOLD_NS,
};

/// How often retention looks for rows past the window: old rows appear as
/// time passes, a few minutes' worth at a time.
pub const RETENTION_INTERVAL: Duration = Duration::from_secs(5 * 60);

/// The shared state of a running collector: the store, the connected agents
/// and their directive queues. Cheap to clone.
#[derive(Clone)]
pub struct Collector {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    store: Mutex<Store>,
    /// Group commit of the agents' batches (started with the first one).
    writer: std::sync::OnceLock<Result<crate::writer::Writer, String>>,
    /// Read-only connections for queries (a file store only): with WAL they
    /// read while an ingest writes and beside each other, so a heavy query
    /// never holds back an agent's acks or another query.
    readers: Option<Arc<ReaderPool>>,
    /// The store's files as opened: every write first checks that the path
    /// still names them (see [`FileWatch`]).
    file: Option<Mutex<FileWatch>>,
    /// The store of record when it is not the embedded file: a PostgreSQL
    /// shared by several collectors (see [`Collector::with_shared_store`]).
    shared: Option<Arc<dyn Backend>>,
    /// The tokens calls must carry (None: no authentication).
    pub(crate) tokens: Option<crate::auth::Tokens>,
    /// Serve TLS with this (None: plaintext).
    pub(crate) tls: Option<tonic::transport::ServerTlsConfig>,
    /// Held while serving: no second collector writes the file.
    _writer_lock: Option<WriterLock>,
    /// Why the collector stopped serving: a write found its store gone.
    pub(crate) fatal: Mutex<Option<String>>,
    lost_grace: Duration,
    hello_timeout: Duration,
    /// How long the writer holds a group for more streams' batches.
    gather_wait: Duration,
    /// Agent streams past their Hello now (what the writer gathers from).
    streams: std::sync::atomic::AtomicUsize,
    fleet: crate::fleet::FleetPolicy,
    links: Mutex<HashMap<String, Link>>,
    next_generation: AtomicU64,
    /// Permits for [`MAX_DECODED_MESSAGES`].
    decoded: Arc<tokio::sync::Semaphore>,
    /// A memory trim is scheduled (see `Collector::schedule_trim`).
    trim_pending: std::sync::atomic::AtomicBool,
    /// Streams ended so far: a scheduled trim waits until they stop.
    stream_ends: AtomicU64,
    /// Resent seqs refused because their content differs from the stored.
    conflicts: AtomicU64,
    /// What `/metrics` shows.
    metrics: Arc<crate::metrics::Metrics>,
    pub(crate) stopping: watch::Sender<bool>,
}

impl Inner {
    /// Fails once the store's files were deleted or replaced: a write would
    /// then go where the next start never looks, so nothing more is acked
    /// and the collector stops, loudly, once (see `serve_with_listener`).
    fn check_file(&self) -> Result<()> {
        let Some(watch) = &self.file else {
            return Ok(());
        };
        let Err(e) = watch.lock().check() else {
            return Ok(());
        };
        let mut fatal = self.fatal.lock();
        if fatal.is_none() {
            tracing::error!(
                "{e:#}: nothing more is acked and the collector stops; start it again to open \
                 the store afresh (agents resend what was not acked)"
            );
            *fatal = Some(format!("{e:#}"));
            let _ = self.stopping.send(true);
        }
        Err(e)
    }
}

impl crate::writer::StoreOwner for Inner {
    fn store_for_writing(&self) -> Option<parking_lot::MutexGuard<'_, Store>> {
        let store = self.store.lock();
        self.check_file().is_ok().then_some(store)
    }

    fn streams(&self) -> usize {
        self.streams.load(Ordering::Relaxed)
    }

    fn gather_wait(&self) -> Duration {
        self.gather_wait
    }
}

/// The newest stream of one agent. `directives` is None once it ended; the
/// generation stays so that a lost-check can tell whether the agent came back.
struct Link {
    generation: u64,
    directives: Option<mpsc::Sender<pb::Directive>>,
}

impl Collector {
    pub fn new(store: Store, lost_grace: Duration) -> Collector {
        Self::with_fleet_policy(store, lost_grace, crate::fleet::FleetPolicy::default())
    }

    /// A collector whose crash-loop and restart-storm detectors use `fleet`.
    pub fn with_fleet_policy(
        store: Store,
        lost_grace: Duration,
        fleet: crate::fleet::FleetPolicy,
    ) -> Collector {
        Collector {
            inner: Arc::new(Inner {
                store: Mutex::new(store),
                writer: std::sync::OnceLock::new(),
                readers: None,
                shared: None,
                file: None,
                _writer_lock: None,
                tokens: None,
                tls: None,
                fatal: Mutex::new(None),
                lost_grace,
                hello_timeout: DEFAULT_HELLO_TIMEOUT,
                gather_wait: crate::writer::DEFAULT_GATHER_WAIT,
                streams: std::sync::atomic::AtomicUsize::new(0),
                fleet,
                links: Mutex::new(HashMap::new()),
                next_generation: AtomicU64::new(1),
                decoded: Arc::new(tokio::sync::Semaphore::new(MAX_DECODED_MESSAGES)),
                trim_pending: std::sync::atomic::AtomicBool::new(false),
                stream_ends: AtomicU64::new(0),
                conflicts: AtomicU64::new(0),
                metrics: Arc::new(crate::metrics::Metrics::new()),
                stopping: watch::channel(false).0,
            }),
        }
    }

    /// Queries go through `readers` (see [`ReaderPool`]); call before the
    /// collector is shared.
    pub fn with_readers(mut self, readers: ReaderPool) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.readers = Some(Arc::new(readers)),
            None => tracing::warn!("the collector is already shared; queries use the writer"),
        }
        self
    }

    /// Writes check `watch` first, and stop the collector once it fails;
    /// call before the collector is shared.
    pub fn with_file_watch(mut self, watch: FileWatch) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.file = Some(Mutex::new(watch)),
            None => tracing::warn!("the collector is already shared; its store is not watched"),
        }
        self
    }

    /// Makes `shared` the store of record (a PostgreSQL several collectors
    /// share): a batch is acked once `shared` holds it, duplicates and
    /// conflicts are judged there, token bindings, agents and incidents live
    /// there, and agent and incident queries answer from it for the whole
    /// fleet. The collector's own store (in memory) keeps the streams it
    /// serves, for its incident and fleet detectors and for timelines and
    /// diagnoses. Call before the collector is shared.
    pub fn with_shared_store(mut self, shared: Arc<dyn Backend>) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.shared = Some(shared),
            None => tracing::warn!("the collector is already shared; its store stays its own"),
        }
        self
    }

    /// The shared store of record, if any (see [`Collector::with_shared_store`]).
    pub fn shared_store(&self) -> Option<Arc<dyn Backend>> {
        self.inner.shared.clone()
    }

    /// Runs `f` on the shared store on a blocking thread; None without one.
    async fn on_shared<R, F>(&self, f: F) -> Option<Result<R>>
    where
        F: FnOnce(&dyn Backend) -> Result<R> + Send + 'static,
        R: Send + 'static,
    {
        let shared = self.inner.shared.clone()?;
        Some(
            tokio::task::spawn_blocking(move || f(&*shared))
                .await
                .map_err(|e| anyhow!("a shared-store task failed: {e}"))
                .and_then(|r| r),
        )
    }

    /// Files in the shared store the incidents this collector just stored
    /// in its own (`filed`, leaders and parts alike, see
    /// [`Store::incidents_after`]): the shared store keeps one per event
    /// whichever collector saw it, numbers them, and correlates each with
    /// what every collector filed near it (see [`Backend::file_incident`]).
    /// Returns those that stand on their own there. Without a shared store,
    /// `recorded` (this store's own leaders) as it is.
    async fn share_incidents(
        &self,
        recorded: Vec<pb::Incident>,
        filed: Vec<pb::Incident>,
    ) -> Vec<pb::Incident> {
        if self.inner.shared.is_none() {
            return recorded;
        }
        if filed.is_empty() {
            return Vec::new();
        }
        let shared = self
            .on_shared(move |s| {
                let mut own = Vec::new();
                for inc in filed {
                    let inc = pb::Incident {
                        id: String::new(),
                        parts: Vec::new(),
                        ..inc
                    };
                    own.extend(s.file_incident(&inc, SHARED_CORRELATION)?);
                }
                Ok(own)
            })
            .await;
        match shared {
            Some(Ok(own)) => own,
            Some(Err(e)) => {
                tracing::error!("recording incidents in the shared store failed: {e:#}");
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    /// Every call must carry one of `tokens`, and an agent id stays with the
    /// token that first used it; call before the collector is shared.
    pub fn with_tokens(mut self, tokens: crate::auth::Tokens) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.tokens = Some(tokens),
            None => tracing::warn!("the collector is already shared; tokens are not checked"),
        }
        self
    }

    /// Serves TLS with `tls`; call before the collector is shared.
    pub fn with_tls(mut self, tls: tonic::transport::ServerTlsConfig) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.tls = Some(tls),
            None => tracing::warn!("the collector is already shared; it serves plaintext"),
        }
        self
    }

    /// Whether it serves TLS.
    pub fn serves_tls(&self) -> bool {
        self.inner.tls.is_some()
    }

    /// Holds `lock` for as long as the collector lives; call before the
    /// collector is shared.
    pub fn with_writer_lock(mut self, lock: WriterLock) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner._writer_lock = Some(lock),
            None => tracing::warn!("the collector is already shared; its lock is not held"),
        }
        self
    }

    /// Closes a stream that sends no Hello within `timeout` (default
    /// [`DEFAULT_HELLO_TIMEOUT`]); call before the collector is shared.
    pub fn with_hello_timeout(mut self, timeout: Duration) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.hello_timeout = timeout,
            None => tracing::warn!("the collector is already shared; the Hello timeout stays"),
        }
        self
    }

    /// Holds each group transaction open up to `wait` for other streams'
    /// batches (default [`crate::writer::DEFAULT_GATHER_WAIT`]; zero
    /// commits what is ready at once); call before the collector is shared.
    pub fn with_gather_wait(mut self, wait: Duration) -> Collector {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.gather_wait = wait,
            None => tracing::warn!("the collector is already shared; the gather wait stays"),
        }
        self
    }

    /// Resent seqs refused so far because their content differed from what
    /// was stored at that seq (see [`crate::store::BatchOutcome::conflicting`]).
    pub fn conflicting_resends(&self) -> u64 {
        self.inner.conflicts.load(Ordering::Relaxed)
    }

    /// Completes once the collector begins to stop (a signal, or its store
    /// went away): what serves beside it (`/metrics`) stops then too.
    pub fn until_stopping(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut stopping = self.inner.stopping.subscribe();
        async move {
            let _ = stopping.wait_for(|s| *s).await;
        }
    }

    /// Deletes what is older than `window` now and every
    /// [`RETENTION_INTERVAL`], in batches of [`MAX_RETENTION_BATCH`] rows per
    /// table, each its own group part (ingest goes on between them), until
    /// the collector stops; from the shared store too, if any.
    pub fn retain(&self, window: Duration) {
        self.prune_every_interval(window, true);
    }

    /// Keeps `window` of the streams this collector serves in its own store
    /// when a shared store is the store of record (see
    /// [`DEFAULT_WORKING_WINDOW`]): its memory stays bounded without `--retain`.
    pub fn keep_own_for(&self, window: Duration) {
        self.prune_every_interval(window, false);
    }

    fn prune_every_interval(&self, window: Duration, shared_too: bool) {
        let collector = self.clone();
        let stop = self.until_stopping();
        tokio::spawn(async move {
            let prune = async {
                loop {
                    let cutoff =
                        now_ns().saturating_sub(window.as_nanos().min(i64::MAX as u128) as i64);
                    let mut total = 0u64;
                    let shared = match shared_too {
                        true => collector.on_shared(move |s| s.prune_before(cutoff)).await,
                        false => None,
                    };
                    if let Some(r) = shared {
                        match r {
                            Ok(n) => total += n,
                            Err(e) => {
                                tracing::error!("retention of the shared store failed: {e:#}")
                            }
                        }
                    }
                    loop {
                        match collector
                            .write(move |s| s.prune_before(cutoff, MAX_RETENTION_BATCH))
                            .await
                        {
                            Ok(0) => break,
                            Ok(n) => total += n,
                            Err(e) => {
                                tracing::error!("retention failed: {e:#}");
                                break;
                            }
                        }
                    }
                    if total > 0 {
                        tracing::info!(rows = total, ?window, "retention deleted old rows");
                    }
                    tokio::time::sleep(RETENTION_INTERVAL).await;
                }
            };
            tokio::select! {
                _ = prune => {}
                _ = stop => {}
            }
        });
    }

    /// The collector's Prometheus metrics.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.inner.metrics
    }

    /// What a `/metrics` scrape answers now.
    pub fn render_metrics(&self) -> String {
        self.metrics().render(self.connected_agents() as i64)
    }

    /// Agents with a stream open to this collector now.
    pub fn connected_agents(&self) -> usize {
        self.inner
            .links
            .lock()
            .values()
            .filter(|l| l.directives.is_some())
            .count()
    }

    /// Runs `f` on the store on a blocking thread: SQLite calls block.
    pub async fn with_store<R, F>(&self, f: F) -> Result<R>
    where
        F: FnOnce(&mut Store) -> Result<R> + Send + 'static,
        R: Send + 'static,
    {
        self.on_store(f).await
    }

    /// Runs `f` on the store in the writer's next group transaction (see
    /// `writer.rs`); returns once that group is durably committed.
    pub async fn write<R, F>(&self, f: F) -> Result<R>
    where
        F: FnOnce(&mut Store) -> Result<R> + Send + 'static,
        R: Send + 'static,
    {
        let writer = self.inner.writer.get_or_init(|| {
            crate::writer::Writer::start(&self.inner).map_err(|e| format!("{e:#}"))
        });
        match writer {
            Ok(writer) => writer.write(f).await,
            Err(e) => Err(anyhow!("{e}")),
        }
    }

    /// (group transactions committed, agent batches in them) so far: how
    /// far the writer shares its commits (see `writer.rs`).
    pub fn group_commits(&self) -> (u64, u64) {
        match self.inner.writer.get() {
            Some(Ok(w)) => w.counts(),
            _ => (0, 0),
        }
    }

    /// Like [`Collector::with_store`] for reading: on a read-only
    /// connection of the pool when there is one, else on the writer's.
    pub async fn with_reader_store<R, F>(&self, f: F) -> Result<R>
    where
        F: FnOnce(&mut Store) -> Result<R> + Send + 'static,
        R: Send + 'static,
    {
        match &self.inner.readers {
            Some(pool) => pool.read(f).await,
            None => self.on_store(f).await,
        }
    }

    async fn on_store<R, F>(&self, f: F) -> Result<R>
    where
        F: FnOnce(&mut Store) -> Result<R> + Send + 'static,
        R: Send + 'static,
    {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let mut store = inner.store.lock();
            inner.check_file()?;
            f(&mut store)
        })
        .await
        .map_err(|e| anyhow!("a store task failed: {e}"))?
    }

    /// Queues a directive for a connected agent; never waits.
    pub fn directive(&self, agent_id: &str, directive: pb::Directive) -> Result<()> {
        let links = self.inner.links.lock();
        let tx = links
            .get(agent_id)
            .and_then(|l| l.directives.as_ref())
            .ok_or_else(|| anyhow!("agent {agent_id:?} is not connected"))?;
        tx.try_send(directive).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                anyhow!("agent {agent_id:?} has too many directives queued; try again later")
            }
            mpsc::error::TrySendError::Closed(_) => anyhow!("agent {agent_id:?} just disconnected"),
        })
    }

    /// Ids of the agents with a live stream now.
    pub fn connected(&self) -> Vec<String> {
        let links = self.inner.links.lock();
        let mut ids: Vec<String> = links
            .iter()
            .filter(|(_, l)| l.directives.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    fn register(&self, agent_id: &str, directives: mpsc::Sender<pb::Directive>) -> u64 {
        let generation = self.inner.next_generation.fetch_add(1, Ordering::Relaxed);
        self.inner.links.lock().insert(
            agent_id.to_string(),
            Link {
                generation,
                directives: Some(directives),
            },
        );
        generation
    }

    fn unregister(&self, agent_id: &str, generation: u64) {
        if let Some(link) = self.inner.links.lock().get_mut(agent_id) {
            if link.generation == generation {
                link.directives = None;
            }
        }
    }

    /// Drops the agent's link once stream `generation` (its last) has ended
    /// and nothing more waits on it: the map holds live agents, not every
    /// agent ever seen.
    fn forget_link(&self, agent_id: &str, generation: u64) {
        let mut links = self.inner.links.lock();
        if links
            .get(agent_id)
            .is_some_and(|l| l.generation == generation && l.directives.is_none())
        {
            links.remove(agent_id);
        }
    }

    /// Returns the memory of streams that ended to the system, at most once
    /// per [`TRIM_INTERVAL`]: glibc keeps freed memory in its arenas, so
    /// 2,000 agents' buffers stayed resident (421 MiB) after they all left.
    ///
    /// The trim runs once no stream has ended for a whole interval (or
    /// after [`MAX_TRIM_DELAYS`] of them): a trim in the middle of a herd
    /// leaving returns only what the streams before it freed.
    fn schedule_trim(&self) {
        self.inner.stream_ends.fetch_add(1, Ordering::AcqRel);
        if self.inner.trim_pending.swap(true, Ordering::AcqRel) {
            return;
        }
        let inner = self.inner.clone();
        tokio::spawn(async move {
            // Streams that keep ending (a fleet restarting) still get a trim.
            for _ in 0..MAX_TRIM_DELAYS {
                let ends = inner.stream_ends.load(Ordering::Acquire);
                tokio::time::sleep(TRIM_INTERVAL).await;
                if inner.stream_ends.load(Ordering::Acquire) == ends {
                    break;
                }
            }
            inner.trim_pending.store(false, Ordering::Release);
            let _ = tokio::task::spawn_blocking(move || {
                // The writer's page cache first, so the trim returns it too.
                if let Err(e) = inner.store.lock().release_cache() {
                    tracing::debug!("releasing the store's page cache: {e:#}");
                }
                release_free_memory();
            })
            .await;
        });
    }

    /// True when stream `generation` was the agent's last and it has ended.
    fn still_gone(&self, agent_id: &str, generation: u64) -> bool {
        self.inner
            .links
            .lock()
            .get(agent_id)
            .is_some_and(|l| l.generation == generation && l.directives.is_none())
    }

    /// After `lost_grace`, records the agent as lost unless a newer stream of
    /// it exists by then: here, or (with a shared store) a Hello recorded
    /// after `hello_ns`, this stream's own, through any collector. (Not
    /// after the break: a reconnect may reach another collector before this
    /// one notices the break. Collectors' clocks must be in step, as NTP keeps them.)
    fn schedule_lost_check(
        &self,
        agent_id: String,
        generation: u64,
        broke_at_ns: i64,
        hello_ns: i64,
    ) {
        let collector = self.clone();
        let grace = self.inner.lost_grace;
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let c = collector.clone();
            let id = agent_id.clone();
            // The check runs under the store lock, and a reconnect registers
            // before it writes "connected": so either the check sees the new
            // stream, or its "lost" is overwritten by the reconnect.
            // Back through another collector of the shared store.
            let elsewhere = collector
                .on_shared({
                    let id = agent_id.clone();
                    move |s| s.hello_since(&id, hello_ns)
                })
                .await;
            if let Some(Ok(true)) = elsewhere {
                tracing::info!(
                    agent_id,
                    "reconnected to another collector within the grace period"
                );
                collector.forget_link(&agent_id, generation);
                return;
            }
            let outcome = collector
                .with_store(move |store| {
                    // Gone from the links, and not since settled by a
                    // Goodbye or a delivered spool.
                    if !c.still_gone(&id, generation)
                        || store.state(&id)?.as_deref() != Some("connected")
                    {
                        return Ok(None);
                    }
                    store.set_state(&id, "lost", now_ns())?;
                    let mark = store.incident_mark()?;
                    let lost = incidents::record_lost(store, &id, broke_at_ns, grace)?;
                    let fleet = incidents::check_fleet(store, &id, &c.inner.fleet, now_ns())?;
                    if c.inner.shared.is_none() {
                        for inc in &fleet {
                            log_incident(inc);
                            c.inner.metrics.incident(inc);
                        }
                    }
                    // "lost", or "ended" (a probe, or with its instance).
                    let state = store.state(&id)?.unwrap_or_else(|| "lost".into());
                    Ok(Some((lost, store.incidents_after(mark)?, state)))
                })
                .await;
            if let (Ok(Some((_, _, state))), Some(shared)) =
                (&outcome, collector.inner.shared.clone())
            {
                let (id, state) = (agent_id.clone(), state.clone());
                let _ =
                    tokio::task::spawn_blocking(move || shared.set_state(&id, &state, now_ns()))
                        .await;
            }
            let outcome = match outcome {
                Ok(Some((lost, filed, _))) => Ok(Some(
                    collector.share_incidents(Vec::from_iter(lost), filed).await,
                )),
                Ok(None) => Ok(None),
                Err(e) => Err(e),
            };
            match outcome {
                Ok(Some(own)) => {
                    for inc in &own {
                        log_incident(inc);
                        collector.inner.metrics.incident(inc);
                    }
                }
                Ok(None) => tracing::debug!(agent_id, "reconnected within the grace period"),
                Err(e) => tracing::error!(agent_id, "recording a lost agent failed: {e:#}"),
            }
            collector.forget_link(&agent_id, generation);
        });
    }

    /// A stream that carried the Goodbye numbered `goodbye_seq` has ended:
    /// an agent whose messages just before it never came (its process
    /// ended first, see [`crate::store::Store::unsent_before`]) is
    /// [`oomscope_proto::EVIDENCE_INCOMPLETE_STATE`], not "disconnected".
    async fn check_goodbye_tail(&self, agent_id: String, goodbye_seq: u64) {
        let id = agent_id.clone();
        let outcome = self
            .with_store(move |store| {
                let unsent = store.unsent_before(&id, goodbye_seq)?;
                // A reconnect since, or a delivered spool, settled it otherwise.
                if unsent > 0 && store.state(&id)?.as_deref() == Some("disconnected") {
                    store.set_state(&id, oomscope_proto::EVIDENCE_INCOMPLETE_STATE, now_ns())?;
                }
                Ok(unsent)
            })
            .await;
        if let Ok(1..) = outcome {
            let id = agent_id.clone();
            let marked = self
                .on_shared(move |s| match s.state(&id)?.as_deref() {
                    Some("disconnected") => {
                        s.set_state(&id, oomscope_proto::EVIDENCE_INCOMPLETE_STATE, now_ns())
                    }
                    _ => Ok(()),
                })
                .await;
            if let Some(Err(e)) = marked {
                tracing::error!(
                    agent_id,
                    "marking incomplete evidence in the shared store failed: {e:#}"
                );
            }
        }
        match outcome {
            Ok(0) => {}
            Ok(unsent) => tracing::warn!(
                agent_id,
                unsent,
                "said Goodbye, but its last messages never arrived: evidence incomplete"
            ),
            Err(e) => tracing::error!(agent_id, "checking a Goodbye's evidence failed: {e:#}"),
        }
    }

    /// A dead agent's spool was delivered: it died without a Goodbye.
    async fn recovered(&self, agent_id: String) {
        let id = agent_id.clone();
        let recorded = self
            .with_store(move |store| {
                let mark = store.incident_mark()?;
                let inc = incidents::record_recovered(store, &id)?;
                Ok((inc, store.incidents_after(mark)?))
            })
            .await;
        let recorded = match recorded {
            Ok((inc, filed)) => Ok(self.share_incidents(Vec::from_iter(inc), filed).await.pop()),
            Err(e) => Err(e),
        };
        match recorded {
            Ok(Some(inc)) => {
                log_incident(&inc);
                self.inner.metrics.incident(&inc);
            }
            Ok(None) => tracing::info!(agent_id, "a dead agent's spool was delivered"),
            Err(e) => tracing::error!(agent_id, "recording a recovered agent failed: {e:#}"),
        }
    }

    /// Agents the store still calls connected (the collector restarted under
    /// them) get the same grace to reconnect as a broken stream.
    pub(crate) async fn watch_stale_agents(&self) {
        let stale = match self.with_store(|s| s.connected_agents()).await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::error!("listing agents left connected: {e:#}");
                return;
            }
        };
        for agent_id in stale {
            let generation = self.inner.next_generation.fetch_add(1, Ordering::Relaxed);
            self.inner
                .links
                .lock()
                .entry(agent_id.clone())
                .or_insert(Link {
                    generation,
                    directives: None,
                });
            let now = now_ns();
            self.schedule_lost_check(agent_id, generation, now, now);
        }
    }
}

/// One line per recorded incident, the same wherever it was found.
fn log_incident(inc: &pb::Incident) {
    tracing::warn!(
        agent_id = inc.agent_id,
        incident = inc.id,
        kind = inc.kind,
        domain = inc.domain,
        // Agent-supplied text: no raw escapes or newlines in the log.
        "{}",
        inc.summary.escape_debug()
    );
}

pub(crate) struct AgentApi {
    pub(crate) collector: Collector,
}

type ReplyTx = mpsc::Sender<Result<pb::CollectorMessage, Status>>;

#[tonic::async_trait]
impl AgentService for AgentApi {
    type ConnectStream = ReceiverStream<Result<pb::CollectorMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let peer = request.remote_addr();
        let token = request.extensions().get::<TokenName>().cloned();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(session(
            self.collector.clone(),
            request.into_inner(),
            tx,
            peer,
            token,
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// How a session ended.
enum End {
    /// The agent closed its side (after a Goodbye, or not).
    Eof,
    /// The stream failed: malformed or oversized message, reset, ...
    Failed(Status),
    /// The agent stopped listening to our replies.
    Gone,
    /// We could not store: the agent must resend later.
    StoreFailed,
    Shutdown,
}

async fn session(
    collector: Collector,
    mut inbound: Streaming<pb::AgentMessage>,
    tx: ReplyTx,
    peer: Option<SocketAddr>,
    token: Option<TokenName>,
) {
    let waited = collector.inner.hello_timeout;
    let first = match tokio::time::timeout(waited, inbound.message()).await {
        Ok(first) => first,
        Err(_) => {
            tracing::warn!(
                ?peer,
                "closed a stream that sent no Hello within {waited:?}"
            );
            let _ = tx
                .send(Err(Status::deadline_exceeded(format!(
                    "no Hello within {waited:?}: open the stream when the Hello is ready"
                ))))
                .await;
            return;
        }
    };
    let hello = match first {
        Ok(Some(pb::AgentMessage {
            body: Some(Body::Hello(h)),
            ..
        })) if !h.agent_id.is_empty() => h,
        Ok(Some(first)) => {
            let reason = "the first message must be a Hello with an agent_id".to_string();
            tracing::warn!(?peer, seq = first.seq, "rejected a stream: {reason}");
            let _ = tx.send(Ok(reject(first.seq, &reason))).await;
            let _ = tx.send(Err(Status::invalid_argument(reason))).await;
            return;
        }
        Ok(None) => return,
        Err(status) => {
            let status = explain(&status, "(before its Hello)", 0);
            tracing::warn!(
                ?peer,
                "a stream failed before its Hello: {}",
                status.message()
            );
            let _ = tx.send(Err(status)).await;
            return;
        }
    };
    let agent_id = hello.agent_id.clone();
    // Before anything of the agent's is touched, its link included.
    if let Some(TokenName(token)) = token {
        let id = agent_id.clone();
        let bound = match collector.inner.shared.is_some() {
            true => {
                let token = token.clone();
                collector
                    .on_shared(move |s| Ok(s.bind_token(&id, &token)? == token))
                    .await
                    .expect("a shared store")
            }
            false => {
                collector
                    .with_store(move |s| Ok(s.bind_token(&id, &token)? == token))
                    .await
            }
        };
        let refusal = match bound {
            Ok(true) => None,
            // The holder's name is not told: names say who else sends here.
            Ok(false) => Some(Status::permission_denied(format!(
                "agent id {agent_id:?} belongs to another token: each agent id stays with the \
                 token that first used it; give this agent its own id or its own token"
            ))),
            Err(e) => Some(Status::unavailable(format!(
                "the collector could not check the agent's token: {e:#}"
            ))),
        };
        if let Some(status) = refusal {
            tracing::warn!(agent_id, ?peer, "refused a stream: {}", status.message());
            let _ = tx.send(Err(status)).await;
            return;
        }
    }
    // A dead agent's spool, delivered by another process: no live link (no
    // directives, no reconnect to wait for).
    let recovery = hello.recovery;
    let (dtx, mut directives) = mpsc::channel(16);
    // Counted before it can send a batch (and before `connected` lists it).
    let live = LiveStream::count(&collector.inner.streams);
    // Register before writing "connected": see schedule_lost_check.
    let generation = (!recovery).then(|| collector.register(&agent_id, dtx));
    let stored_hello = hello.clone();
    let shared_hello = hello.clone();
    let mut hello_ns = now_ns();
    let recorded = match collector
        .on_shared(move |s| s.record_hello(&shared_hello, hello_ns))
        .await
    {
        Some(Err(e)) => Err(e),
        _ => {
            collector
                .with_store(move |s| s.record_hello(&stored_hello, hello_ns))
                .await
        }
    };
    if let Err(e) = recorded {
        tracing::error!(agent_id, "storing the Hello failed: {e:#}");
        if let Some(generation) = generation {
            collector.unregister(&agent_id, generation);
        }
        let _ = tx
            .send(Err(Status::unavailable(format!(
                "the collector could not store the Hello: {e:#}"
            ))))
            .await;
        return;
    }
    match recovery {
        true => tracing::info!(
            agent_id,
            name = hello.name,
            ?peer,
            "receiving a dead agent's spool"
        ),
        false => tracing::info!(agent_id, name = hello.name, ?peer, "agent connected"),
    }

    let mut stopping = collector.inner.stopping.subscribe();
    let mut said_goodbye = false;
    // The stored Goodbye's seq, if this stream carried one.
    let mut goodbye_seq = None;
    let mut last_seq = 0u64;
    // Samples may carry their allocator counters as changes against the
    // previous sample of this stream: followed here, stored as they came.
    let mut counters = StreamCounters::new();
    let end = loop {
        tokio::select! {
            biased;
            // Map away the guard: it is not Send.
            _ = stopping.wait_for(|s| *s).map(|_| ()) => break End::Shutdown,
            Some(d) = directives.recv() => {
                if tx.send(Ok(pb::CollectorMessage { body: Some(Reply::Directive(d)) })).await.is_err() {
                    break End::Gone;
                }
            }
            next = inbound.message() => {
                let first = match next {
                    Ok(Some(m)) => m,
                    Ok(None) => break End::Eof,
                    Err(status) => break End::Failed(status),
                };
                // Permits for a whole batch before the rest is decoded, the
                // unused returned at once: what waits for the writer waits
                // undecoded (see MAX_DECODED_MESSAGES).
                let Ok(mut permits) =
                    collector.inner.decoded.clone().acquire_many_owned(MAX_BATCH as u32).await
                else {
                    break End::StoreFailed;
                };
                let (batch, pending_end) = drain_ready(&mut inbound, first);
                drop(permits.split(MAX_BATCH - batch.len()));
                match ingest(&collector, &hello, &mut counters, batch, permits, &tx).await {
                    Ok(outcome) => {
                        said_goodbye |= outcome.goodbye;
                        goodbye_seq = outcome.goodbye_seq.or(goodbye_seq);
                        last_seq = last_seq.max(outcome.max_seq);
                        hello_ns = outcome.rehello_ns.unwrap_or(hello_ns);
                        if !outcome.replies_delivered {
                            break End::Gone;
                        }
                    }
                    Err(()) => break End::StoreFailed,
                }
                if let Some(end) = pending_end {
                    break end;
                }
            }
        }
    };
    drop(live);
    if let Some(generation) = generation {
        collector.unregister(&agent_id, generation);
    }
    // What the writer held for this stream goes (a reconnect starts afresh).
    let id = agent_id.clone();
    let _ = collector
        .with_store(move |s| {
            s.forget_agent(&id);
            Ok(())
        })
        .await;

    match &end {
        // An agent that said Goodbye, or a spool delivery that is done, may
        // drop the connection without closing its half of the stream (the
        // HTTP/2 reset is then only noise; what was stored is acked).
        End::Failed(status) if said_goodbye || recovery => {
            tracing::debug!(agent_id, code = ?status.code(), "stream reset after Goodbye or delivery: {}", status.message());
        }
        End::Failed(status) => {
            let status = explain(status, &agent_id, last_seq);
            tracing::warn!(agent_id, code = ?status.code(), "stream failed: {}", status.message());
            let _ = tx.send(Err(status)).await;
        }
        End::Shutdown => {
            let _ = tx
                .send(Err(Status::unavailable(
                    "the collector is shutting down; reconnect later",
                )))
                .await;
        }
        _ => {}
    }
    collector.schedule_trim();
    // Only a lost-check (below) still needs the link.
    let awaits_lost_check =
        !said_goodbye && !matches!(end, End::Shutdown | End::StoreFailed) && !recovery;
    if let (Some(generation), false) = (generation, awaits_lost_check) {
        collector.forget_link(&agent_id, generation);
    }
    match (end, generation) {
        // State "connected" stays in the store; the next start gives the
        // agent its grace to come back.
        (End::Shutdown, _) => tracing::info!(agent_id, "stream closed for shutdown"),
        (_, _) if said_goodbye => {
            tracing::info!(agent_id, "agent disconnected (Goodbye)");
            if let Some(seq) = goodbye_seq {
                collector.check_goodbye_tail(agent_id, seq).await;
            }
        }
        // Our fault, not the agent's: it will reconnect and resend.
        (End::StoreFailed, _) => {}
        (_, None) => collector.recovered(agent_id).await,
        (_, Some(generation)) => {
            tracing::info!(
                agent_id,
                "stream ended without a Goodbye; waiting {:?} for a reconnect",
                collector.inner.lost_grace
            );
            collector.schedule_lost_check(agent_id, generation, now_ns(), hello_ns);
        }
    }
}

/// Counts a stream in [`Inner::streams`] while it lives.
struct LiveStream<'a>(&'a std::sync::atomic::AtomicUsize);

impl LiveStream<'_> {
    fn count(streams: &std::sync::atomic::AtomicUsize) -> LiveStream<'_> {
        streams.fetch_add(1, Ordering::Relaxed);
        LiveStream(streams)
    }
}

impl Drop for LiveStream<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// `first` plus whatever else has already arrived, up to MAX_BATCH, so one
/// transaction (one fsync) covers a burst. Also returns how the stream ended
/// if it ended while draining; the messages before that still get stored.
fn drain_ready(
    inbound: &mut Streaming<pb::AgentMessage>,
    first: pb::AgentMessage,
) -> (Vec<pb::AgentMessage>, Option<End>) {
    let mut batch = vec![first];
    while batch.len() < MAX_BATCH {
        // `message()` keeps its state in the stream, so dropping an unready
        // future loses nothing.
        match inbound.message().now_or_never() {
            None => break,
            Some(Ok(Some(m))) => batch.push(m),
            Some(Ok(None)) => return (batch, Some(End::Eof)),
            Some(Err(status)) => return (batch, Some(End::Failed(status))),
        }
    }
    (batch, None)
}

struct IngestOutcome {
    goodbye: bool,
    /// The seq of the Goodbye stored from this batch.
    goodbye_seq: Option<u64>,
    max_seq: u64,
    replies_delivered: bool,
    /// When a Hello the stream sent again was recorded (see
    /// `Collector::schedule_lost_check`: a Hello after it is another stream's).
    rehello_ns: Option<i64>,
}

/// A batch could not be stored: nothing of it is acked, and the stream
/// ends so that the agent reconnects and resends.
async fn store_failed(tx: &ReplyTx, agent_id: &str, e: &anyhow::Error) {
    tracing::error!(agent_id, "storing a batch failed, nothing acked: {e:#}");
    let _ = tx
        .send(Err(Status::unavailable(format!(
            "the collector could not store your messages ({e:#}); reconnect and resend"
        ))))
        .await;
}

/// One stream's allocator counters as its samples arrive: each sample's
/// changes rest on the stream's previous sample (`oomscope_proto::delta`).
struct StreamCounters {
    decoder: oomscope_proto::delta::Decoder,
    stream: u64,
    /// Samples with allocator stats decoded so far, stored or not.
    decoded: u64,
}

impl StreamCounters {
    fn new() -> StreamCounters {
        StreamCounters {
            decoder: Default::default(),
            stream: crate::store::new_stream(),
            decoded: 0,
        }
    }

    /// `msg` ready for the store: as it came, with its place in the stream
    /// and its complete counters beside it (the writer stores its changes
    /// as they are where they continue a chain); with `complete`, rebuilt
    /// whole (a shared store of record takes only complete messages).
    fn take(
        &mut self,
        mut msg: pb::AgentMessage,
        complete: bool,
    ) -> Result<Received, oomscope_proto::delta::DeltaError> {
        let follows = matches!(&msg.body, Some(Body::Sample(s)) if !s.allocator.is_empty());
        // Counted even when it fails: it may have moved the stream's
        // counters, so the next sample does not continue a chain from the
        // one before it.
        self.decoded += u64::from(follows);
        if complete {
            self.decoder.decode(&mut msg)?;
            return Ok(Received { msg, place: None });
        }
        let counters = self.decoder.follow(&msg)?;
        Ok(Received {
            place: follows.then_some(StreamPlace {
                stream: self.stream,
                n: self.decoded,
                complete: counters,
            }),
            msg,
        })
    }
}

/// Stores one batch, records its incidents, then acks what is stored.
async fn ingest(
    collector: &Collector,
    hello: &pb::Hello,
    counters: &mut StreamCounters,
    batch: Vec<pb::AgentMessage>,
    // Held until the batch is stored: bounds what every stream together
    // holds decoded (see MAX_DECODED_MESSAGES).
    _decoded: tokio::sync::OwnedSemaphorePermit,
    tx: &ReplyTx,
) -> Result<IngestOutcome, ()> {
    let agent_id = hello.agent_id.clone();
    let mut rejects = Vec::new();
    let mut storable = Vec::with_capacity(batch.len());
    let mut goodbye = None;
    let mut goodbye_seq = None;
    let mut rehello = None;
    let complete = collector.inner.shared.is_some();
    for msg in batch {
        // In stream order, every message: the next one's changes rest on it.
        let seq = msg.seq;
        let received = match counters.take(msg, complete) {
            Ok(received) => received,
            Err(e) => {
                rejects.push(reject(seq, &e.to_string()));
                continue;
            }
        };
        let msg = &received.msg;
        match &msg.body {
            Some(Body::Hello(h)) if h.agent_id == agent_id => rehello = Some(h.clone()),
            Some(Body::Hello(h)) => rejects.push(reject(
                msg.seq,
                &format!(
                    "this stream belongs to agent {agent_id:?}, not {:?}; open a new stream",
                    h.agent_id
                ),
            )),
            None => rejects.push(reject(msg.seq, "a message without a body")),
            Some(Body::Goodbye(g)) => {
                goodbye = Some(g.clone());
                match msg.seq {
                    0 => {}
                    seq if seq > MAX_SEQ => rejects.push(seq_too_large(seq)),
                    seq => {
                        goodbye_seq = Some(seq);
                        storable.push(received)
                    }
                }
            }
            Some(_) if msg.seq == 0 => {
                rejects.push(reject(0, "samples and events are numbered from seq 1"))
            }
            // Alone: one bad seq must not cost the batch its acks.
            Some(_) if msg.seq > MAX_SEQ => rejects.push(seq_too_large(msg.seq)),
            Some(_) => storable.push(received),
        }
    }
    let max_seq = storable.iter().map(|r| r.msg.seq).max().unwrap_or(0);
    let metrics = collector.inner.metrics.clone();
    metrics.received(
        storable.len() as u64,
        storable
            .iter()
            .map(|r| prost::Message::encoded_len(&r.msg) as u64)
            .sum(),
    );
    let sampled_by = hello.clone();
    let has_goodbye = goodbye.is_some();
    let id = agent_id.clone();
    let fleet = collector.inner.fleet.clone();
    let writing = std::time::Instant::now();
    let rehello_ns = rehello.is_some().then(now_ns);
    // A shared store of record judges and holds the batch first: what it
    // stored is what the agent is acked, whichever collector stored it before.
    let shared_outcome = match collector.inner.shared.is_some() {
        false => None,
        true => {
            let batch: Vec<pb::AgentMessage> = storable.iter().map(|r| r.msg.clone()).collect();
            let (id, rehello) = (id.clone(), rehello.clone());
            let shared = collector
                .on_shared(move |s| {
                    if let Some(h) = &rehello {
                        s.record_hello(h, rehello_ns.unwrap_or_else(now_ns))?;
                    }
                    let outcome = s.insert_batch(&id, &batch)?;
                    if has_goodbye {
                        s.set_state(&id, "disconnected", now_ns())?;
                    }
                    Ok(outcome)
                })
                .await;
            match shared {
                Some(Ok(outcome)) => Some(outcome),
                Some(Err(e)) => {
                    store_failed(tx, &agent_id, &e).await;
                    return Err(());
                }
                None => None,
            }
        }
    };
    // What the shared store refused stays out of this collector's own.
    let storable: Vec<_> = match &shared_outcome {
        Some(o) if !o.conflicting.is_empty() => storable
            .into_iter()
            .filter(|r| o.conflicting.binary_search(&r.msg.seq).is_err())
            .collect(),
        _ => storable,
    };
    let sharing = shared_outcome.is_some();
    // Acked only once the group this batch joins is committed.
    let result = collector
        .write(move |store| {
            if let Some(h) = &rehello {
                store.record_hello(h, now_ns())?;
            }
            let outcome = store.insert_batch(&id, &storable)?;
            // The newest fresh sample is the agent's latest reading; read
            // into /metrics after the write, off the writer's thread.
            let latest = storable
                .iter()
                .map(|r| &r.msg)
                .filter(|m| outcome.fresh.binary_search(&m.seq).is_ok())
                .filter_map(|m| match &m.body {
                    Some(Body::Sample(s)) => Some((m.seq, s)),
                    _ => None,
                })
                .max_by_key(|(seq, _)| *seq)
                .map(|(_, s)| s.clone());
            // What was refused raises nothing: its seq holds other content.
            let storable: Vec<_> = match outcome.conflicting.is_empty() {
                true => storable,
                false => storable
                    .into_iter()
                    .filter(|r| outcome.conflicting.binary_search(&r.msg.seq).is_err())
                    .collect(),
            };
            // An incident that fails to record must not cost the agent its
            // ack: the messages are stored, and a resend would retry it.
            // Only events start incidents: a batch of samples skips the check.
            let events: Vec<pb::AgentMessage> = storable
                .iter()
                .filter(|r| is_event(&r.msg))
                .map(|r| r.msg.clone())
                .collect();
            // What this batch files here, for the shared store (see
            // `share_incidents`); nothing to read without one.
            let mark = match sharing {
                true => store.incident_mark()?,
                false => 0,
            };
            let mut recorded = match events.is_empty() {
                false => incidents::record(store, &id, &events).unwrap_or_else(|e| {
                    tracing::error!(agent_id = id, "recording incidents failed: {e:#}");
                    Vec::new()
                }),
                true => Vec::new(),
            };
            // A death or a request may complete a fleet pattern (crash loop, restart storm).
            if recorded
                .iter()
                .any(|i| i.kind != oomscope_proto::IncidentKind::Oom)
                || storable.iter().any(|r| is_request_event(&r.msg))
            {
                match incidents::check_fleet(store, &id, &fleet, now_ns()) {
                    Ok(found) => recorded.extend(found),
                    Err(e) => {
                        tracing::error!(agent_id = id, "checking fleet patterns failed: {e:#}")
                    }
                }
            }
            if has_goodbye {
                store.set_state(&id, "disconnected", now_ns())?;
            }
            let filed = match sharing {
                true => store.incidents_after(mark)?,
                false => Vec::new(),
            };
            Ok((outcome, recorded, latest, filed))
        })
        .await;
    collector.inner.metrics.store_write(writing.elapsed());
    let (outcome, recorded) = match result {
        Ok((outcome, recorded, latest, filed)) => {
            if let Some(sample) = latest {
                metrics.sample(&sampled_by, &sample, std::time::Instant::now());
            }
            match shared_outcome {
                Some(shared) => (shared, collector.share_incidents(recorded, filed).await),
                None => (outcome, recorded),
            }
        }
        Err(e) => {
            store_failed(tx, &agent_id, &e).await;
            return Err(());
        }
    };
    for inc in &recorded {
        log_incident(inc);
        collector.inner.metrics.incident(inc);
    }
    if !outcome.conflicting.is_empty() {
        collector
            .inner
            .conflicts
            .fetch_add(outcome.conflicting.len() as u64, Ordering::Relaxed);
        collector
            .inner
            .metrics
            .conflicting(outcome.conflicting.len() as u64);
        tracing::warn!(
            agent_id,
            seqs = ?outcome.conflicting,
            "refused resent seqs whose content differs from the stored"
        );
    }
    let conflicts = outcome.conflicting.iter().map(|&seq| {
        reject(
            seq,
            &format!(
                "seq {seq} of agent {agent_id} is already stored with other content; the stored \
                 message is kept (another process may be sending as this agent, or the agent \
                 reused its id after losing its spool)"
            ),
        )
    });
    if let Some(g) = &goodbye {
        tracing::info!(
            agent_id,
            reason = g.reason,
            exit_code = g.exit_code,
            "Goodbye"
        );
    }
    let mut delivered = true;
    let replies =
        rejects
            .into_iter()
            .chain(conflicts)
            .chain(
                ack_ranges(&outcome.stored)
                    .into_iter()
                    .map(|(from_seq, to_seq)| pb::CollectorMessage {
                        body: Some(Reply::Ack(pb::Ack {
                            from_seq,
                            to_seq,
                            // The session's delta::Decoder rebuilds them.
                            changes_accepted: true,
                        })),
                    }),
            );
    for reply in replies {
        if tx.send(Ok(reply)).await.is_err() {
            delivered = false;
            break;
        }
    }
    Ok(IngestOutcome {
        goodbye: has_goodbye,
        goodbye_seq,
        max_seq,
        replies_delivered: delivered,
        rehello_ns,
    })
}

fn is_event(m: &pb::AgentMessage) -> bool {
    matches!(&m.body, Some(Body::Event(_)))
}

/// A request event, or a sample carrying a batch of request readings.
fn is_request_event(m: &pb::AgentMessage) -> bool {
    match &m.body {
        Some(Body::Event(e)) => matches!(e.kind, Some(pb::event::Kind::Request(_))),
        Some(Body::Sample(s)) => s.requests.is_some(),
        _ => false,
    }
}

/// Ascending seqs as inclusive runs: [1,2,3,7,8] -> [(1,3),(7,8)].
pub fn ack_ranges(seqs: &[u64]) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &s in seqs {
        match ranges.last_mut() {
            Some((_, to)) if s == *to + 1 => *to = s,
            Some((_, to)) if s <= *to => {}
            _ => ranges.push((s, s)),
        }
    }
    ranges
}

fn reject(seq: u64, reason: &str) -> pb::CollectorMessage {
    pb::CollectorMessage {
        body: Some(Reply::Reject(pb::Reject {
            seq,
            reason: reason.to_string(),
        })),
    }
}

fn seq_too_large(seq: u64) -> pb::CollectorMessage {
    reject(
        seq,
        &format!("seq {seq} is above the largest the collector stores ({MAX_SEQ})"),
    )
}

/// Turns tonic's decoding errors into a status that says what the agent did.
fn explain(status: &Status, agent: &str, last_seq: u64) -> Status {
    let what = match status.code() {
        Code::OutOfRange => {
            format!("a message over the collector's limit of {MAX_MESSAGE_BYTES} bytes")
        }
        Code::Internal if status.message().contains("decode") => {
            "a message that is not a valid oomscope.v1.AgentMessage".to_string()
        }
        _ => "a broken stream".to_string(),
    };
    Status::new(
        status.code(),
        format!(
            "agent {agent} sent {what} (after seq {last_seq}): {}",
            status.message()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::ack_ranges;

    #[test]
    fn ranges_merge_runs() {
        assert_eq!(
            ack_ranges(&[1, 2, 3, 7, 8, 10]),
            vec![(1, 3), (7, 8), (10, 10)]
        );
        assert_eq!(ack_ranges(&[]), Vec::<(u64, u64)>::new());
        assert_eq!(ack_ranges(&[5, 5, 6]), vec![(5, 6)]);
    }
}
