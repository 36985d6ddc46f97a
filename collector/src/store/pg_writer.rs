//! Group commit on PostgreSQL, as the embedded store's writer does it
//! (`writer.rs`): one task takes every agent stream's batches that are
//! ready, as many as wait, and stores them in one transaction with one
//! multi-row insert per table (bound arrays through `unnest`); each batch
//! is answered once that transaction committed, so an ack still means
//! "durably written". One commit (one WAL flush) per group instead of one
//! per agent batch.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use deadpool_postgres::Pool;
use prost::Message;
use tokio::sync::{mpsc, oneshot};

use super::{classify, decode_message, seq_to_sql, BatchOutcome};
use crate::pb;
use crate::pb::agent_message::Body;

/// At most this many batches in one group transaction: bounds one
/// transaction's bound arrays (256 messages a batch: ~30k rows) and the
/// time the first batch of a group waits for the last one's rows.
pub const MAX_PG_GROUP_BATCHES: usize = 128;

/// Batches waiting for the writer task: a stream that finds the queue full
/// waits (its agent waits for acks), as with the embedded store's writer.
const PG_WRITER_QUEUE: usize = 4096;

/// One message of a batch, as the tables take it.
struct Row {
    seq: i64,
    time_ns: i64,
    kind: &'static str,
    event_kind: Option<&'static str>,
    body: Vec<u8>,
    message: pb::AgentMessage,
    /// A sample with allocator readings (see `instances::Member`).
    allocator: bool,
    /// A sample's statement of messages dropped before it, encoded.
    dropped_before: Option<Vec<u8>>,
}

/// One agent's batch, ready to store.
pub(super) struct Batch {
    agent_id: String,
    rows: Vec<Row>,
}

impl Batch {
    /// `messages` as rows; a Hello (not stored) is left out.
    pub(super) fn of(agent_id: &str, messages: &[pb::AgentMessage]) -> Result<Batch> {
        let mut rows = Vec::with_capacity(messages.len());
        for msg in messages {
            let Some((kind, event_kind, time_ns)) = classify(msg) else {
                continue;
            };
            rows.push(Row {
                seq: seq_to_sql(msg.seq)?,
                time_ns,
                kind,
                event_kind,
                body: msg.encode_to_vec(),
                allocator: matches!(&msg.body, Some(Body::Sample(s)) if !s.allocator.is_empty()),
                dropped_before: match &msg.body {
                    Some(Body::Sample(s)) => s.dropped_before.map(|d| d.encode_to_vec()),
                    _ => None,
                },
                message: msg.clone(),
            });
        }
        Ok(Batch {
            agent_id: agent_id.to_string(),
            rows,
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub(super) fn times(&self) -> Vec<i64> {
        self.rows.iter().map(|r| r.time_ns).collect()
    }
}

/// How many group transactions committed, holding how many batches.
#[derive(Default)]
struct GroupCounts {
    groups: AtomicU64,
    batches: AtomicU64,
}

type Job = (Batch, oneshot::Sender<Result<BatchOutcome, String>>);

/// The queue into the store's writer task.
pub(super) struct GroupWriter {
    jobs: mpsc::Sender<Job>,
    counts: Arc<GroupCounts>,
}

impl GroupWriter {
    /// Starts the writer task on `runtime`; it ends when the writer goes.
    pub(super) fn start(pool: Pool, runtime: &tokio::runtime::Handle) -> GroupWriter {
        let (jobs, queue) = mpsc::channel(PG_WRITER_QUEUE);
        let counts = Arc::new(GroupCounts::default());
        runtime.spawn(run(pool, queue, counts.clone()));
        GroupWriter { jobs, counts }
    }

    /// (groups committed, batches in them) so far.
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.counts.groups.load(Ordering::Relaxed),
            self.counts.batches.load(Ordering::Relaxed),
        )
    }

    /// Stores `batch` in the next group; returns once that group committed.
    /// Callable from a plain thread or a blocking task.
    pub(super) fn write(&self, batch: Batch) -> Result<BatchOutcome> {
        let (tx, rx) = oneshot::channel();
        futures::executor::block_on(async {
            self.jobs
                .send((batch, tx))
                .await
                .map_err(|_| anyhow!("the PostgreSQL writer has stopped"))?;
            rx.await
                .map_err(|_| anyhow!("the PostgreSQL writer dropped the batch"))?
                .map_err(|e| anyhow!(e))
        })
    }
}

async fn run(pool: Pool, mut queue: mpsc::Receiver<Job>, counts: Arc<GroupCounts>) {
    while let Some(first) = queue.recv().await {
        let mut group = vec![first];
        while group.len() < MAX_PG_GROUP_BATCHES {
            match queue.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let (batches, answers): (Vec<Batch>, Vec<_>) = group.into_iter().unzip();
        match write_group(&pool, &batches).await {
            Ok(outcomes) => {
                counts.count(outcomes.len());
                for (answer, outcome) in answers.into_iter().zip(outcomes) {
                    let _ = answer.send(Ok(outcome));
                }
            }
            // One batch the database refuses must not cost the others their
            // acks (the SQLite writer runs each in a savepoint): each again
            // alone.
            Err(e) if batches.len() > 1 => {
                tracing::warn!(
                    "a group of {} batches failed ({e:#}); storing each alone",
                    batches.len()
                );
                for (batch, answer) in batches.iter().zip(answers) {
                    let alone = write_group(&pool, std::slice::from_ref(batch)).await;
                    if alone.is_ok() {
                        counts.count(1);
                    }
                    let _ = answer.send(match alone {
                        Ok(mut outcome) => Ok(outcome.remove(0)),
                        Err(e) => {
                            tracing::error!(
                                "{e:#}; a batch of agent {} is not acked",
                                batch.agent_id
                            );
                            Err(format!("{e:#}"))
                        }
                    });
                }
            }
            Err(e) => {
                let e = format!("{e:#}");
                tracing::error!("{e}; a batch of agent {} is not acked", batches[0].agent_id);
                for answer in answers {
                    let _ = answer.send(Err(e.clone()));
                }
            }
        }
    }
}

impl GroupCounts {
    fn count(&self, batches: usize) {
        self.groups.fetch_add(1, Ordering::Relaxed);
        self.batches.fetch_add(batches as u64, Ordering::Relaxed);
    }
}

/// Stores `batches` in one transaction: keys first (their primary key makes
/// a duplicate impossible across collectors: of two collectors storing one
/// seq, the second waits for the first's commit, then finds it stored),
/// then the fresh messages, then a comparison of every resent one with the
/// stored, then each agent's figures. One outcome per batch, in order.
async fn write_group(pool: &Pool, batches: &[Batch]) -> Result<Vec<BatchOutcome>> {
    // Rows in (agent, seq) order, so that two collectors' groups take the
    // keys' locks in one order.
    let mut order: Vec<(usize, usize)> = batches
        .iter()
        .enumerate()
        .flat_map(|(b, batch)| (0..batch.rows.len()).map(move |r| (b, r)))
        .collect();
    let row = |&(b, r): &(usize, usize)| &batches[b].rows[r];
    order.sort_by(|x, y| {
        (&batches[x.0].agent_id, row(x).seq).cmp(&(&batches[y.0].agent_id, row(y).seq))
    });
    let agents: Vec<&str> = order
        .iter()
        .map(|&(b, _)| batches[b].agent_id.as_str())
        .collect();
    let seqs: Vec<i64> = order.iter().map(|x| row(x).seq).collect();
    let times: Vec<i64> = order.iter().map(|x| row(x).time_ns).collect();

    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let fresh: HashSet<(String, i64)> = tx
        .query(
            "INSERT INTO message_keys(agent_id, seq, time_ns)
             SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[])
             ON CONFLICT DO NOTHING RETURNING agent_id, seq",
            &[&agents, &seqs, &times],
        )
        .await
        .context("storing a group's message keys")?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // The first message of each fresh key is stored; any other is compared.
    let mut stored_now = HashSet::new();
    let (mut new_rows, mut compare) = (Vec::new(), Vec::new());
    for (i, x) in order.iter().enumerate() {
        let key = (agents[i].to_string(), seqs[i]);
        if fresh.contains(&key) && stored_now.insert(key) {
            new_rows.push(*x);
        } else {
            compare.push(*x);
        }
    }
    if !new_rows.is_empty() {
        let agent_of = |x: &(usize, usize)| batches[x.0].agent_id.as_str();
        let a: Vec<&str> = new_rows.iter().map(agent_of).collect();
        let s: Vec<i64> = new_rows.iter().map(|x| row(x).seq).collect();
        let t: Vec<i64> = new_rows.iter().map(|x| row(x).time_ns).collect();
        let k: Vec<&str> = new_rows.iter().map(|x| row(x).kind).collect();
        let e: Vec<Option<&str>> = new_rows.iter().map(|x| row(x).event_kind).collect();
        let bodies: Vec<&[u8]> = new_rows.iter().map(|x| row(x).body.as_slice()).collect();
        tx.execute(
            "INSERT INTO messages(agent_id, seq, time_ns, kind, event_kind, body)
             SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::text[], $5::text[], $6::bytea[])",
            &[&a, &s, &t, &k, &e, &bodies],
        )
        .await
        .context("storing a group's messages")?;
        let marked: Vec<&(usize, usize)> = new_rows
            .iter()
            .filter(|x| row(x).dropped_before.is_some())
            .collect();
        if !marked.is_empty() {
            let a: Vec<&str> = marked.iter().map(|x| agent_of(x)).collect();
            let t: Vec<i64> = marked.iter().map(|x| row(x).time_ns).collect();
            let s: Vec<i64> = marked.iter().map(|x| row(x).seq).collect();
            let d: Vec<&[u8]> = marked
                .iter()
                .filter_map(|x| row(x).dropped_before.as_deref())
                .collect();
            tx.execute(
                "INSERT INTO dropped_marks(agent_id, time_ns, seq, statement)
                 SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[])
                 ON CONFLICT DO NOTHING",
                &[&a, &t, &s, &d],
            )
            .await
            .context("storing a group's drop statements")?;
        }
    }
    let mut conflicting: HashSet<(usize, i64)> = HashSet::new();
    if !compare.is_empty() {
        let a: Vec<&str> = compare
            .iter()
            .map(|x| batches[x.0].agent_id.as_str())
            .collect();
        let s: Vec<i64> = compare.iter().map(|x| row(x).seq).collect();
        let stored: HashMap<(String, i64), Vec<u8>> = tx
            .query(
                "SELECT m.agent_id, m.seq, m.body FROM messages m
                 JOIN unnest($1::text[], $2::int8[]) AS u(agent_id, seq)
                   ON m.agent_id = u.agent_id AND m.seq = u.seq",
                &[&a, &s],
            )
            .await?
            .iter()
            .map(|r| ((r.get(0), r.get(1)), r.get(2)))
            .collect();
        for x in &compare {
            let (agent, r) = (&batches[x.0].agent_id, row(x));
            let same = match stored.get(&(agent.clone(), r.seq)) {
                Some(body) => decode_message(agent, r.seq as u64, body)? == r.message,
                // Its key is there and its row is not: retention took the
                // row's partition first. Nothing to compare with: refused.
                None => false,
            };
            if !same {
                conflicting.insert((x.0, r.seq));
            }
        }
    }
    // Each batch's outcome, and each agent's figures (summed over its batches).
    let new_set: HashSet<(usize, usize)> = new_rows.iter().copied().collect();
    let mut outcomes = Vec::with_capacity(batches.len());
    let mut figures: BTreeMap<&str, [i64; 5]> = BTreeMap::new();
    for (b, batch) in batches.iter().enumerate() {
        let mut out = BatchOutcome::default();
        let f = figures.entry(batch.agent_id.as_str()).or_default();
        for (r, row) in batch.rows.iter().enumerate() {
            if conflicting.contains(&(b, row.seq)) {
                out.conflicting.push(row.seq as u64);
                continue;
            }
            out.stored.push(row.seq as u64);
            f[0] = f[0].max(row.seq);
            f[1] = f[1].max(row.time_ns);
            if new_set.contains(&(b, r)) {
                out.fresh.push(row.seq as u64);
                f[2] += i64::from(row.kind == "sample");
                f[3] += i64::from(row.kind == "event");
                f[4] += i64::from(row.allocator);
            }
        }
        for v in [&mut out.stored, &mut out.fresh, &mut out.conflicting] {
            v.sort_unstable();
            v.dedup();
        }
        // A seq refused in one message of the batch is not acked for another.
        out.stored
            .retain(|s| out.conflicting.binary_search(s).is_err());
        outcomes.push(out);
    }
    figures.retain(|_, f| f[0] > 0);
    if !figures.is_empty() {
        let col = |i: usize| figures.values().map(|f| f[i]).collect::<Vec<i64>>();
        let ids: Vec<&str> = figures.keys().copied().collect();
        tx.execute(
            "UPDATE agents a SET last_seq = GREATEST(a.last_seq, u.seq),
               last_seen_ns = GREATEST(a.last_seen_ns, u.time_ns),
               samples = a.samples + u.samples, events = a.events + u.events,
               allocator_samples = a.allocator_samples + u.allocator
             FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[])
               AS u(agent_id, seq, time_ns, samples, events, allocator)
             WHERE a.agent_id = u.agent_id",
            &[&ids, &col(0), &col(1), &col(2), &col(3), &col(4)],
        )
        .await?;
    }
    tx.commit().await.context("committing a group of batches")?;
    Ok(outcomes)
}
