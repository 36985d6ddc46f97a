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
//! Held start ([`ReporterConfig::hold`]): until [`Reporter::release`], the
//! reporter opens no connection and creates no spool directory; what is
//! sent waits in the bounded queue. So a process that may turn out to be a
//! short-lived helper costs the collector nothing until it proves it is not;
//! one that stops while still held drops what it queued, silently.
//!
//! After `fork()` only the forking thread exists in the child, so the child's
//! copy of the reporter has no worker: its sends are refused (false, counted
//! as dropped), and `flush` times out. Compare [`Reporter::pid`] with the
//! current pid and start a new reporter (with a new agent id) in the child.
//!
//! A forked child never keeps the parent's connection open: it closes its
//! copy of each socket the reporter opened right after the fork (`fork`),
//! so a parent that dies is seen to go at once.
//!
//! This file is the handle the caller holds; `stream` is the worker thread
//! (connect, stream, ack, reconnect with backoff), `connector` its TCP
//! connections, `ledger` what is unacked and what to resend, `fork` how a
//! forked child is told from its parent and drops its connections.
//! [`Reporter::start`] lives in [`crate::recovery`], a client of this
//! module: besides starting a reporter it starts the delivery of dead
//! agents' spools.

mod connector;
mod fork;
#[cfg(test)]
mod hold_tests;
mod ledger;
mod stream;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::pb;
use crate::pb::agent_message::Body;
use crate::spool::{encode_agent_id, Origin, Spool};
use crate::sync::lock;
use fork::Birth;
use stream::{Inputs, Urgent, Worker};

use crate::priority::ThreadPriority;

/// Messages the hot path may queue before it starts dropping: a burst of
/// request events while the worker is busy. The worker drains it even while
/// the collector is down, so an outage is bounded by the ledger (which keeps
/// the newest and thins the older), not by this queue (which would refuse
/// the newest).
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// How often a flush with nothing sent yet looks whether a collector has
/// taken the stream.
const FLUSH_POLL: Duration = Duration::from_millis(10);

/// First reconnect delay: short, so a collector restart costs little.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(100);
/// The delay stops doubling here, so a collector that comes back is found
/// within seconds while a down one costs one attempt per 5 s.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// TCP connect plus the stream's opening; a loopback or LAN collector
/// answers in milliseconds, so seconds means it is not answering.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Memory held for unacked messages. Past it, the oldest live only in the
/// spool, or (without one) the older samples and request events are thinned
/// (`ledger`), counted and stated on the samples kept. At a few hundred
/// bytes a message and the Python agent's 20 messages a second at most,
/// over half an hour of an outage whole and hours more thinned.
pub const DEFAULT_UNACKED_MAX_BYTES: usize = 16 * 1024 * 1024;
/// How long dropping the last handle waits for the worker to stop.
pub const DROP_JOIN_TIMEOUT: Duration = Duration::from_secs(1);
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
    /// Start held: no connection, no new spool directory, messages wait in
    /// the queue until [`Reporter::release`]. For agents that start in every
    /// process, helpers included, and speak up only for those that last.
    pub hold: bool,
    /// How the reporter's thread, and the sampler's that runs beside it,
    /// are scheduled ([`crate::priority`]); the default leaves them as the
    /// process's threads are.
    pub thread_priority: ThreadPriority,
    /// The collector's token (`OOMSCOPE_TOKEN`, read by [`ReporterConfig::new`]),
    /// sent as `authorization: Bearer` on the stream; None sends none.
    pub token: Option<String>,
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
            hold: false,
            thread_priority: ThreadPriority::default(),
            token: std::env::var(oomscope_proto::bearer::TOKEN_ENV).ok(),
        }
    }
}

/// Whether `url` can name a collector: `http://` or `https://`, a host, a
/// port if any. The reporter takes any text and, on a bad one, only retries
/// with a warning; an agent that starts from a user's setting checks it
/// first so the mistake is an error at start, not a silent absence.
pub fn check_collector_url(urls: &str) -> Result<(), String> {
    let list = collector_urls(urls);
    if list.is_empty() {
        return check_one_url(urls);
    }
    list.into_iter().try_for_each(check_one_url)
}

/// The collector URLs of a comma-separated list (`OOMSCOPE_COLLECTOR`,
/// `--collector`), in order: the reporter dials the next once a session
/// with one fails (several collectors sharing one PostgreSQL store).
pub fn collector_urls(urls: &str) -> Vec<&str> {
    urls.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

fn check_one_url(url: &str) -> Result<(), String> {
    let uri: tonic::transport::Uri = url
        .parse()
        .map_err(|e| format!("collector URL {url:?} is not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!(
            "collector URL {url:?} must start with http:// or https:// (e.g. {})",
            oomscope_proto::DEFAULT_COLLECTOR_URL
        ));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("collector URL {url:?} names no host"));
    }
    // The URI parser takes any text after the host's colon.
    let authority = uri.authority().map_or("", |a| a.as_str());
    let after_host = authority
        .rsplit_once(']')
        .map_or(authority, |(_, rest)| rest);
    if let Some((_, port)) = after_host.rsplit_once(':') {
        port.parse::<u16>()
            .map_err(|_| format!("collector URL {url:?} is not a URL: port {port:?}"))?;
    }
    tonic::transport::Endpoint::from_shared(url.to_string())
        .map(|_| ())
        .map_err(|e| format!("collector URL {url:?}: {e}"))
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
    /// spool to hold them (thinned, or the oldest once nothing is left to
    /// thin), or deleted with a spool segment over its bound.
    pub dropped: u64,
    /// Of `dropped`, samples and request events the memory bound thinned.
    pub thinned: u64,
    /// The largest stride thinning reached: one message kept of this many
    /// (1 = none thinned).
    pub max_stride: u64,
    /// Encoded bytes of unacked messages held in memory now (at most
    /// `unacked_max_bytes`).
    pub buffered_bytes: u64,
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
    worker: Mutex<Option<WorkerThread>>,
    directives: Mutex<Option<std_mpsc::Receiver<pb::Directive>>>,
    agent_id: String,
    birth: Birth,
    /// True from a held start until the first `release`.
    held: AtomicBool,
    release: watch::Sender<bool>,
    /// The spool opens at release (held, with a spool root).
    spool_deferred: bool,
    /// The Hello as it stands; the worker resends it when it changes.
    hello: watch::Sender<pb::Hello>,
    thread_priority: ThreadPriority,
}

struct Intake {
    next_seq: u64,
    queue: mpsc::Sender<pb::AgentMessage>,
}

struct WorkerThread {
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
    /// Set at launch, or by the worker at release for a held start.
    spool: OnceLock<Mutex<Spool>>,
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
    thinned: AtomicU64,
    max_stride: AtomicU64,
    buffered_bytes: AtomicU64,
}

#[derive(Default)]
struct Progress {
    /// Every seq at or below is acked, rejected or dropped.
    done_upto: u64,
    /// Urgent seqs settled: true when acked, false when rejected or dropped.
    urgent: HashMap<u64, bool>,
    worker_exited: bool,
    /// A deferred spool was opened (or failed to open) after release.
    spool_settled: bool,
}

impl Shared {
    fn set_error(&self, error: String) {
        *lock(&self.last_error) = Some(error);
    }

    /// Waits until `settled` finds what it looks for in the progress: its
    /// answer, or `None` once `deadline` passes or the worker has exited.
    fn wait_for<R>(
        &self,
        deadline: Instant,
        mut settled: impl FnMut(&mut Progress) -> Option<R>,
    ) -> Option<R> {
        let mut progress = lock(&self.progress);
        loop {
            if let Some(answer) = settled(&mut progress) {
                return Some(answer);
            }
            let now = Instant::now();
            if progress.worker_exited || now >= deadline {
                return None;
            }
            progress = self
                .progress_changed
                .wait_timeout(progress, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

impl Reporter {
    /// What [`Reporter::start`] does for this agent alone: names it if the
    /// Hello does not, opens its spool (local disk only) so that seqs
    /// continue after the previous run's, and starts the worker. A spool
    /// that cannot be opened is logged and the reporter runs memory-only.
    ///
    /// Held, it opens the spool only if this agent id already has one (a
    /// previous run's: its seqs must continue); otherwise the worker opens
    /// it at release, so a process that never is released leaves no trace.
    pub(crate) fn open(cfg: ReporterConfig, mut hello: pb::Hello) -> Reporter {
        if hello.agent_id.is_empty() {
            hello.agent_id = format!("agent-{}-{:x}", std::process::id(), crate::now_ns());
        }
        let mut startup_error = None;
        let defer =
            |root: &PathBuf| cfg.hold && !root.join(encode_agent_id(&hello.agent_id)).exists();
        let spool_deferred = cfg.spool_dir.as_ref().is_some_and(defer);
        let spool = cfg.spool_dir.as_ref().filter(|_| !spool_deferred).and_then(|root| {
            let origin = Origin {
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
        let hold = cfg.hold;
        Self::launch_with(cfg, hello, spool, startup_error, hold, spool_deferred)
    }

    /// Starts the worker over an already opened spool (or none), never
    /// held: what it delivers is already on disk.
    pub(crate) fn launch(
        cfg: ReporterConfig,
        hello: pb::Hello,
        spool: Option<Spool>,
        startup_error: Option<String>,
    ) -> Reporter {
        Self::launch_with(cfg, hello, spool, startup_error, false, false)
    }

    fn launch_with(
        cfg: ReporterConfig,
        hello: pb::Hello,
        spool: Option<Spool>,
        startup_error: Option<String>,
        hold: bool,
        spool_deferred: bool,
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
            spool: spool
                .map(Mutex::new)
                .map_or_else(OnceLock::new, OnceLock::from),
        });
        let (queue_tx, queue_rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let (urgent_tx, urgent_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(false);
        let (directive_tx, directive_rx) = std_mpsc::sync_channel(DIRECTIVE_BUFFER);
        let (exited_tx, exited_rx) = std_mpsc::channel::<()>();
        let (release_tx, release_rx) = watch::channel(!hold);
        let (hello_tx, hello_rx) = watch::channel(hello.clone());

        let thread_priority = cfg.thread_priority;
        let worker = Worker::new(cfg, hello, shared.clone(), directive_tx, next_seq);
        let inputs = Inputs {
            queue: queue_rx,
            urgent: urgent_rx,
            stop: stop_rx,
            release: release_rx,
            hello: hello_rx,
        };
        let spawned = std::thread::Builder::new()
            .name("oomscope-reporter".into())
            .spawn(move || {
                let _exited = exited_tx;
                thread_priority.apply_to_this_thread();
                worker.run(inputs);
            });
        let worker = match spawned {
            Ok(thread) => Some(WorkerThread {
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
                birth: Birth::here(),
                held: AtomicBool::new(hold),
                release: release_tx,
                hello: hello_tx,
                spool_deferred,
                thread_priority,
            }),
        }
    }

    /// Changes what the agent says about itself (its role once a runtime's
    /// plugin has named it, its title once the runtime renamed it): a Hello
    /// that changed goes out on the open stream at once, and on every
    /// reconnect after. The agent id never changes.
    pub fn update_hello(&self, change: impl FnOnce(&mut pb::Hello)) {
        self.inner.hello.send_if_modified(|h| {
            let before = h.clone();
            change(h);
            h.agent_id = before.agent_id.clone();
            *h != before
        });
    }

    /// Ends a held start: the worker opens the spool (if any), connects, and
    /// sends the Hello and then everything queued so far. Cheap (one atomic
    /// load once released), so a request path may call it every time.
    pub fn release(&self) {
        // A forked child's copy has no worker to release (see `enqueue`).
        if self.inner.birth.forked() {
            return;
        }
        if self.inner.held.load(Ordering::Relaxed) && self.inner.held.swap(false, Ordering::AcqRel)
        {
            self.inner.release.send_replace(true);
        }
    }

    /// How its thread is scheduled (the sampler's too).
    pub fn thread_priority(&self) -> ThreadPriority {
        self.inner.thread_priority
    }

    /// Whether this reporter is held (started with `hold`, not released).
    pub fn held(&self) -> bool {
        self.inner.held.load(Ordering::Relaxed)
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

    /// The hot path: one atomic load, one short lock, one `try_send`.
    fn enqueue(&self, body: Body) -> bool {
        if self.inner.birth.forked() {
            self.count_dropped();
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
            drop(intake);
            self.count_dropped();
            false
        }
    }

    fn count_dropped(&self) {
        self.inner
            .shared
            .counters
            .dropped
            .fetch_add(1, Ordering::Relaxed);
    }

    /// For an OOM: bypasses the queue (never dropped for lack of room),
    /// appends the event to the spool and syncs it before returning, then
    /// waits up to `wait` for the collector's ack. Returns whether it was
    /// acked. May block on the disk write and for up to `wait`. Releases a
    /// held reporter: an urgent message is worth a connection.
    pub fn send_urgent(&self, event: pb::Event, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        if self.held() {
            self.release();
            // The worker opens a deferred spool first: wait for it (bounded
            // by `wait`), so that the event is synced to disk here as usual.
            if self.inner.spool_deferred {
                self.inner
                    .shared
                    .wait_for(deadline, |p| p.spool_settled.then_some(()));
            }
        }
        let Some(seq) = self.send_bypassing_queue(Body::Event(event), true) else {
            return false;
        };
        self.inner
            .shared
            .wait_for(deadline, |p| p.urgent.remove(&seq))
            .unwrap_or(false)
    }

    /// Assigns a seq and hands the message to the worker outside the
    /// bounded queue; with `sync`, spools and syncs it here first.
    fn send_bypassing_queue(&self, body: Body, sync: bool) -> Option<u64> {
        if self.inner.birth.forked() {
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
        let spooled = match (self.inner.shared.spool.get(), sync) {
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
    /// first or the worker has stopped. Blocks for up to `timeout`; a held
    /// reporter delivers nothing, so it returns false at once. With nothing
    /// sent yet, true once a collector has taken the stream: a collector that
    /// refuses it (a missing token) is not "everything delivered".
    pub fn flush(&self, timeout: Duration) -> bool {
        if self.held() {
            return false;
        }
        let deadline = Instant::now() + timeout;
        let target = lock(&self.inner.intake).next_seq - 1;
        if target == 0 {
            let connected = &self.inner.shared.counters.connected;
            while !connected.load(Ordering::Relaxed) {
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(FLUSH_POLL);
            }
            return true;
        }
        self.wait_done(target, deadline)
    }

    fn wait_done(&self, target: u64, deadline: Instant) -> bool {
        self.inner
            .shared
            .wait_for(deadline, |p| (p.done_upto >= target).then_some(()))
            .is_some()
    }

    /// Sends `goodbye`, waits for everything to be acked, and stops the
    /// worker (for every clone of this handle). Returns whether everything
    /// was acked within `timeout`; what was not stays in the spool, if any.
    /// Blocks for up to `timeout`. Still held, it sends nothing: what was
    /// queued is dropped without a word (false).
    pub fn shutdown(self, goodbye: pb::Goodbye, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        if self.held() {
            self.inner
                .stop_worker(timeout.max(Duration::from_millis(50)));
            return false;
        }
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
            thinned: c.thinned.load(Ordering::Relaxed),
            max_stride: c.max_stride.load(Ordering::Relaxed).max(1),
            buffered_bytes: c.buffered_bytes.load(Ordering::Relaxed),
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

    pub fn agent_id(&self) -> &str {
        &self.inner.agent_id
    }

    /// The pid that started this reporter. A forked child (whose pid
    /// differs) has no worker thread and must start a new reporter.
    pub fn pid(&self) -> u32 {
        self.inner.birth.pid()
    }

    /// Whether unacked messages are also kept on disk (for a held start
    /// with a spool root: will be, once released).
    pub(crate) fn has_spool(&self) -> bool {
        self.inner.shared.spool.get().is_some() || self.inner.spool_deferred
    }

    pub(crate) fn liveness(&self) -> Liveness {
        Liveness {
            shared: Arc::downgrade(&self.inner.shared),
            stop: self.inner.stop.subscribe(),
        }
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

impl Handle {
    /// Stops the worker and waits up to `wait` for its thread to end. A
    /// worker that does not end in time is left to finish on its own.
    fn stop_worker(&self, wait: Duration) {
        self.stop.send_replace(true);
        let Some(worker) = lock(&self.worker).take() else {
            return;
        };
        if self.birth.elsewhere() {
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

#[cfg(test)]
mod url_tests {
    use super::check_collector_url;

    #[test]
    fn a_collector_url_needs_a_scheme_and_a_host() {
        for good in [
            "http://127.0.0.1:4317",
            "https://collector.example",
            "http://[::1]:9",
            "http://10.0.0.1:4317,http://10.0.0.2:4317",
        ] {
            assert_eq!(check_collector_url(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("127.0.0.1:4317", "http://"),
            ("localhost:4317", "http://"),
            ("grpc://host:1", "http://"),
            ("http://", "not a URL"),
            ("", "not a URL"),
            ("http://host:notaport", "not a URL"),
            ("http://a:1,grpc://b:2", "grpc://b:2"),
        ] {
            let e = check_collector_url(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
