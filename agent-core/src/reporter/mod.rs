//! The reporter: streams an agent's samples and events to the collector.
//!
//! Modelled on tokio-console's console-subscriber: the caller's hot path only
//! does a `try_send` on a bounded queue and counts what it had to drop; one
//! background thread with its own current-thread tokio runtime does all the
//! network and disk work. So a server's request path never waits on the
//! collector, and a collector that is down, slow or gone costs the server a
//! bounded amount of memory and disk, nothing more.
//!
//! Delivery: every message gets a seq (1, 2, ... for the agent id's whole
//! life) and is kept until the collector acks it; after a reconnect the
//! reporter sends Hello, then every unacked message in seq order, then new
//! ones. With a spool directory every message is also appended to disk, so
//! a restarted process with the same agent id resends what its previous run
//! could not deliver. The collector deduplicates by (agent id, seq).
//!
//! Calls that may block, each at most for its `timeout`/`wait` argument:
//! [`Reporter::flush`], [`Reporter::shutdown`], [`Reporter::send_urgent`] (which
//! also writes and syncs the spool), and dropping the last handle (up to
//! [`DROP_JOIN_TIMEOUT`]). Everything else returns at once.
//!
//! After `fork()` only the forking thread exists in the child, so the child's
//! copy of the reporter has no worker: its sends queue up and are dropped,
//! and `flush` times out. Compare [`Reporter::pid`] with the current pid and
//! start a new reporter (with a new agent id) in the child.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::collector_message::Body as Reply;
use crate::recorder::FlightRecorder;
use crate::spool::Spool;

/// Messages the hot path may queue before it starts dropping: about an hour
/// of one-second samples, or a burst of request events, while the worker is
/// busy or (without a spool) the collector is down.
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// First reconnect delay: short, so a collector restart costs little.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(100);
/// The delay stops doubling here, so a collector that comes back is found
/// within seconds while a down one costs one attempt per 5 s.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// TCP connect plus the stream's opening; a loopback or LAN collector
/// answers in milliseconds, so seconds means it is not answering.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Memory held for unacked messages. Past it, the oldest live only in the
/// spool, or (without one) are dropped and counted.
pub const DEFAULT_UNACKED_MAX_BYTES: usize = 16 * 1024 * 1024;
/// How long dropping the last handle waits for the worker to stop.
pub const DROP_JOIN_TIMEOUT: Duration = Duration::from_secs(1);
/// Messages buffered between the worker and the HTTP/2 stream; more only
/// adds latency to acks, the stream itself does flow control.
const OUTBOUND_BUFFER: usize = 64;
/// HTTP/2 pings find a collector that vanished without closing the socket
/// (a dead host, a dropped route).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// The least a reread of the spool brings back into memory.
const RELOAD_MIN_BYTES: usize = 1024 * 1024;
/// Directives waiting for the agent to read them; older ones matter little.
const DIRECTIVE_BUFFER: usize = 64;

#[derive(Debug, Clone)]
pub struct ReporterConfig {
    pub collector_url: String,
    /// Root of the on-disk spool (a directory per agent id); `None` keeps
    /// unacked messages in memory only.
    pub spool_dir: Option<PathBuf>,
    pub queue_capacity: usize,
    pub spool_max_bytes: u64,
    pub unacked_max_bytes: usize,
    pub connect_timeout: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// The flight recorder's span and memory bound: the last `flight_window`
    /// of what was sent, at most `flight_max_bytes`, readable locally with
    /// [`Reporter::recent`] whether or not a collector ever acked it.
    pub flight_window: Duration,
    pub flight_max_bytes: usize,
}

impl ReporterConfig {
    /// The defaults, sending to `collector_url`.
    pub fn new(collector_url: impl Into<String>) -> Self {
        ReporterConfig {
            collector_url: collector_url.into(),
            spool_dir: None,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            spool_max_bytes: crate::spool::DEFAULT_SPOOL_MAX_BYTES,
            unacked_max_bytes: DEFAULT_UNACKED_MAX_BYTES,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            flight_window: crate::recorder::DEFAULT_WINDOW,
            flight_max_bytes: crate::recorder::DEFAULT_MAX_BYTES,
        }
    }
}

impl Default for ReporterConfig {
    fn default() -> Self {
        Self::new(oomscope_proto::DEFAULT_COLLECTOR_URL)
    }
}

/// Counters since the reporter started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReporterStats {
    /// Messages written to a collector stream, resends included.
    pub sent: u64,
    /// Of those, messages sent again after a reconnect.
    pub resent: u64,
    /// Distinct seqs the collector acked.
    pub acked: u64,
    /// Messages lost: refused by a full queue, pushed out of memory with no
    /// spool to hold them, or deleted with a spool segment over its bound.
    pub dropped: u64,
    /// Messages the collector refused with a `Reject`.
    pub rejected: u64,
    /// Records appended to the spool.
    pub spooled: u64,
    /// Streams opened after the first one.
    pub reconnects: u64,
    /// Attempts to reach the collector that failed.
    pub connect_failures: u64,
    /// Whether a stream to the collector is open now.
    pub connected: bool,
    pub last_error: Option<String>,
}

/// A handle on the reporter; clones share one worker.
#[derive(Clone)]
pub struct Reporter {
    inner: Arc<Handle>,
}

struct Handle {
    shared: Arc<Shared>,
    /// The seq counter and the queue under one lock, so that queue order is
    /// seq order. Held only for a `try_send`.
    intake: Mutex<Intake>,
    urgent: mpsc::UnboundedSender<Urgent>,
    stop: watch::Sender<bool>,
    worker: Mutex<Option<Worker>>,
    directives: Mutex<Option<std_mpsc::Receiver<pb::Directive>>>,
    agent_id: String,
    pid: u32,
    fork_generation: u64,
}

static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);
static AT_FORK: std::sync::Once = std::sync::Once::new();

extern "C" fn bump_fork_generation() {
    // Async-signal-safe: one atomic add in the child right after fork().
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// How many forks lie between the first reporter's process and this one.
fn fork_generation() -> u64 {
    AT_FORK.call_once(|| {
        // SAFETY: registers a plain function that only touches an atomic.
        unsafe {
            libc::pthread_atfork(None, None, Some(bump_fork_generation));
        }
    });
    FORK_GENERATION.load(Ordering::Relaxed)
}

struct Intake {
    next_seq: u64,
    queue: mpsc::Sender<pb::AgentMessage>,
}

struct Worker {
    thread: JoinHandle<()>,
    /// Disconnects when the worker thread ends.
    exited: std_mpsc::Receiver<()>,
}

/// What the worker thread and the handles both see.
struct Shared {
    counters: Counters,
    last_error: Mutex<Option<String>>,
    progress: Mutex<Progress>,
    progress_changed: Condvar,
    spool: Option<Mutex<Spool>>,
    /// Filled by the worker, never by the caller's hot path.
    recorder: Mutex<FlightRecorder>,
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    resent: AtomicU64,
    acked: AtomicU64,
    dropped: AtomicU64,
    rejected: AtomicU64,
    spooled: AtomicU64,
    reconnects: AtomicU64,
    connect_failures: AtomicU64,
    connected: AtomicBool,
}

#[derive(Default)]
struct Progress {
    /// Every seq at or below is acked, rejected or dropped.
    done_upto: u64,
    /// Urgent seqs settled: true when acked, false when rejected or dropped.
    urgent: HashMap<u64, bool>,
    worker_exited: bool,
}

/// A message that bypasses the bounded queue (an OOM event, the Goodbye).
struct Urgent {
    message: pb::AgentMessage,
    /// Already appended by the caller, with the seqs that append pushed out.
    spooled: Option<Vec<u64>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the reporter down with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn set_error(&self, error: String) {
        *lock(&self.last_error) = Some(error);
    }
}

impl Reporter {
    /// Starts the worker thread and returns at once, whether or not the
    /// collector is reachable. Opens the spool first (local disk only) so
    /// that seqs continue after the previous run's; a spool that cannot be
    /// opened is logged and the reporter runs memory-only.
    ///
    /// With a spool, it also delivers (in the background, once connected)
    /// what dead agents of the same collector left in other spools under
    /// the same root: see [`crate::recovery`].
    pub fn start(cfg: ReporterConfig, mut hello: pb::Hello) -> Reporter {
        if hello.agent_id.is_empty() {
            hello.agent_id = format!("agent-{}-{:x}", std::process::id(), crate::now_ns());
        }
        let mut startup_error = None;
        let spool = cfg.spool_dir.as_ref().and_then(|root| {
            let origin = crate::spool::Origin {
                collector_url: cfg.collector_url.clone(),
                hello: hello.clone(),
            };
            Spool::open(root, &hello.agent_id, cfg.spool_max_bytes)
                .and_then(|mut spool| spool.set_origin(&origin).map(|()| spool))
                .map_err(|e| {
                    tracing::warn!(error = %e, "oomscope reporter: spool unavailable, keeping unacked messages in memory only");
                    startup_error = Some(format!("spool: {e}"));
                })
                .ok()
        });
        let recover = spool.is_some();
        let reporter = Self::launch(cfg.clone(), hello, spool, startup_error);
        if recover {
            crate::recovery::spawn(cfg, &reporter);
        }
        reporter
    }

    /// Starts the worker over an already opened spool (or none).
    pub(crate) fn launch(
        cfg: ReporterConfig,
        hello: pb::Hello,
        spool: Option<Spool>,
        startup_error: Option<String>,
    ) -> Reporter {
        let agent_id = hello.agent_id.clone();
        let next_seq = spool.as_ref().map_or(1, Spool::next_seq);
        // What the previous run left unacked lies between the spool's floor
        // and `next_seq`; the worker settles it as it is acked.
        let floor = spool.as_ref().map_or(0, Spool::acked_upto);
        let shared = Arc::new(Shared {
            counters: Counters::default(),
            last_error: Mutex::new(startup_error),
            progress: Mutex::new(Progress {
                done_upto: floor,
                ..Progress::default()
            }),
            progress_changed: Condvar::new(),
            spool: spool.map(Mutex::new),
            recorder: Mutex::new(FlightRecorder::new(cfg.flight_window, cfg.flight_max_bytes)),
        });
        let (queue_tx, queue_rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let (urgent_tx, urgent_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(false);
        let (directive_tx, directive_rx) = std_mpsc::sync_channel(DIRECTIVE_BUFFER);
        let (exited_tx, exited_rx) = std_mpsc::channel::<()>();

        let state = State::new(cfg, hello, shared.clone(), directive_tx, next_seq);
        let inputs = Inputs {
            queue: queue_rx,
            urgent: urgent_rx,
            stop: stop_rx,
        };
        let spawned = std::thread::Builder::new()
            .name("oomscope-reporter".into())
            .spawn(move || {
                let _exited = exited_tx;
                run_worker(state, inputs);
            });
        let worker = match spawned {
            Ok(thread) => Some(Worker {
                thread,
                exited: exited_rx,
            }),
            Err(e) => {
                tracing::error!(error = %e, "oomscope reporter: cannot start its thread; nothing will be sent");
                shared.set_error(format!("cannot start reporter thread: {e}"));
                None
            }
        };
        Reporter {
            inner: Arc::new(Handle {
                shared,
                intake: Mutex::new(Intake {
                    next_seq,
                    queue: queue_tx,
                }),
                urgent: urgent_tx,
                stop: stop_tx,
                worker: Mutex::new(worker),
                directives: Mutex::new(Some(directive_rx)),
                agent_id,
                pid: std::process::id(),
                fork_generation: fork_generation(),
            }),
        }
    }

    /// Queues a sample. Never blocks; false (and `dropped` + 1) when the
    /// queue is full.
    pub fn send_sample(&self, sample: pb::Sample) -> bool {
        self.enqueue(Body::Sample(sample))
    }

    /// Queues an event. Never blocks; false (and `dropped` + 1) when the
    /// queue is full.
    pub fn send_event(&self, event: pb::Event) -> bool {
        self.enqueue(Body::Event(event))
    }

    fn enqueue(&self, body: Body) -> bool {
        if self.forked() {
            self.inner
                .shared
                .counters
                .dropped
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let mut intake = lock(&self.inner.intake);
        let message = pb::AgentMessage {
            seq: intake.next_seq,
            body: Some(body),
        };
        if intake.queue.try_send(message).is_ok() {
            intake.next_seq += 1;
            true
        } else {
            self.inner
                .shared
                .counters
                .dropped
                .fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// For an OOM: bypasses the queue (never dropped for lack of room),
    /// appends the event to the spool and syncs it before returning, then
    /// waits up to `wait` for the collector's ack. Returns whether it was
    /// acked. May block on the disk write and for up to `wait`.
    pub fn send_urgent(&self, event: pb::Event, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let seq = self.send_bypassing_queue(Body::Event(event), true);
        let Some(seq) = seq else {
            return false;
        };
        let shared = &self.inner.shared;
        let mut progress = lock(&shared.progress);
        loop {
            if let Some(acked) = progress.urgent.remove(&seq) {
                return acked;
            }
            let now = Instant::now();
            if progress.worker_exited || now >= deadline {
                return false;
            }
            progress = shared
                .progress_changed
                .wait_timeout(progress, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Assigns a seq and hands the message to the worker outside the
    /// bounded queue; with `sync`, spools and syncs it here first.
    fn send_bypassing_queue(&self, body: Body, sync: bool) -> Option<u64> {
        if self.forked() {
            // The parent's worker may have held the spool lock at fork time.
            return None;
        }
        let message = {
            let mut intake = lock(&self.inner.intake);
            let seq = intake.next_seq;
            intake.next_seq += 1;
            pb::AgentMessage {
                seq,
                body: Some(body),
            }
        };
        let seq = message.seq;
        let spooled = match (&self.inner.shared.spool, sync) {
            (Some(spool), true) => {
                let mut spool = lock(spool);
                match spool
                    .append(&message)
                    .and_then(|lost| spool.sync().map(|()| lost))
                {
                    Ok(lost) => {
                        self.inner
                            .shared
                            .counters
                            .spooled
                            .fetch_add(1, Ordering::Relaxed);
                        Some(lost)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, seq, "oomscope reporter: cannot spool an urgent message");
                        self.inner.shared.set_error(format!("spool: {e}"));
                        None
                    }
                }
            }
            _ => None,
        };
        if self.inner.urgent.send(Urgent { message, spooled }).is_err() {
            // The worker is gone; what was spooled goes out with the next run.
            return None;
        }
        Some(seq)
    }

    /// Waits until every message sent so far is acked (or was dropped or
    /// rejected, see [`ReporterStats`]): true, or false when `timeout` passes
    /// first or the worker has stopped. Blocks for up to `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        let target = lock(&self.inner.intake).next_seq - 1;
        self.wait_done(target, Instant::now() + timeout)
    }

    fn wait_done(&self, target: u64, deadline: Instant) -> bool {
        let shared = &self.inner.shared;
        let mut progress = lock(&shared.progress);
        loop {
            if progress.done_upto >= target {
                return true;
            }
            let now = Instant::now();
            if progress.worker_exited || now >= deadline {
                return false;
            }
            progress = shared
                .progress_changed
                .wait_timeout(progress, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Sends `goodbye`, waits for everything to be acked, and stops the
    /// worker (for every clone of this handle). Returns whether everything
    /// was acked within `timeout`; what was not stays in the spool, if any.
    /// Blocks for up to `timeout`.
    pub fn shutdown(self, goodbye: pb::Goodbye, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let flushed = match self.send_bypassing_queue(Body::Goodbye(goodbye), false) {
            Some(seq) => {
                let target = seq.max(lock(&self.inner.intake).next_seq - 1);
                self.wait_done(target, deadline)
            }
            None => false,
        };
        self.inner.stop_worker(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(50)),
        );
        flushed
    }

    pub fn stats(&self) -> ReporterStats {
        let c = &self.inner.shared.counters;
        ReporterStats {
            sent: c.sent.load(Ordering::Relaxed),
            resent: c.resent.load(Ordering::Relaxed),
            acked: c.acked.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            rejected: c.rejected.load(Ordering::Relaxed),
            spooled: c.spooled.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
            connect_failures: c.connect_failures.load(Ordering::Relaxed),
            connected: c.connected.load(Ordering::Relaxed),
            last_error: lock(&self.inner.shared.last_error).clone(),
        }
    }

    /// The collector's directives, in arrival order. The first call gets
    /// the receiver, later calls `None`. At most [`DIRECTIVE_BUFFER`] unread
    /// directives are kept; later ones are dropped.
    pub fn directives(&self) -> Option<std_mpsc::Receiver<pb::Directive>> {
        lock(&self.inner.directives).take()
    }

    /// The flight recorder: what this agent sent in the last
    /// `flight_window` (bounded by `flight_max_bytes`), oldest first. A
    /// message enters it when the worker takes it from the queue: at once
    /// with a spool; without one, while the collector is down, messages wait
    /// in the bounded queue and enter it when a connection drains them.
    pub fn recent(&self) -> Vec<pb::AgentMessage> {
        lock(&self.inner.shared.recorder).snapshot()
    }

    pub fn agent_id(&self) -> &str {
        &self.inner.agent_id
    }

    /// The pid that started this reporter. A forked child (whose pid
    /// differs) has no worker thread and must start a new reporter.
    pub fn pid(&self) -> u32 {
        self.inner.pid
    }

    /// True in a forked child: it has no worker, so sending is pointless
    /// and taking the parent's locks could deadlock.
    fn forked(&self) -> bool {
        // A counter bumped in every forked child, instead of getpid() (a real
        // syscall per send since glibc 2.25 stopped caching it).
        fork_generation() != self.inner.fork_generation
    }
}

/// What another thread may watch of a reporter without keeping it alive.
pub(crate) struct Liveness {
    shared: std::sync::Weak<Shared>,
    stop: watch::Receiver<bool>,
}

impl Liveness {
    /// Asked to stop, or every handle is gone.
    pub(crate) fn stopped(&self) -> bool {
        *self.stop.borrow() || self.stop.has_changed().is_err()
    }

    /// A stream to the collector is open now.
    pub(crate) fn connected(&self) -> bool {
        self.shared
            .upgrade()
            .is_some_and(|s| s.counters.connected.load(Ordering::Relaxed))
    }
}

impl Reporter {
    pub(crate) fn liveness(&self) -> Liveness {
        Liveness {
            shared: Arc::downgrade(&self.inner.shared),
            stop: self.inner.stop.subscribe(),
        }
    }
}

impl Handle {
    /// Stops the worker and waits up to `wait` for its thread to end. A
    /// worker that does not end in time is left to finish on its own.
    fn stop_worker(&self, wait: Duration) {
        self.stop.send_replace(true);
        let Some(worker) = lock(&self.worker).take() else {
            return;
        };
        if std::process::id() != self.pid {
            // A forked child: the worker thread does not exist here, so
            // there is nothing to wait for or join.
            std::mem::forget(worker);
            return;
        }
        match worker.exited.recv_timeout(wait) {
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    "oomscope reporter: worker did not stop in time; leaving it to finish"
                );
            }
            _ => {
                let _ = worker.thread.join();
            }
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // The last handle is gone: stop without flushing. Unacked messages
        // stay in the spool (if any) for the next run.
        self.stop_worker(DROP_JOIN_TIMEOUT);
    }
}

// ---------------------------------------------------------------- worker --

/// The worker's receiving ends, kept apart from [`State`] so that
/// `select!` can poll them while its handlers change the state.
struct Inputs {
    queue: mpsc::Receiver<pb::AgentMessage>,
    urgent: mpsc::UnboundedReceiver<Urgent>,
    stop: watch::Receiver<bool>,
}

struct Entry {
    /// `None` when only the spool holds it (memory bound).
    message: Option<pb::AgentMessage>,
    bytes: usize,
    on_disk: bool,
    urgent: bool,
    sent_before: bool,
}

struct State {
    cfg: ReporterConfig,
    hello: pb::Hello,
    shared: Arc<Shared>,
    directives: std_mpsc::SyncSender<pb::Directive>,
    /// Everything not yet acked, rejected or dropped, by seq.
    unacked: BTreeMap<u64, Entry>,
    memory_bytes: usize,
    /// Entries below this seq hold no message in memory.
    evict_from: u64,
    /// Every seq of this run up to here has reached the worker; seqs above
    /// it that arrived early (urgent ones) wait in `taken_above`.
    taken_upto: u64,
    taken_above: BTreeSet<u64>,
    /// Seqs still to write on the current stream, in order.
    to_send: BTreeSet<u64>,
    /// Messages read back from the spool for resending.
    reloaded: BTreeMap<u64, pb::AgentMessage>,
    sessions: u64,
    /// Whether the last failure was already logged at warn level.
    failing: bool,
}

enum SessionEnd {
    Stopped,
    Failed { acked: bool, error: String },
}

fn run_worker(mut state: State, mut inputs: Inputs) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "oomscope reporter: cannot build its runtime; nothing will be sent");
            state.shared.set_error(format!("cannot build runtime: {e}"));
            state.exit();
            return;
        }
    };
    runtime.block_on(state.run(&mut inputs));
    state.drain_on_stop(&mut inputs);
    state.exit();
}

impl State {
    fn new(
        cfg: ReporterConfig,
        hello: pb::Hello,
        shared: Arc<Shared>,
        directives: std_mpsc::SyncSender<pb::Directive>,
        next_seq: u64,
    ) -> State {
        State {
            cfg,
            hello,
            shared,
            directives,
            unacked: BTreeMap::new(),
            memory_bytes: 0,
            evict_from: 0,
            taken_upto: next_seq - 1,
            taken_above: BTreeSet::new(),
            to_send: BTreeSet::new(),
            reloaded: BTreeMap::new(),
            sessions: 0,
            failing: false,
        }
    }

    async fn run(&mut self, inputs: &mut Inputs) {
        self.load_previous_run();
        let mut backoff = self.cfg.backoff_initial;
        loop {
            if *inputs.stop.borrow() {
                return;
            }
            match self.session(inputs).await {
                SessionEnd::Stopped => return,
                SessionEnd::Failed { acked, error } => {
                    self.shared
                        .counters
                        .connected
                        .store(false, Ordering::Relaxed);
                    if acked {
                        backoff = self.cfg.backoff_initial;
                    }
                    if !self.failing {
                        tracing::warn!(collector = %self.cfg.collector_url, error = %error, "oomscope reporter: collector unreachable, retrying with backoff");
                        self.failing = true;
                    } else {
                        tracing::debug!(error = %error, "oomscope reporter: still unreachable");
                    }
                    self.shared.set_error(error);
                }
            }
            if self
                .offline(inputs, tokio::time::sleep(backoff))
                .await
                .is_none()
            {
                return;
            }
            backoff = (backoff * 2).min(self.cfg.backoff_max.max(self.cfg.backoff_initial));
        }
    }

    /// Runs `fut` while still accepting messages: urgent ones always, queued
    /// ones only when a spool can hold them (without one, the bounded queue
    /// is the buffer while offline). `None` when asked to stop.
    async fn offline<F: std::future::Future>(
        &mut self,
        inputs: &mut Inputs,
        fut: F,
    ) -> Option<F::Output> {
        tokio::pin!(fut);
        let spooling = self.shared.spool.is_some();
        loop {
            tokio::select! {
                out = &mut fut => return Some(out),
                changed = inputs.stop.changed() => {
                    if changed.is_err() || *inputs.stop.borrow() {
                        return None;
                    }
                }
                Some(urgent) = inputs.urgent.recv() => self.take_urgent(urgent),
                Some(message) = inputs.queue.recv(), if spooling => self.take(message, false, None),
            }
        }
    }

    /// One connection: Hello, the backlog, then live traffic, until the
    /// stream fails or the reporter stops.
    async fn session(&mut self, inputs: &mut Inputs) -> SessionEnd {
        let failed = |error: String| SessionEnd::Failed {
            acked: false,
            error,
        };
        let endpoint = match Endpoint::from_shared(self.cfg.collector_url.clone()) {
            Ok(e) => e
                .connect_timeout(self.cfg.connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true),
            Err(e) => {
                return failed(format!(
                    "bad collector url {:?}: {e}",
                    self.cfg.collector_url
                ))
            }
        };
        let timeout = self.cfg.connect_timeout;
        let channel = match self
            .offline(inputs, tokio::time::timeout(timeout, endpoint.connect()))
            .await
        {
            None => return SessionEnd::Stopped,
            Some(Err(_)) => {
                return self.connect_failed(format!("connecting timed out after {timeout:?}"))
            }
            Some(Ok(Err(e))) => {
                return self.connect_failed(format!("cannot connect: {}", error_chain(&e)))
            }
            Some(Ok(Ok(channel))) => channel,
        };
        let (out_tx, out_rx) = mpsc::channel(OUTBOUND_BUFFER);
        let hello = pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(self.hello.clone())),
        };
        let _ = out_tx.try_send(hello);
        let mut client = pb::agent_service_client::AgentServiceClient::new(channel)
            .max_encoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
            .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES);
        let opened = tokio::time::timeout(timeout, client.connect(ReceiverStream::new(out_rx)));
        let mut inbound = match self.offline(inputs, opened).await {
            None => return SessionEnd::Stopped,
            Some(Err(_)) => {
                return self
                    .connect_failed(format!("opening the stream timed out after {timeout:?}"))
            }
            Some(Ok(Err(status))) => {
                return self.connect_failed(format!("collector refused the stream: {status}"))
            }
            Some(Ok(Ok(response))) => response.into_inner(),
        };

        self.sessions += 1;
        if self.sessions > 1 {
            self.shared
                .counters
                .reconnects
                .fetch_add(1, Ordering::Relaxed);
        }
        self.shared
            .counters
            .connected
            .store(true, Ordering::Relaxed);
        if self.failing {
            tracing::info!(collector = %self.cfg.collector_url, "oomscope reporter: connected again");
            self.failing = false;
        }
        self.to_send = self.unacked.keys().copied().collect();
        let mut acked = false;
        loop {
            tokio::select! {
                biased;
                changed = inputs.stop.changed() => {
                    if changed.is_err() || *inputs.stop.borrow() {
                        return SessionEnd::Stopped;
                    }
                }
                reply = inbound.message() => match reply {
                    Ok(Some(reply)) => acked |= self.handle_reply(reply),
                    Ok(None) => return SessionEnd::Failed { acked, error: "collector closed the stream".into() },
                    Err(status) => return SessionEnd::Failed { acked, error: format!("stream failed: {status}") },
                },
                Some(urgent) = inputs.urgent.recv() => self.take_urgent(urgent),
                permit = out_tx.reserve(), if !self.to_send.is_empty() => match permit {
                    Ok(permit) => {
                        if let Some(message) = self.next_to_send() {
                            permit.send(message);
                        }
                    }
                    Err(_) => return SessionEnd::Failed { acked, error: "stream closed".into() },
                },
                Some(message) = inputs.queue.recv() => self.take(message, false, None),
            }
        }
    }

    fn connect_failed(&mut self, error: String) -> SessionEnd {
        self.shared
            .counters
            .connect_failures
            .fetch_add(1, Ordering::Relaxed);
        SessionEnd::Failed {
            acked: false,
            error,
        }
    }

    /// Puts what the previous run left in the spool at the front of the
    /// backlog. Held in memory up to the bound; the rest is reread on send.
    fn load_previous_run(&mut self) {
        let Some(spool) = &self.shared.spool else {
            return;
        };
        let pending = match lock(spool).pending() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "oomscope reporter: cannot read the spool of a previous run");
                self.shared.set_error(format!("spool: {e}"));
                return;
            }
        };
        if !pending.is_empty() {
            tracing::info!(
                messages = pending.len(),
                "oomscope reporter: resending what a previous run left unacked"
            );
        }
        for message in pending {
            let bytes = message.encoded_len();
            self.memory_bytes += bytes;
            self.unacked.insert(
                message.seq,
                Entry {
                    message: Some(message),
                    bytes,
                    on_disk: true,
                    urgent: false,
                    sent_before: true,
                },
            );
            self.enforce_memory_bound();
        }
        self.publish();
    }

    fn take_urgent(&mut self, urgent: Urgent) {
        self.take(urgent.message, true, urgent.spooled);
    }

    /// Accepts one message from the caller: spool it (unless the caller
    /// did), keep it until acked, and queue it for the current stream.
    fn take(&mut self, message: pb::AgentMessage, urgent: bool, spooled: Option<Vec<u64>>) {
        let seq = message.seq;
        lock(&self.shared.recorder).push(message.clone());
        self.evict_from = self.evict_from.min(seq);
        if seq == self.taken_upto + 1 {
            self.taken_upto = seq;
            while self.taken_above.remove(&(self.taken_upto + 1)) {
                self.taken_upto += 1;
            }
        } else if seq > self.taken_upto {
            self.taken_above.insert(seq);
        }
        let on_disk = match spooled {
            Some(lost) => {
                self.lose(&lost);
                true
            }
            None => self.spool_append(&message),
        };
        let bytes = message.encoded_len();
        self.memory_bytes += bytes;
        self.unacked.insert(
            seq,
            Entry {
                message: Some(message),
                bytes,
                on_disk,
                urgent,
                sent_before: false,
            },
        );
        self.to_send.insert(seq);
        self.enforce_memory_bound();
        self.publish();
    }

    fn spool_append(&mut self, message: &pb::AgentMessage) -> bool {
        let Some(spool) = &self.shared.spool else {
            return false;
        };
        let appended = lock(spool).append(message);
        match appended {
            Ok(lost) => {
                self.shared.counters.spooled.fetch_add(1, Ordering::Relaxed);
                self.lose(&lost);
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, seq = message.seq, "oomscope reporter: spool append failed");
                self.shared.set_error(format!("spool: {e}"));
                false
            }
        }
    }

    /// The spool deleted these seqs to stay under its bound. Those it held
    /// alone are lost; those still in memory are no longer on disk.
    fn lose(&mut self, seqs: &[u64]) {
        for seq in seqs {
            let Some(entry) = self.unacked.get_mut(seq) else {
                continue;
            };
            if entry.message.is_some() {
                entry.on_disk = false;
            } else {
                self.unacked.remove(seq);
                self.settle_lost(*seq, false);
            }
        }
    }

    /// Keeps unacked messages in memory under the bound: the oldest are
    /// left to the spool when it has them, dropped and counted otherwise.
    fn enforce_memory_bound(&mut self) {
        while self.memory_bytes > self.cfg.unacked_max_bytes {
            let Some((&seq, entry)) = self
                .unacked
                .range_mut(self.evict_from..)
                .find(|(_, e)| e.message.is_some())
            else {
                break;
            };
            self.evict_from = seq + 1;
            self.memory_bytes -= entry.bytes;
            if entry.on_disk {
                entry.message = None;
            } else {
                self.unacked.remove(&seq);
                self.to_send.remove(&seq);
                self.settle_lost(seq, true);
            }
        }
    }

    /// Counts a message that will never be acked and wakes its waiter.
    fn settle_lost(&mut self, seq: u64, in_memory_only: bool) {
        self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
        if in_memory_only {
            tracing::debug!(
                seq,
                "oomscope reporter: unacked memory over its bound and no spool; dropped the oldest"
            );
        }
        lock(&self.shared.progress).urgent.insert(seq, false);
    }

    /// The next message for the stream, rereading from the spool what the
    /// memory bound left only there. A message the spool lost is dropped.
    fn next_to_send(&mut self) -> Option<pb::AgentMessage> {
        while let Some(seq) = self.to_send.pop_first() {
            let Some(entry) = self.unacked.get_mut(&seq) else {
                continue; // acked meanwhile
            };
            let resend = entry.sent_before;
            entry.sent_before = true;
            let message = match &entry.message {
                Some(m) => Some(m.clone()),
                None => self.reload(seq),
            };
            let Some(message) = message else {
                tracing::warn!(
                    seq,
                    "oomscope reporter: message missing from the spool, dropped"
                );
                self.unacked.remove(&seq);
                self.settle_lost(seq, false);
                self.publish();
                continue;
            };
            let c = &self.shared.counters;
            c.sent.fetch_add(1, Ordering::Relaxed);
            if resend {
                c.resent.fetch_add(1, Ordering::Relaxed);
            }
            return Some(message);
        }
        None
    }

    /// Rereads disk-only messages from `seq` on, a memory bound's worth at a time.
    fn reload(&mut self, seq: u64) -> Option<pb::AgentMessage> {
        if let Some(m) = self.reloaded.remove(&seq) {
            return Some(m);
        }
        self.reloaded.clear();
        let spool = self.shared.spool.as_ref()?;
        // scan(), not pending(): damage was already reported at startup.
        let pending = lock(spool).scan().ok()?.messages;
        // Each reread scans the whole spool, so read back a fair batch even
        // when the memory bound is tiny.
        let budget = (self.cfg.unacked_max_bytes / 4).max(RELOAD_MIN_BYTES);
        let mut bytes = 0;
        for m in pending.into_iter().filter(|m| m.seq >= seq) {
            let wanted = self
                .unacked
                .get(&m.seq)
                .is_some_and(|e| e.message.is_none());
            if !wanted {
                continue;
            }
            bytes += m.encoded_len();
            self.reloaded.insert(m.seq, m);
            if bytes > budget {
                break;
            }
        }
        self.reloaded.remove(&seq)
    }

    /// Applies one collector message; true when it acked something.
    fn handle_reply(&mut self, reply: pb::CollectorMessage) -> bool {
        match reply.body {
            Some(Reply::Ack(ack)) => {
                if ack.from_seq > ack.to_seq {
                    tracing::debug!(
                        from = ack.from_seq,
                        to = ack.to_seq,
                        "oomscope reporter: ignoring an inverted ack"
                    );
                    return false;
                }
                let seqs: Vec<u64> = self
                    .unacked
                    .range(ack.from_seq..=ack.to_seq)
                    .map(|(&s, _)| s)
                    .collect();
                let mut progress_urgent = Vec::new();
                for seq in &seqs {
                    if let Some(entry) = self.unacked.remove(seq) {
                        if entry.message.is_some() {
                            self.memory_bytes -= entry.bytes;
                        }
                        if entry.urgent {
                            progress_urgent.push(*seq);
                        }
                    }
                }
                self.shared
                    .counters
                    .acked
                    .fetch_add(seqs.len() as u64, Ordering::Relaxed);
                if !progress_urgent.is_empty() {
                    let mut progress = lock(&self.shared.progress);
                    for seq in progress_urgent {
                        progress.urgent.insert(seq, true);
                    }
                }
                self.publish();
                !seqs.is_empty()
            }
            Some(Reply::Directive(directive)) => {
                if self.directives.try_send(directive).is_err() {
                    tracing::debug!(
                        "oomscope reporter: directive buffer full or unread; dropped one"
                    );
                }
                false
            }
            Some(Reply::Reject(reject)) => {
                tracing::warn!(seq = reject.seq, reason = %reject.reason, "oomscope reporter: collector rejected a message");
                self.shared.set_error(format!(
                    "collector rejected seq {}: {}",
                    reject.seq, reject.reason
                ));
                if let Some(entry) = self.unacked.remove(&reject.seq) {
                    if entry.message.is_some() {
                        self.memory_bytes -= entry.bytes;
                    }
                    self.shared
                        .counters
                        .rejected
                        .fetch_add(1, Ordering::Relaxed);
                    lock(&self.shared.progress).urgent.insert(reject.seq, false);
                    self.publish();
                }
                false
            }
            None => false,
        }
    }

    /// Tells waiters how far everything is settled, and the spool what it
    /// may delete.
    fn publish(&mut self) {
        let first_open = self.unacked.keys().next().map_or(u64::MAX, |s| s - 1);
        let done = self.taken_upto.min(first_open);
        {
            let mut progress = lock(&self.shared.progress);
            if done <= progress.done_upto && self.shared.spool.is_none() {
                return;
            }
            progress.done_upto = progress.done_upto.max(done);
        }
        self.shared.progress_changed.notify_all();
        if let Some(spool) = &self.shared.spool {
            if let Err(e) = lock(spool).ack(done) {
                tracing::debug!(error = %e, "oomscope reporter: cannot record acks in the spool");
            }
        }
    }

    /// On stop, with a spool: put whatever is still queued on disk, so the
    /// next run sends it.
    fn drain_on_stop(&mut self, inputs: &mut Inputs) {
        if self.shared.spool.is_none() {
            return;
        }
        while let Ok(urgent) = inputs.urgent.try_recv() {
            self.take_urgent(urgent);
        }
        while let Ok(message) = inputs.queue.try_recv() {
            self.take(message, false, None);
        }
    }

    fn exit(&mut self) {
        self.shared
            .counters
            .connected
            .store(false, Ordering::Relaxed);
        lock(&self.shared.progress).worker_exited = true;
        self.shared.progress_changed.notify_all();
    }
}

/// An error with its sources, since tonic's transport errors say little at
/// the top level ("transport error").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
