//! Schema v5: a stored sample keeps its allocator counters (the `raw` dicts,
//! 97 % of a PyTorch sample's bytes) as changes against the previous stored
//! sample of its chain, the wire's own encoding (`oomscope_proto::delta`).
//!
//! - A chain is one agent's samples from a keyframe (stored complete) on,
//!   at most [`KEYFRAME_INTERVAL`] of them, in ascending seq. Each sample
//!   row of a chain names its keyframe in `messages.key_seq`; to rebuild
//!   one, a reader decodes the chain's rows from the keyframe up to it, so
//!   never more than [`KEYFRAME_INTERVAL`] samples.
//! - The writer holds each agent's open chain in memory ([`Chains`]). A
//!   new chain starts after [`KEYFRAME_INTERVAL`] samples, when a sample
//!   arrives out of order (a resend, a late spool), after a failed
//!   transaction, after a restart, and when the agent's stream ends (its
//!   state is freed).
//! - `messages.whole_len` is the complete message's size, so a reply's
//!   budget is still measured from row headers without decoding.
//! - Every read of a whole sample goes through [`Rebuilder`]: what a query
//!   returns always has complete counters.
//! - Ingest hands the writer a stream's samples as they came ([`Received`]):
//!   when a chain's previous sample is the stream's previous one, a sample's
//!   changes are the chain's changes, and it is stored as it came, without
//!   building its counters' map (the usual case, and most of what ingest
//!   cost). Otherwise (a new chain, a device the chain lacks) the complete
//!   counters [`delta::Decoder::follow`] kept beside it are stored.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{bail, Context, Result};
use oomscope_proto::delta;
use prost::Message;
use rusqlite::{params, Connection, Transaction};

use super::decode_message;
use crate::pb;
use crate::pb::agent_message::Body;

/// Samples per chain, its keyframe included: a keyframe costs a whole
/// sample (4.5 KB of an H200 capture's), a change about 0.4 KB, so 32
/// spreads the keyframe to ~140 B a sample; and rebuilding any sample
/// decodes at most 32 rows (~15 KB), about as much as reading 3 whole ones.
pub const KEYFRAME_INTERVAL: u32 = 32;

/// Rows converted between two progress lines of the v5 migration.
const MIGRATION_PROGRESS_ROWS: u64 = 20_000;
/// Rows the v5 migration reads at once (about 4.5 MB of H200 samples).
const MIGRATION_PAGE_ROWS: i64 = 1_000;

/// One agent's open chain, as the writer last stored it.
struct Chain {
    key_seq: i64,
    last_seq: i64,
    len: u32,
    via: Via,
}

/// How a chain's samples came to the writer.
enum Via {
    /// Complete, encoded here against the chain's previous sample.
    Encoder(delta::Encoder),
    /// From one stream, stored as they came: the chain holds every sample
    /// of stream `stream` up to its `n`th, and counters of `devices`.
    Stream {
        stream: u64,
        n: u64,
        devices: Vec<i32>,
    },
}

/// The writer's open chains, one per agent with a live stream.
#[derive(Default)]
pub(super) struct Chains {
    open: HashMap<String, Chain>,
}

/// A sample as the writer stores it.
pub(super) struct Stored {
    pub body: Vec<u8>,
    /// Its chain's keyframe; None for a sample without allocator counters.
    pub key_seq: Option<i64>,
    /// The complete message's size; None when `body` is complete.
    pub whole_len: Option<i64>,
}

/// A message as its stream delivered it: a Sample's allocator counters may
/// be changes against the stream's previous sample (see `ingest.rs`).
#[derive(Debug, Clone)]
pub struct Received {
    pub msg: pb::AgentMessage,
    /// For a sample with allocator stats: where it stands in its stream.
    pub place: Option<StreamPlace>,
}

/// Where a sample with allocator stats stands in its stream, and its
/// complete counters.
#[derive(Debug, Clone)]
pub struct StreamPlace {
    /// The stream, unique in this process (see [`new_stream`]).
    pub stream: u64,
    /// Counts the stream's samples with allocator stats, each one decoded
    /// (stored or not): this sample's changes rest on number `n - 1`.
    pub n: u64,
    /// Each `AllocatorStats`' complete counters, in order
    /// ([`delta::Decoder::follow`]).
    pub complete: Vec<delta::Complete>,
}

/// A number for a new stream, never given before in this process.
pub fn new_stream() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What the writer stores: a complete message, or one as its stream
/// delivered it.
pub trait Incoming {
    fn message(&self) -> &pb::AgentMessage;
    /// Its place in its stream, when its counters may be changes.
    fn place(&self) -> Option<&StreamPlace> {
        None
    }
    /// The message with complete counters.
    fn complete(&self) -> Cow<'_, pb::AgentMessage> {
        match self.place() {
            None => Cow::Borrowed(self.message()),
            Some(p) => Cow::Owned(with_complete(self.message(), p, |_| true)),
        }
    }
}

impl Incoming for pb::AgentMessage {
    fn message(&self) -> &pb::AgentMessage {
        self
    }
}

impl Incoming for Received {
    fn message(&self) -> &pb::AgentMessage {
        &self.msg
    }
    fn place(&self) -> Option<&StreamPlace> {
        self.place.as_ref()
    }
}

/// `msg` with the counters of each allocator that `which` picks (among
/// those sent as changes) complete, from `place`.
fn with_complete(
    msg: &pb::AgentMessage,
    place: &StreamPlace,
    which: impl Fn(&pb::AllocatorStats) -> bool,
) -> pb::AgentMessage {
    let mut msg = msg.clone();
    if let Some(Body::Sample(s)) = &mut msg.body {
        for (stats, complete) in s.allocator.iter_mut().zip(&place.complete) {
            if stats.raw_changes.is_some() && which(stats) {
                stats.raw_changes = None;
                stats.raw = complete.to_raw();
            }
        }
    }
    msg
}

impl Chains {
    /// `msg` (a sample of `agent_id` at `seq`: complete without `place`, as
    /// its stream delivered it with one) as it is stored, its counters as
    /// changes when it continues the agent's chain.
    pub fn encode(
        &mut self,
        agent_id: &str,
        seq: i64,
        msg: &pb::AgentMessage,
        place: Option<&StreamPlace>,
    ) -> Stored {
        let has_counters = matches!(&msg.body, Some(Body::Sample(s))
            if s.allocator.iter().any(|a| !a.raw.is_empty() || a.raw_changes.is_some()));
        match (has_counters, place) {
            (false, _) => Stored {
                body: msg.encode_to_vec(),
                key_seq: None,
                whole_len: None,
            },
            // Complete as it came (an agent sends complete counters until
            // its stream's first ack, and an older agent always): encoded
            // here against the chain, as any complete message.
            (true, None) => self.encode_complete(agent_id, seq, msg),
            (true, Some(_)) if !has_changes(msg) => self.encode_complete(agent_id, seq, msg),
            (true, Some(place)) => self.encode_received(agent_id, seq, msg, place),
        }
    }

    fn encode_complete(&mut self, agent_id: &str, seq: i64, msg: &pb::AgentMessage) -> Stored {
        let continues = self.open.get(agent_id).is_some_and(|c| {
            c.last_seq < seq && c.len < KEYFRAME_INTERVAL && matches!(c.via, Via::Encoder(_))
        });
        if !continues {
            let mut encoder = delta::Encoder::new();
            // Remembers its counters; a fresh encoder leaves them complete.
            let body = encoder.encode(msg.clone()).encode_to_vec();
            return self.start_chain(agent_id, seq, Via::Encoder(encoder), body);
        }
        let chain = self.open.get_mut(agent_id).expect("checked above");
        let Via::Encoder(encoder) = &mut chain.via else {
            unreachable!("checked above")
        };
        let whole_len = msg.encoded_len() as i64;
        let body = encoder.encode(msg.clone()).encode_to_vec();
        chain.last_seq = seq;
        chain.len += 1;
        Stored {
            whole_len: (body.len() as i64 != whole_len).then_some(whole_len),
            body,
            key_seq: Some(chain.key_seq),
        }
    }

    /// Opens `agent_id`'s chain at `seq`, whose `body` is complete: the
    /// chain's key.
    fn start_chain(&mut self, agent_id: &str, seq: i64, via: Via, body: Vec<u8>) -> Stored {
        self.open.insert(
            agent_id.to_string(),
            Chain {
                key_seq: seq,
                last_seq: seq,
                len: 1,
                via,
            },
        );
        Stored {
            body,
            key_seq: Some(seq),
            whole_len: None,
        }
    }

    /// A sample as its stream delivered it: stored as it came when it is
    /// the next of the stream the chain follows, so its changes rest on the
    /// chain's previous sample; else it starts a chain, complete.
    fn encode_received(
        &mut self,
        agent_id: &str,
        seq: i64,
        msg: &pb::AgentMessage,
        place: &StreamPlace,
    ) -> Stored {
        let Some(Body::Sample(sample)) = &msg.body else {
            unreachable!("only samples have counters")
        };
        let chain = self.open.get_mut(agent_id).filter(|c| {
            c.last_seq < seq
                && c.len < KEYFRAME_INTERVAL
                && matches!(c.via, Via::Stream { stream, n, .. }
                    if stream == place.stream && n + 1 == place.n)
        });
        let Some(chain) = chain else {
            let body = with_complete(msg, place, |_| true).encode_to_vec();
            let via = Via::Stream {
                stream: place.stream,
                n: place.n,
                devices: sample.allocator.iter().map(|a| a.device).collect(),
            };
            return self.start_chain(agent_id, seq, via, body);
        };
        let Via::Stream { n, devices, .. } = &mut chain.via else {
            unreachable!("checked above")
        };
        // Changes of a device no sample of the chain had rest on a sample
        // before it: that device's counters go complete.
        let lacking = |a: &pb::AllocatorStats| !devices.contains(&a.device);
        let body = match sample
            .allocator
            .iter()
            .any(|a| a.raw_changes.is_some() && lacking(a))
        {
            true => with_complete(msg, place, lacking).encode_to_vec(),
            false => msg.encode_to_vec(),
        };
        for a in &sample.allocator {
            if !devices.contains(&a.device) {
                devices.push(a.device);
            }
        }
        *n = place.n;
        chain.last_seq = seq;
        chain.len += 1;
        let whole_len = delta::complete_len(msg, &place.complete) as i64;
        Stored {
            whole_len: (body.len() as i64 != whole_len).then_some(whole_len),
            body,
            key_seq: Some(chain.key_seq),
        }
    }

    /// The last encoded sample was not stored (its seq already was): its
    /// chain ends, the next sample starts a new one.
    pub fn not_stored(&mut self, agent_id: &str) {
        self.open.remove(agent_id);
    }

    /// The agent's stream ended: its state is freed.
    pub fn forget_agent(&mut self, agent_id: &str) {
        self.open.remove(agent_id);
    }

    /// A transaction failed: no chain may continue from rows that were
    /// never committed.
    pub fn forget(&mut self) {
        self.open.clear();
    }
}

/// True when a stored sample carries changes that need its chain.
fn has_changes(msg: &pb::AgentMessage) -> bool {
    matches!(&msg.body, Some(Body::Sample(s))
        if s.allocator.iter().any(|a| a.raw_changes.is_some()))
}

/// Rebuilds complete counters of stored samples; keeps the chain it last
/// decoded, so samples read in seq order decode each row once.
#[derive(Default)]
pub(super) struct Rebuilder {
    /// (agent, key_seq, last decoded seq) and the decoder after it.
    at: Option<(String, i64, i64)>,
    decoder: delta::Decoder,
}

impl Rebuilder {
    /// `msg` (stored at `seq` in the chain of `key_seq`) with complete counters.
    pub fn complete(
        &mut self,
        conn: &Connection,
        agent_id: &str,
        seq: i64,
        key_seq: Option<i64>,
        mut msg: pb::AgentMessage,
    ) -> Result<pb::AgentMessage> {
        let Some(key_seq) = key_seq else {
            return Ok(msg);
        };
        if !has_changes(&msg) && seq == key_seq {
            // A keyframe: complete, and the start of its chain.
            self.decoder = delta::Decoder::new();
            self.decoder.decode(&mut msg).map_err(|e| {
                anyhow::anyhow!("stored keyframe of agent {agent_id} seq {seq}: {e}")
            })?;
            self.at = Some((agent_id.to_string(), key_seq, seq));
            return Ok(msg);
        }
        let from = match &self.at {
            Some((a, k, last)) if a == agent_id && *k == key_seq && *last < seq => *last + 1,
            _ => {
                self.decoder = delta::Decoder::new();
                key_seq
            }
        };
        let mut decoded = 0;
        // The chain's samples from the last decoded one up to this one;
        // none when samples are read in seq order (no query then).
        if from < seq {
            let mut chain = conn.prepare_cached(
                "SELECT seq, body FROM messages
                 WHERE agent_id = ?1 AND seq >= ?2 AND seq < ?3 AND key_seq = ?4 ORDER BY seq",
            )?;
            let mut rows = chain.query(params![agent_id, from, seq, key_seq])?;
            while let Some(row) = rows.next()? {
                let s: i64 = row.get(0)?;
                let mut m = decode_message(agent_id, s as u64, row.get_ref(1)?.as_blob()?)?;
                self.decoder.decode(&mut m).map_err(|e| {
                    anyhow::anyhow!(
                        "stored sample of agent {agent_id} seq {s} (chain {key_seq}): {e}"
                    )
                })?;
                decoded += 1;
            }
        }
        if from == key_seq && decoded == 0 {
            self.at = None;
            bail!("stored sample of agent {agent_id} seq {seq}: its keyframe (seq {key_seq}) is missing");
        }
        self.decoder.decode(&mut msg).map_err(|e| {
            anyhow::anyhow!("stored sample of agent {agent_id} seq {seq} (chain {key_seq}): {e}")
        })?;
        self.at = Some((agent_id.to_string(), key_seq, seq));
        Ok(msg)
    }
}

/// v4 -> v5: adds the chain columns and stores every agent's samples as
/// chains, agent by agent in seq order, with a progress line.
pub(super) fn migrate_v5(tx: &Transaction<'_>) -> Result<()> {
    tx.execute_batch(
        "ALTER TABLE messages ADD COLUMN key_seq INTEGER;   -- the chain's keyframe (counters.rs)
         ALTER TABLE messages ADD COLUMN whole_len INTEGER; -- the complete message's bytes, if not body's",
    )?;
    let total: i64 = tx.query_row(
        "SELECT count(*) FROM messages WHERE kind = 'sample'",
        [],
        |r| r.get(0),
    )?;
    if total == 0 {
        return Ok(());
    }
    let started = std::time::Instant::now();
    tracing::info!("converting {total} stored samples' counters to changes (schema v5)");
    let mut chains = Chains::default();
    // Read in pages by key and written between them: no row is updated
    // under an open cursor.
    let mut read = tx.prepare(
        "SELECT agent_id, seq, body FROM messages
         WHERE kind = 'sample' AND (agent_id, seq) > (?1, ?2)
         ORDER BY agent_id, seq LIMIT ?3",
    )?;
    let mut write = tx.prepare(
        "UPDATE messages SET body = ?3, key_seq = ?4, whole_len = ?5 WHERE agent_id = ?1 AND seq = ?2",
    )?;
    let mut done = 0u64;
    let mut agent = String::new();
    let mut after = (String::new(), i64::MIN);
    loop {
        let page: Vec<(String, i64, Vec<u8>)> = read
            .query_map(params![after.0, after.1, MIGRATION_PAGE_ROWS], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?
            .collect::<rusqlite::Result<_>>()?;
        let Some(last) = page.last() else { break };
        after = (last.0.clone(), last.1);
        for (agent_id, seq, body) in page {
            if agent_id != agent {
                // Agent by agent: one chain held at a time.
                chains.forget_agent(&agent);
                agent.clone_from(&agent_id);
            }
            let msg = decode_message(&agent_id, seq as u64, &body)?;
            let stored = chains.encode(&agent_id, seq, &msg, None);
            if stored.key_seq.is_some() {
                write
                    .execute(params![
                        agent_id,
                        seq,
                        stored.body,
                        stored.key_seq,
                        stored.whole_len
                    ])
                    .with_context(|| format!("converting seq {seq} of agent {agent_id}"))?;
            }
            done += 1;
            if done.is_multiple_of(MIGRATION_PROGRESS_ROWS) {
                tracing::info!(
                    "converted {done} of {total} samples ({:.0?} so far)",
                    started.elapsed()
                );
            }
        }
    }
    tracing::info!(
        "converted {done} samples to schema v5 in {:.1?}",
        started.elapsed()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    /// A sample whose counters (two devices, 120 each) move a little every
    /// time, as an allocator's do; from seq 70 device 1 gains a counter
    /// (the keys change, so that device goes complete mid-chain).
    fn sample(seq: u64) -> pb::AgentMessage {
        let stats = |device: i32| {
            let mut raw: HashMap<String, i64> = (0..120)
                .map(|k| (format!("counter.{k}"), k * 1000 + (seq as i64 / (k + 1))))
                .collect();
            if device == 1 && seq >= 70 {
                raw.insert("counter.new".into(), seq as i64);
            }
            pb::AllocatorStats {
                device,
                allocated_bytes: seq * 10,
                raw,
                ..Default::default()
            }
        };
        pb::AgentMessage {
            seq,
            body: Some(Body::Sample(pb::Sample {
                time_ns: seq as i64 * 1_000_000,
                allocator: vec![stats(0), stats(1)],
                ..Default::default()
            })),
        }
    }

    fn samples(seqs: impl IntoIterator<Item = u64>) -> Vec<pb::AgentMessage> {
        seqs.into_iter().map(sample).collect()
    }

    /// Every stored sample of "a1" as the timeline returns it, by seq.
    fn read_back(store: &Store) -> Vec<(u64, pb::Sample)> {
        store
            .timeline("a1", 0, 0, 0)
            .unwrap()
            .samples
            .into_iter()
            .map(|t| (t.seq, t.sample.unwrap()))
            .collect()
    }

    fn expected(seqs: impl IntoIterator<Item = u64>) -> Vec<(u64, pb::Sample)> {
        seqs.into_iter()
            .map(|s| match sample(s).body {
                Some(Body::Sample(x)) => (s, x),
                _ => unreachable!(),
            })
            .collect()
    }

    fn column_count(store: &Store, sql: &str) -> i64 {
        store.conn.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    #[test]
    fn resends_late_samples_and_a_restart_read_back_complete() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let mut store = super::super::tests::store_at(&path);
        store.insert_batch("a1", &samples(1..=40)).unwrap();
        // A resend overlapping what is stored, then a gap and a late one.
        store.insert_batch("a1", &samples(30..=45)).unwrap();
        store.insert_batch("a1", &samples([50, 47, 48])).unwrap();
        drop(store);
        // A restart: the writer holds no chain.
        let mut store = Store::open(&path).unwrap();
        store.insert_batch("a1", &samples(51..=100)).unwrap();
        let seqs: Vec<u64> = (1..=45).chain([47, 48, 50]).chain(51..=100).collect();
        assert_eq!(read_back(&store), expected(seqs.clone()));
        // Stored as changes, in chains no longer than the interval.
        let changed = column_count(
            &store,
            "SELECT count(*) FROM messages WHERE whole_len IS NOT NULL",
        );
        assert!(changed > 80, "{changed} stored as changes");
        let longest = column_count(
            &store,
            "SELECT max(n) FROM (SELECT count(*) AS n FROM messages GROUP BY key_seq)",
        );
        assert!(longest <= KEYFRAME_INTERVAL as i64, "a chain of {longest}");
        // Any one sample alone, from its keyframe.
        for (seq, want) in expected(seqs) {
            let mut rebuilder = Rebuilder::default();
            let (body, key_seq): (Vec<u8>, Option<i64>) = store
                .conn
                .query_row(
                    "SELECT body, key_seq FROM messages WHERE agent_id = 'a1' AND seq = ?1",
                    [seq as i64],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .unwrap();
            let msg = decode_message("a1", seq, &body).unwrap();
            let got = rebuilder
                .complete(&store.conn, "a1", seq as i64, key_seq, msg)
                .unwrap();
            assert_eq!(got.body, Some(Body::Sample(want)), "seq {seq}");
        }
    }

    /// `sample(seq)` without device 1 for seqs in `gone`.
    fn sample_without(seq: u64, gone: std::ops::RangeInclusive<u64>) -> pb::AgentMessage {
        let mut m = sample(seq);
        if let Some(Body::Sample(s)) = &mut m.body {
            if gone.contains(&seq) {
                s.allocator.retain(|a| a.device != 1);
            }
        }
        m
    }

    #[test]
    fn samples_stored_as_their_stream_delivered_them_read_back_complete() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = super::super::tests::store_at(&dir.path().join("c.db"));
        // Device 1 leaves the stream for seqs 20..=45, so when it comes back
        // its changes rest on seq 19, before the chain that holds seq 46.
        let originals: Vec<_> = (1..=130).map(|s| sample_without(s, 20..=45)).collect();
        let (mut sender, mut follower) = (delta::Encoder::new(), delta::Decoder::new());
        let stream = new_stream();
        let received: Vec<Received> = originals
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let msg = sender.encode(m.clone());
                let complete = follower.follow(&msg).unwrap();
                Received {
                    msg,
                    place: Some(StreamPlace {
                        stream,
                        n: i as u64 + 1,
                        complete,
                    }),
                }
            })
            .collect();
        // Batches of uneven sizes; seq 60 decoded but never stored (as a
        // message ingest rejects), so seq 61 cannot rest on the chain.
        let mut at = 0;
        for size in [1, 7, 30, 21, 2, 256].into_iter().cycle() {
            let end = (at + size).min(received.len());
            let batch: Vec<Received> = received[at..end]
                .iter()
                .filter(|r| r.msg.seq != 60)
                .cloned()
                .collect();
            store.insert_batch("a1", &batch).unwrap();
            at = end;
            if at == received.len() {
                break;
            }
        }
        // A resend of what is stored (a new stream: complete first) is the
        // same content, so it is acked and changes nothing.
        let (mut sender, mut follower, stream) =
            (delta::Encoder::new(), delta::Decoder::new(), new_stream());
        let resent: Vec<Received> = originals[99..110]
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let msg = sender.encode(m.clone());
                let complete = follower.follow(&msg).unwrap();
                let place = Some(StreamPlace {
                    stream,
                    n: i as u64 + 1,
                    complete,
                });
                Received { msg, place }
            })
            .collect();
        let outcome = store.insert_batch("a1", &resent).unwrap();
        assert_eq!(outcome.stored, (100..=110).collect::<Vec<_>>());
        assert!(outcome.fresh.is_empty() && outcome.conflicting.is_empty());

        let seqs: Vec<u64> = (1..=130).filter(|&s| s != 60).collect();
        let want: Vec<(u64, pb::Sample)> = seqs
            .iter()
            .map(|&s| match sample_without(s, 20..=45).body {
                Some(Body::Sample(x)) => (s, x),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(read_back(&store), want);
        // Stored as they came: most rows are the wire's bytes, and every
        // row states the complete message's size.
        let rows: Vec<(i64, Vec<u8>, i64, Option<i64>)> = store
            .conn
            .prepare("SELECT seq, body, key_seq, whole_len FROM messages ORDER BY seq")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        let mut as_sent = 0;
        for (seq, body, key_seq, whole_len) in &rows {
            let i = *seq as usize - 1;
            let whole = originals[i].encoded_len() as i64;
            assert_eq!(whole_len.unwrap_or(body.len() as i64), whole, "seq {seq}");
            as_sent += usize::from(*body == received[i].msg.encode_to_vec() && seq != key_seq);
        }
        assert!(as_sent >= 110, "{as_sent} of {} stored as sent", rows.len());
        // Chains no longer than the interval; new ones at seq 61 (after the
        // gap) and where device 1 came back complete inside a chain.
        let keyframes: Vec<i64> = rows.iter().filter(|r| r.0 == r.2).map(|r| r.0).collect();
        assert!(keyframes.contains(&61), "{keyframes:?}");
        let longest = column_count(
            &store,
            "SELECT max(n) FROM (SELECT count(*) AS n FROM messages GROUP BY key_seq)",
        );
        assert!(longest <= KEYFRAME_INTERVAL as i64, "a chain of {longest}");
    }

    #[test]
    fn a_version_4_store_is_converted_and_reads_back_complete() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v4.db");
        let originals = samples(1..=100);
        {
            // Written, then turned back into what version 4 stored: every
            // body complete, no chain columns.
            let mut store = super::super::tests::store_at(&path);
            store.insert_batch("a1", &originals).unwrap();
            for m in &originals {
                store
                    .conn
                    .execute(
                        "UPDATE messages SET body = ?2 WHERE agent_id = 'a1' AND seq = ?1",
                        params![m.seq as i64, m.encode_to_vec()],
                    )
                    .unwrap();
            }
            store
                .conn
                .execute_batch(
                    "DROP INDEX IF EXISTS messages_by_chain;
                     ALTER TABLE messages DROP COLUMN key_seq;
                     ALTER TABLE messages DROP COLUMN whole_len;
                     PRAGMA user_version = 4;",
                )
                .unwrap();
        }
        let mut store = Store::open(&path).unwrap();
        let changed = column_count(
            &store,
            "SELECT count(*) FROM messages WHERE whole_len IS NOT NULL",
        );
        assert!(changed > 80, "{changed} converted to changes");
        assert_eq!(read_back(&store), expected(1..=100));
        // And the writer goes on after it.
        store.insert_batch("a1", &samples(101..=120)).unwrap();
        assert_eq!(read_back(&store), expected(1..=120));
    }
}
