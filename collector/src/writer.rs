//! Group commit: one thread writes every agent stream's ready batches, as
//! many as are waiting, in one transaction, then answers each (so each is
//! acked only after that commit). With `synchronous=FULL` a commit is an
//! fsync; one per agent batch capped the collector near the disk's fsync
//! rate however many agents sent, one per group shares it among them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use tokio::sync::{mpsc, oneshot};

use parking_lot::MutexGuard;

use crate::store::Store;

/// What holds the store the writer writes (the collector's state).
pub(crate) trait StoreOwner: Send + Sync + 'static {
    /// The store, locked for a group; None when it must take nothing (its
    /// files went away: the collector is stopping, loudly).
    fn store_for_writing(&self) -> Option<MutexGuard<'_, Store>>;
    /// Agent streams that may send a batch now: a stream has at most one
    /// batch with the writer (it reads its next once this one is acked), so
    /// a group holding this many has every batch it can wait for.
    fn streams(&self) -> usize;
    /// How long a group waits for more streams' batches (see
    /// [`DEFAULT_GATHER_WAIT`]).
    fn gather_wait(&self) -> Duration;
}

/// How long the writer holds a group open for other streams' batches once
/// its first came, while it holds fewer batches than there are streams.
/// Agents send at their sampling interval (250 ms), so 2,000 of them bring
/// one-sample batches a few at a time: committed as they came, each group
/// was a few samples, and its commit (the WAL's pages, the fsync) and each
/// batch's wakeups were paid per sample. Held 5 ms, a group gathers ~40 of
/// them at 8,000 samples/s. A sample's ack waits at most this much longer;
/// a lone stream, or a group already holding every stream's batch (16
/// agents sending as fast as acks allow), does not wait.
pub const DEFAULT_GATHER_WAIT: Duration = Duration::from_millis(5);

/// How often a gathering writer looks for more batches: a group that holds
/// every stream's batch goes without waiting out the rest of the gather.
const GATHER_POLL: Duration = Duration::from_micros(500);

/// At most this many batches in one group transaction: a group holds the
/// store for its whole write, so a query on the writer's connection (a
/// store without a reader pool) waits at most this many batches.
pub const MAX_GROUP_BATCHES: usize = 512;

/// Batches waiting for the writer: a stream that finds the queue full waits
/// (its agent waits for acks, and its own sending slows by flow control).
pub const WRITER_QUEUE: usize = 4096;

/// What the writer answers a batch with once its group committed (or not).
type Answer = Box<dyn FnOnce(Result<(), String>) + Send>;
/// One batch's work: run inside the group, it says whether it succeeded
/// and how to answer once the group's fate is known.
type Job = Box<dyn FnOnce(&mut Store) -> Answer + Send>;

/// The queue into the writer thread (started with the first batch).
pub(crate) struct Writer {
    jobs: mpsc::Sender<Job>,
    counts: Arc<GroupCounts>,
}

/// How many group transactions committed, holding how many batches.
#[derive(Debug, Default)]
pub struct GroupCounts {
    pub groups: AtomicU64,
    pub batches: AtomicU64,
}

impl Writer {
    /// Starts the writer thread for `inner`. It holds `inner` weakly, so
    /// the collector's state (and the queue, and so the thread) ends when
    /// the last handle goes.
    pub(crate) fn start<T: StoreOwner>(inner: &Arc<T>) -> Result<Writer> {
        let (jobs, queue) = mpsc::channel(WRITER_QUEUE);
        let weak = Arc::downgrade(inner);
        let counts = Arc::new(GroupCounts::default());
        let counting = counts.clone();
        std::thread::Builder::new()
            .name("oomscope-writer".into())
            .spawn(move || run(weak, queue, &counting))
            .map_err(|e| anyhow!("starting the store's writer thread: {e}"))?;
        Ok(Writer { jobs, counts })
    }

    /// (groups committed, batches in them) so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.counts.groups.load(Ordering::Relaxed),
            self.counts.batches.load(Ordering::Relaxed),
        )
    }

    /// Runs `work` on the store in the next group transaction; returns its
    /// result once that group is durably committed.
    pub(crate) async fn write<R, F>(&self, work: F) -> Result<R>
    where
        F: FnOnce(&mut Store) -> Result<R> + Send + 'static,
        R: Send + 'static,
    {
        let (tx, rx) = oneshot::channel::<Result<R>>();
        let job: Job = Box::new(move |store: &mut Store| {
            let result = store.group_part(work);
            Box::new(move |committed: Result<(), String>| {
                let _ = tx.send(committed.map_err(|e| anyhow!(e)).and(result));
            })
        });
        self.jobs
            .send(job)
            .await
            .map_err(|_| anyhow!("the store's writer has stopped"))?;
        rx.await.map_err(|_| {
            anyhow!("the store's writer dropped the batch (see the collector's log)")
        })?
    }
}

fn run<T: StoreOwner>(inner: Weak<T>, mut queue: mpsc::Receiver<Job>, counts: &GroupCounts) {
    while let Some(first) = queue.blocking_recv() {
        let opened = Instant::now();
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let mut group = vec![first];
        let wait = inner.gather_wait();
        loop {
            while group.len() < MAX_GROUP_BATCHES {
                match queue.try_recv() {
                    Ok(job) => group.push(job),
                    Err(_) => break,
                }
            }
            let waited = opened.elapsed();
            if group.len() >= MAX_GROUP_BATCHES.min(inner.streams()) || waited >= wait {
                break;
            }
            std::thread::sleep(GATHER_POLL.min(wait - waited));
        }
        // A store that takes nothing: the batches' answer channels drop,
        // and their streams fail unacked.
        let Some(mut store) = inner.store_for_writing() else {
            continue;
        };
        if let Err(e) = store.begin_group() {
            tracing::error!("{e:#}; the batches waiting are not acked");
            continue;
        }
        let answers: Vec<Answer> = group.into_iter().map(|job| job(&mut store)).collect();
        let committed = store.commit_group().map_err(|e| format!("{e:#}"));
        drop(store);
        match &committed {
            Ok(()) => {
                counts.groups.fetch_add(1, Ordering::Relaxed);
                counts
                    .batches
                    .fetch_add(answers.len() as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::error!("{e}; {} batches are not acked", answers.len()),
        }
        for answer in answers {
            answer(committed.clone());
        }
    }
}
