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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::pb;

    /// A pool of `n` readers over a fresh file store that knows agent "a1".
    fn pool(dir: &tempfile::TempDir, n: usize) -> Arc<ReaderPool> {
        let path = dir.path().join("db");
        let mut writer = Store::open(&path).unwrap();
        let hello = pb::Hello {
            agent_id: "a1".into(),
            ..Default::default()
        };
        writer.upsert_agent(&hello, 1).unwrap();
        Arc::new(ReaderPool::open(&path, n).unwrap())
    }

    /// Starts a read that holds its connection until `release` is sent, and
    /// returns once it holds it (else a query spawned next may win the race
    /// for the connection).
    async fn hold(
        pool: &Arc<ReaderPool>,
    ) -> (std::sync::mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (holding, held) = tokio::sync::oneshot::channel::<()>();
        let pool = pool.clone();
        let task = tokio::spawn(async move {
            pool.read(move |_| {
                let _ = holding.send(());
                // Released by a send, or by the sender's drop: either ends the hold.
                let _ = wait.recv();
                Ok(())
            })
            .await
            .unwrap();
        });
        held.await.expect("the held read started");
        (release, task)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_reader_does_not_hold_back_the_next_query() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir, 2);
        let (release, held) = hold(&pool).await;
        // Loose: the point is an answer while the first read still runs.
        let agents = tokio::time::timeout(Duration::from_secs(20), pool.read(|s| s.list_agents()))
            .await
            .expect("the second connection answers while the first is busy")
            .unwrap();
        assert_eq!(agents.len(), 1);
        assert!(!held.is_finished(), "the first read was still running");
        release.send(()).unwrap();
        held.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queries_beyond_the_pool_wait_and_a_panic_loses_no_connection() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir, 1);
        let (release, held) = hold(&pool).await;
        let waiting = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.read(|s| s.list_agents()).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "one connection, and it is busy");
        release.send(()).unwrap();
        held.await.unwrap();
        assert_eq!(waiting.await.unwrap().unwrap().len(), 1);

        let err = pool
            .read(|_| -> Result<()> { panic!("a query that panics") })
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("store task failed"), "{err:#}");
        let agents = pool.read(|s| s.list_agents()).await.unwrap();
        assert_eq!(agents.len(), 1, "the connection came back");
    }
}
