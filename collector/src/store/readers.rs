//! A small pool of read-only connections: queries run side by side (WAL lets
//! each read the last commit while the writer writes), so a heavy timeline
//! never holds back `agents` or `incidents`, and never an ack (acks use the
//! writer's connection alone).

use std::path::Path;

use anyhow::{anyhow, Result};
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::Store;

/// Read connections a collector opens: queries beyond this many wait (without
/// holding a thread) for one to come free.
pub const DEFAULT_READERS: usize = 4;

pub struct ReaderPool {
    idle: Mutex<Vec<Store>>,
    free: Semaphore,
}

impl ReaderPool {
    /// `n` read-only connections (at least one) to the store at `path`,
    /// which [`Store::open`] has created.
    pub fn open(path: &Path, n: usize) -> Result<ReaderPool> {
        let stores = (0..n.max(1))
            .map(|_| Store::open_reader(path))
            .collect::<Result<Vec<_>>>()?;
        Ok(ReaderPool {
            free: Semaphore::new(stores.len()),
            idle: Mutex::new(stores),
        })
    }

    /// Runs `f` on an idle connection on a blocking thread (SQLite calls
    /// block), waiting asynchronously for one when all are busy.
    pub async fn read<R, F>(self: &std::sync::Arc<Self>, f: F) -> Result<R>
    where
        F: FnOnce(&mut Store) -> Result<R> + Send + 'static,
        R: Send + 'static,
    {
        let permit = self
            .free
            .acquire()
            .await
            .map_err(|_| anyhow!("the reader pool is closed"))?;
        let pool = self.clone();
        let out = tokio::task::spawn_blocking(move || {
            let mut lent = Lent {
                idle: &pool.idle,
                store: pool.idle.lock().pop(),
            };
            // A permit means an idle connection; never panic if not.
            let store = lent
                .store
                .as_mut()
                .ok_or_else(|| anyhow!("no idle reader behind a permit"))?;
            f(store)
        })
        .await;
        drop(permit);
        out.map_err(|e| anyhow!("a store task failed: {e}"))?
    }
}

/// A connection out of the pool, put back when dropped: also when the query
/// panicked, so the pool never shrinks.
struct Lent<'a> {
    idle: &'a Mutex<Vec<Store>>,
    store: Option<Store>,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if let Some(store) = self.store.take() {
            self.idle.lock().push(store);
        }
    }
}
