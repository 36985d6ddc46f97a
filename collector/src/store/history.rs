//! The read path of timelines and of the analysis, bounded whatever the
//! history's length (see `collector/STORAGE.md`):
//!
//! - every range query walks an index in time order: `messages_by_time`
//!   (agent, kind, time, seq) for picking samples and for events, the
//!   `figures` table's own key (agent, time, seq) for sample records;
//! - a timeline is thinned in the store: the (time, seq) keys come from
//!   seeks along the time index, and only the kept samples are read and
//!   decoded;
//! - every reply fits under the gRPC limit: samples are sent whole when the
//!   kept ones fit [`DEFAULT_SAMPLE_REPLY_BYTES`], else as their figures
//!   (no `raw` allocator dicts), thinned further if even those do not fit;
//!   events keep the newest [`DEFAULT_EVENT_REPLY_BYTES`].

use anyhow::{anyhow, bail, Result};
use oomscope_analysis::{request_readings, Evidence, IncidentRef};
use oomscope_proto::MAX_MESSAGE_BYTES;
use prost::Message;
use rusqlite::{params, OptionalExtension};

use super::{counters, decode_message, figures, marks, rollups, Store};
use crate::pb;
use crate::pb::agent_message::Body;

/// The most samples one timeline reply holds, however many it asks for
/// (`max_points` 0, "all", means this many): a chart has fewer pixels, and
/// it bounds the collector's memory per query.
pub const DEFAULT_MAX_TIMELINE_SAMPLES: u32 = 20_000;

/// Encoded bytes of samples in one reply: half the gRPC limit, leaving room
/// for the events, the Hello and an instance's members.
pub const DEFAULT_SAMPLE_REPLY_BYTES: usize = MAX_MESSAGE_BYTES / 2;

/// Encoded bytes of events in one reply (the newest are kept): a quarter of
/// the gRPC limit, thousands of request events or a few OOM snapshots.
pub const DEFAULT_EVENT_REPLY_BYTES: usize = MAX_MESSAGE_BYTES / 4;

/// Encoded bytes of events one analysis reads (the newest are kept): it
/// holds them decoded, so this bounds the collector's memory per diagnosis.
pub const DEFAULT_ANALYSIS_EVENT_BYTES: usize = 32 << 20;

/// One agent's Hello and its samples and events in a time range, oldest
/// first, each with its seq.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct AgentHistory {
    pub hello: pb::Hello,
    pub samples: Vec<pb::TimedSample>,
    pub events: Vec<pb::TimedEvent>,
}

impl AgentHistory {
    /// The analysis's view: the same messages without seqs, plus the
    /// incident being diagnosed, if any.
    /// Batches of request readings become the boundary points and request
    /// events they stand for (`request_readings::expand_all`).
    pub fn into_evidence(self, incident: Option<IncidentRef>) -> Evidence {
        let mut samples: Vec<pb::Sample> =
            self.samples.into_iter().filter_map(|s| s.sample).collect();
        let mut events: Vec<pb::Event> = self.events.into_iter().filter_map(|e| e.event).collect();
        request_readings::expand_all(&mut samples, &mut events);
        Evidence {
            hello: Some(self.hello),
            samples,
            events,
            incident,
            members: Vec::new(),
            ended: false,
        }
    }
}

/// Encoded bytes a timeline reply may grow by when its batches of request
/// readings are expanded into points and events: the quarter of the gRPC
/// limit the samples' and events' budgets leave. Past it the oldest batches
/// stay as sent (their readings still whole in `Sample.requests`).
pub const DEFAULT_EXPANDED_REPLY_BYTES: usize = MAX_MESSAGE_BYTES / 4 - (64 << 10);

/// A timeline's batches of request readings as the boundary points and
/// request events they stand for (each with its batch's seq), newest batch
/// first while the added bytes fit `budget`; each list stays in time order.
fn expand_requests(
    samples: &mut Vec<pb::TimedSample>,
    events: &mut Vec<pb::TimedEvent>,
    budget: usize,
) {
    let mut added = 0usize;
    let (mut more_samples, mut more_events) = (Vec::new(), Vec::new());
    for t in samples.iter_mut().rev() {
        let Some(s) = t.sample.as_mut() else { continue };
        let Some(batch) = &s.requests else { continue };
        // Expanded, a batch is about its own size again (points and
        // events repeat the readings' fields).
        added += batch.encoded_len();
        if added > budget {
            break;
        }
        let e = request_readings::expand(s);
        let seq = t.seq;
        more_samples.extend(e.samples.into_iter().map(|s| pb::TimedSample {
            seq,
            sample: Some(s),
            ..Default::default()
        }));
        more_events.extend(e.events.into_iter().map(|e| pb::TimedEvent {
            seq,
            event: Some(e),
            ..Default::default()
        }));
    }
    let time_s = |t: &pb::TimedSample| t.sample.as_ref().map_or(0, |s| s.time_ns);
    let time_e = |t: &pb::TimedEvent| t.event.as_ref().map_or(0, |e| e.time_ns);
    if !more_samples.is_empty() {
        samples.extend(more_samples);
        samples.sort_by_key(time_s);
    }
    if !more_events.is_empty() {
        events.extend(more_events);
        events.sort_by_key(time_e);
    }
}

/// A stored sample's place: (time_ns, seq).
type Key = (i64, i64);

impl Store {
    /// Samples and events of one agent with `from_ns <= time_ns <= to_ns`
    /// (`to_ns == 0`: no upper bound), oldest first. The samples are thinned
    /// evenly to at most `max_points` (0 or more than
    /// [`DEFAULT_MAX_TIMELINE_SAMPLES`]: that many), keeping the first and
    /// the last; see the module's doc for how the reply stays bounded.
    pub fn timeline(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
        max_points: u32,
    ) -> Result<pb::TimelineResponse> {
        let to_ns = if to_ns == 0 { i64::MAX } else { to_ns };
        let hello = self.known_hello(agent_id)?;
        let max = match max_points {
            0 => DEFAULT_MAX_TIMELINE_SAMPLES,
            n => n.min(DEFAULT_MAX_TIMELINE_SAMPLES),
        };
        let (keys, thinned) = self.picked_keys(agent_id, from_ns, to_ns, max as usize)?;
        let mut samples = match self.whole_samples(agent_id, &keys, DEFAULT_SAMPLE_REPLY_BYTES)? {
            Some(whole) => whole,
            None => self.figures_within(agent_id, &keys, DEFAULT_SAMPLE_REPLY_BYTES)?,
        };
        if thinned {
            samples = self.with_envelopes(agent_id, samples, DEFAULT_SAMPLE_REPLY_BYTES)?;
            marks::fold_into(&self.conn, agent_id, &mut samples)?;
        }
        let (mut events, events_cut_ns) =
            self.newest_events(agent_id, from_ns, to_ns, DEFAULT_EVENT_REPLY_BYTES)?;
        expand_requests(&mut samples, &mut events, DEFAULT_EXPANDED_REPLY_BYTES);
        Ok(pb::TimelineResponse {
            hello: Some(hello),
            samples,
            events,
            members: Vec::new(),
            events_cut_ns,
        })
    }

    /// Thinned points with each one's envelope (`TimedSample.low`/`high`):
    /// the rollup buckets starting in its stretch, from its own time to the
    /// next point's, plus its own reading. The first takes in the bucket it
    /// falls in, which may start a little before it. Thinned further (ends
    /// kept) while points and envelopes pass `budget` together.
    fn with_envelopes(
        &self,
        agent_id: &str,
        mut points: Vec<pb::TimedSample>,
        budget: usize,
    ) -> Result<Vec<pb::TimedSample>> {
        let time = |p: &pb::TimedSample| p.sample.as_ref().map_or(0, |s| s.time_ns);
        loop {
            let (Some(first), Some(last)) = (points.first(), points.last()) else {
                return Ok(points);
            };
            let (t0, t1) = (time(first), time(last));
            let spacing = (t1 - t0) / (points.len() as i64 - 1).max(1);
            let width_s = rollups::width_for(spacing);
            let mut envelopes = vec![rollups::Envelope::default(); points.len()];
            for (p, e) in points.iter().zip(envelopes.iter_mut()) {
                if let Some(s) = &p.sample {
                    e.take(s);
                }
            }
            let mut stmt = self.conn.prepare_cached(
                "SELECT bucket_ns, samples, low, high FROM rollups
                 WHERE agent_id = ?1 AND width_s = ?2 AND bucket_ns BETWEEN ?3 AND ?4
                 ORDER BY bucket_ns",
            )?;
            let mut rows = stmt.query(params![
                agent_id,
                width_s,
                rollups::bucket_of(t0, width_s),
                t1
            ])?;
            while let Some(row) = rows.next()? {
                let bucket_ns: i64 = row.get(0)?;
                let bucket = rollups::envelope(
                    agent_id,
                    bucket_ns,
                    row.get(1)?,
                    row.get_ref(2)?.as_blob()?,
                    row.get_ref(3)?.as_blob()?,
                )?;
                // The last point at or before the bucket's start.
                let at = points
                    .partition_point(|p| time(p) <= bucket_ns)
                    .saturating_sub(1);
                envelopes[at].merge(&bucket);
            }
            let bytes: usize = points
                .iter()
                .zip(&envelopes)
                .map(|(p, e)| p.encoded_len() + e.low.encoded_len() + e.high.encoded_len())
                .sum();
            if bytes > budget && points.len() > 2 {
                let n = points.len();
                let fit = (n as u128 * budget as u128 / bytes as u128) as usize;
                points = downsample(points, fit.clamp(2, n - 1));
                continue;
            }
            for (p, mut e) in points.iter_mut().zip(envelopes) {
                let t = time(p);
                (e.low.time_ns, e.high.time_ns) = (t, t);
                p.low = Some(e.low);
                p.high = Some(e.high);
            }
            return Ok(points);
        }
    }

    /// What the analysis reads of one agent in `from_ns..=to_ns`: its
    /// Hello, the figures of every sample (oldest first) and the newest
    /// [`DEFAULT_ANALYSIS_EVENT_BYTES`] of events. Callers bound the range
    /// (see [`Store::window_start`]).
    pub fn history(&self, agent_id: &str, from_ns: i64, to_ns: i64) -> Result<AgentHistory> {
        let hello = self.known_hello(agent_id)?;
        let samples = self
            .history_samples(agent_id, from_ns, to_ns, usize::MAX)?
            .unwrap_or_default();
        let (events, _) =
            self.newest_events(agent_id, from_ns, to_ns, DEFAULT_ANALYSIS_EVENT_BYTES)?;
        Ok(AgentHistory {
            hello,
            samples,
            events,
        })
    }

    /// The figures of the agent's samples in `from_ns..=to_ns`, oldest
    /// first, along the figures' key; None when there are more than `limit`.
    pub fn history_samples(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
        limit: usize,
    ) -> Result<Option<Vec<pb::TimedSample>>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq, sample FROM figures
             WHERE agent_id = ?1 AND time_ns BETWEEN ?2 AND ?3 ORDER BY time_ns, seq",
        )?;
        let mut rows = stmt.query(params![agent_id, from_ns, to_ns])?;
        let mut samples = Vec::new();
        while let Some(row) = rows.next()? {
            if samples.len() == limit {
                return Ok(None);
            }
            let seq = row.get::<_, i64>(0)? as u64;
            let blob = row.get_ref(1)?.as_blob()?;
            samples.push(pb::TimedSample {
                seq,
                sample: Some(figures::decode(agent_id, seq, blob)?),
                ..Default::default()
            });
        }
        Ok(Some(samples))
    }

    /// The start of the window holding the newest `max_samples` samples in
    /// `from_ns..=to_ns`: `from_ns` itself when the range holds no more.
    pub fn window_start(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
        max_samples: u32,
    ) -> Result<i64> {
        let nth: Option<i64> = self
            .conn
            .query_row(
                "SELECT time_ns FROM messages
                 WHERE agent_id = ?1 AND kind = 'sample' AND time_ns BETWEEN ?2 AND ?3
                 ORDER BY time_ns DESC, seq DESC LIMIT 1 OFFSET ?4",
                params![agent_id, from_ns, to_ns, i64::from(max_samples.max(1)) - 1],
                |r| r.get(0),
            )
            .optional()?;
        Ok(nth.map_or(from_ns, |t| t.max(from_ns)))
    }

    /// What the analysis needs about an agent: its Hello, samples and events
    /// up to `to_ns` (all of them when None), oldest first.
    pub fn evidence(&self, agent_id: &str, to_ns: Option<i64>) -> Result<Evidence> {
        Ok(self
            .history(agent_id, i64::MIN, to_ns.unwrap_or(i64::MAX))?
            .into_evidence(None))
    }

    /// Up to `max` samples' figures in `from_ns..=to_ns`, thinned evenly in
    /// time (first and last kept) as a timeline is, oldest first.
    pub fn thinned_figures(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
        max: u32,
    ) -> Result<Vec<pb::TimedSample>> {
        let keys = self.sample_keys(agent_id, from_ns, to_ns, max as usize)?;
        self.figures_within(agent_id, &keys, DEFAULT_SAMPLE_REPLY_BYTES)
    }

    /// The agent's latest sample figures in `at_ns - max_age_ns ..= at_ns`.
    pub fn sample_at(
        &self,
        agent_id: &str,
        at_ns: i64,
        max_age_ns: i64,
    ) -> Result<Option<pb::Sample>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq, sample FROM figures WHERE agent_id = ?1 AND time_ns BETWEEN ?2 AND ?3
             ORDER BY time_ns DESC, seq DESC LIMIT 1",
        )?;
        let mut rows = stmt.query(params![agent_id, at_ns.saturating_sub(max_age_ns), at_ns])?;
        match rows.next()? {
            Some(row) => {
                let seq = row.get::<_, i64>(0)? as u64;
                Ok(Some(figures::decode(
                    agent_id,
                    seq,
                    row.get_ref(1)?.as_blob()?,
                )?))
            }
            None => Ok(None),
        }
    }

    fn known_hello(&self, agent_id: &str) -> Result<pb::Hello> {
        self.hello(agent_id)?
            .ok_or_else(|| anyhow!("unknown agent {agent_id:?}"))
    }

    /// The keys of the samples in range: all of them when they number at
    /// most `max`, else at most `max` spread evenly in time, first and last
    /// kept: the sample at or after each of `max` evenly spaced moments,
    /// found by a seek along the time index each. The work grows with `max`
    /// (and the log of the history), never with the history's length.
    fn sample_keys(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
        max: usize,
    ) -> Result<Vec<Key>> {
        Ok(self.picked_keys(agent_id, from_ns, to_ns, max)?.0)
    }

    /// [`Store::sample_keys`], and whether samples were left out.
    fn picked_keys(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
        max: usize,
    ) -> Result<(Vec<Key>, bool)> {
        let max = max.max(1);
        let mut head = self.conn.prepare_cached(
            "SELECT time_ns, seq FROM messages
             WHERE agent_id = ?1 AND kind = 'sample' AND time_ns BETWEEN ?2 AND ?3
             ORDER BY time_ns, seq LIMIT ?4",
        )?;
        let keys = head
            .query_map(params![agent_id, from_ns, to_ns, max as i64 + 1], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?
            .collect::<rusqlite::Result<Vec<Key>>>()?;
        if keys.len() <= max {
            return Ok((keys, false));
        }
        let first = keys[0];
        let last: Key = self.conn.query_row(
            "SELECT time_ns, seq FROM messages
             WHERE agent_id = ?1 AND kind = 'sample' AND time_ns BETWEEN ?2 AND ?3
             ORDER BY time_ns DESC, seq DESC LIMIT 1",
            params![agent_id, from_ns, to_ns],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        drop(keys);
        if max == 1 {
            return Ok((vec![last], true));
        }
        let mut seek = self.conn.prepare_cached(
            "SELECT time_ns, seq FROM messages
             WHERE agent_id = ?1 AND kind = 'sample' AND time_ns BETWEEN ?2 AND ?3
             ORDER BY time_ns, seq LIMIT 1",
        )?;
        let span = i128::from(last.0) - i128::from(first.0);
        let mut out: Vec<Key> = vec![first];
        for i in 1..max - 1 {
            let at = (i128::from(first.0) + span * i as i128 / (max as i128 - 1)) as i64;
            // Past the previous pick, so a sparse stretch gives no repeats.
            let after = out.last().map_or(at, |p| at.max(p.0 + 1));
            let next: Option<Key> = seek
                .query_row(params![agent_id, after, last.0], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .optional()?;
            match next {
                Some(k) if k < last => out.push(k),
                _ => break,
            }
        }
        out.push(last);
        Ok((out, true))
    }

    /// The kept samples as the agent sent them, or None when their encoded
    /// bytes pass `budget`: measured first from the stored lengths (SQLite
    /// reads a blob's length from its row header, not its pages), so a
    /// reply that will not fit decodes nothing.
    fn whole_samples(
        &self,
        agent_id: &str,
        keys: &[Key],
        budget: usize,
    ) -> Result<Option<Vec<pb::TimedSample>>> {
        let mut size = self
            .conn
            .prepare_cached(
                "SELECT coalesce(whole_len, length(body)) FROM messages WHERE agent_id = ?1 AND seq = ?2",
            )?;
        let mut bytes = 0usize;
        for &(_, seq) in keys {
            let len: Option<i64> = size
                .query_row(params![agent_id, seq], |r| r.get(0))
                .optional()?;
            bytes += len.unwrap_or(0) as usize;
            if bytes > budget {
                return Ok(None);
            }
        }
        let mut stmt = self.conn.prepare_cached(
            "SELECT body, key_seq FROM messages WHERE agent_id = ?1 AND seq = ?2",
        )?;
        let mut out = Vec::with_capacity(keys.len());
        // Counters stored as changes come back complete (`counters.rs`).
        let mut rebuilder = counters::Rebuilder::default();
        for &(_, seq) in keys {
            let mut rows = stmt.query(params![agent_id, seq])?;
            let Some(row) = rows.next()? else { continue };
            let stored = decode_message(agent_id, seq as u64, row.get_ref(0)?.as_blob()?)?;
            let key_seq: Option<i64> = row.get(1)?;
            match rebuilder
                .complete(&self.conn, agent_id, seq, key_seq, stored)?
                .body
            {
                Some(Body::Sample(s)) => out.push(pb::TimedSample {
                    seq: seq as u64,
                    sample: Some(s),
                    ..Default::default()
                }),
                _ => bail!("agent {agent_id} seq {seq}: stored row is not a sample"),
            }
        }
        Ok(Some(out))
    }

    /// The kept samples' figures, thinned further (evenly, ends kept) when
    /// even those pass `budget`.
    fn figures_within(
        &self,
        agent_id: &str,
        keys: &[Key],
        budget: usize,
    ) -> Result<Vec<pb::TimedSample>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT sample FROM figures WHERE agent_id = ?1 AND time_ns = ?2 AND seq = ?3",
        )?;
        let mut out = Vec::with_capacity(keys.len());
        let mut bytes = 0usize;
        for &(time_ns, seq) in keys {
            let mut rows = stmt.query(params![agent_id, time_ns, seq])?;
            let Some(row) = rows.next()? else { continue };
            let blob = row.get_ref(0)?.as_blob()?;
            bytes += blob.len();
            out.push(pb::TimedSample {
                seq: seq as u64,
                sample: Some(figures::decode(agent_id, seq as u64, blob)?),
                ..Default::default()
            });
        }
        if bytes > budget {
            let fit = (out.len() as u128 * budget as u128 / bytes as u128) as usize;
            out = downsample(out, fit.max(2));
        }
        Ok(out)
    }

    /// Events in range, oldest first: the newest ones, up to `budget`
    /// encoded bytes, read newest first along the time index; and the time
    /// before which events were left out (0: none were).
    pub(super) fn newest_events(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
        budget: usize,
    ) -> Result<(Vec<pb::TimedEvent>, i64)> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq, body FROM messages
             WHERE agent_id = ?1 AND kind = 'event' AND time_ns BETWEEN ?2 AND ?3
             ORDER BY time_ns DESC, seq DESC",
        )?;
        let mut rows = stmt.query(params![agent_id, from_ns, to_ns])?;
        let mut events: Vec<pb::TimedEvent> = Vec::new();
        let mut bytes = 0usize;
        let mut cut_ns = 0;
        while let Some(row) = rows.next()? {
            let seq = row.get::<_, i64>(0)? as u64;
            let body = row.get_ref(1)?.as_blob()?;
            bytes += body.len();
            if bytes > budget {
                tracing::debug!(
                    agent_id,
                    "events before seq {seq} left out of a reply: over {budget} bytes"
                );
                // The oldest kept event's time (no earlier one is in the reply).
                cut_ns = events
                    .last()
                    .and_then(|e| e.event.as_ref())
                    .map_or(to_ns, |e| e.time_ns);
                break;
            }
            match decode_message(agent_id, seq, body)?.body {
                Some(Body::Event(event)) => events.push(pb::TimedEvent {
                    seq,
                    event: Some(event),
                    agent_id: String::new(),
                }),
                _ => bail!("agent {agent_id} seq {seq}: stored row is not an event"),
            }
        }
        events.reverse();
        Ok((events, cut_ns))
    }
}

/// Which of `n` items in order an even thinning to `max` keeps: index
/// i*(n-1)/(max-1) for i in 0..max (first and last kept), all when n <= max.
struct Spread {
    n: usize,
    max: usize,
    next: usize,
}

impl Spread {
    fn new(n: usize, max: usize) -> Spread {
        Spread {
            n,
            max: if max == 0 { n } else { max.min(n) },
            next: 0,
        }
    }

    fn at(&self, i: usize) -> usize {
        match (self.max, self.n) {
            (m, n) if m >= n => i,
            // One kept: the newest.
            (1, n) => n - 1,
            (m, n) => i * (n - 1) / (m - 1),
        }
    }

    /// True when item `idx` (asked in increasing order) is kept.
    fn keeps(&mut self, idx: usize) -> bool {
        if self.done() || self.at(self.next) != idx {
            return false;
        }
        self.next += 1;
        true
    }

    fn done(&self) -> bool {
        self.next >= self.max
    }
}

/// Keeps at most `max` items spread evenly, first and last included; 0 keeps all.
pub(super) fn downsample<T>(items: Vec<T>, max: usize) -> Vec<T> {
    let mut spread = Spread::new(items.len(), max);
    items
        .into_iter()
        .enumerate()
        .filter_map(|(idx, item)| spread.keeps(idx).then_some(item))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent "a1" with `n` samples one second apart (time_ns 1 s, 2 s,
    /// ...), each with an allocator reading of `seq` MiB and a `raw` dict of
    /// `raw_keys` counters, and an event every tenth second.
    fn agent(n: u64, raw_keys: usize) -> Store {
        let mut store = super::super::tests::store_with_a1();
        let mut batch = Vec::new();
        for seq in 1..=n {
            let time_ns = seq as i64 * 1_000_000_000;
            let raw = (0..raw_keys)
                .map(|k| (format!("allocated_bytes.all.counter_{k}"), k as i64))
                .collect();
            batch.push(pb::AgentMessage {
                seq,
                body: Some(Body::Sample(pb::Sample {
                    time_ns,
                    allocator: vec![pb::AllocatorStats {
                        allocated_bytes: seq << 20,
                        raw,
                        ..Default::default()
                    }],
                    ..Default::default()
                })),
            });
        }
        store.insert_batch("a1", &batch).unwrap();
        let events: Vec<pb::AgentMessage> = (1..=n / 10)
            .map(|i| pb::AgentMessage {
                seq: n + i,
                body: Some(Body::Event(pb::Event {
                    time_ns: i as i64 * 10_000_000_000,
                    kind: Some(pb::event::Kind::Gc(Default::default())),
                })),
            })
            .collect();
        store.insert_batch("a1", &events).unwrap();
        store
    }

    fn allocated(samples: &[pb::TimedSample]) -> Vec<u64> {
        samples
            .iter()
            .map(|s| s.sample.as_ref().unwrap().allocator[0].allocated_bytes >> 20)
            .collect()
    }

    #[test]
    fn every_read_walks_an_index_in_time_order() {
        let store = agent(10, 0);
        let reads = [
            "SELECT count(*) FROM messages WHERE agent_id = 'a1' AND kind = 'sample' AND time_ns BETWEEN 0 AND 9",
            "SELECT time_ns, seq FROM messages WHERE agent_id = 'a1' AND kind = 'sample' AND time_ns BETWEEN 0 AND 9 ORDER BY time_ns, seq",
            "SELECT seq, body FROM messages WHERE agent_id = 'a1' AND kind = 'event' AND time_ns BETWEEN 0 AND 9 ORDER BY time_ns DESC, seq DESC",
            "SELECT time_ns FROM messages WHERE agent_id = 'a1' AND kind = 'sample' AND time_ns BETWEEN 0 AND 9 ORDER BY time_ns DESC, seq DESC LIMIT 1 OFFSET 3",
            "SELECT seq, sample FROM figures WHERE agent_id = 'a1' AND time_ns BETWEEN 0 AND 9 ORDER BY time_ns, seq",
            "SELECT seq, sample FROM figures WHERE agent_id = 'a1' AND time_ns BETWEEN 0 AND 9 ORDER BY time_ns DESC, seq DESC LIMIT 1",
        ];
        for sql in reads {
            let plan: Vec<String> = {
                let mut stmt = store
                    .conn
                    .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .unwrap();
                let rows = stmt.query_map([], |r| r.get::<_, String>(3)).unwrap();
                rows.map(|r| r.unwrap()).collect()
            };
            let plan = plan.join("; ");
            assert!(!plan.contains("TEMP B-TREE"), "{sql}: {plan}");
            assert!(
                plan.contains(
                    "INDEX messages_by_time (agent_id=? AND kind=? AND time_ns>? AND time_ns<?)"
                ) || plan.contains("INDEX figures_by_key (agent_id=? AND time_ns>? AND time_ns<?)"),
                "{sql}: {plan}"
            );
        }
    }

    #[test]
    fn a_timeline_is_thinned_from_the_index_and_keeps_its_ends() {
        let store = agent(1000, 3);
        let t = store.timeline("a1", 0, 0, 5).unwrap();
        // The samples at or after 1 s, 250.75 s, 500.5 s, 750.25 s, and the last.
        assert_eq!(allocated(&t.samples), [1, 251, 501, 751, 1000]);
        assert_eq!(t.events.len(), 100, "every event");
        assert!(
            t.events.windows(2).all(|w| w[0].seq < w[1].seq),
            "oldest first"
        );
        // Few enough to send whole: the raw dicts come too.
        assert_eq!(
            t.samples[0].sample.as_ref().unwrap().allocator[0].raw.len(),
            3
        );
        // A range reads only its range.
        let t = store
            .timeline("a1", 901_000_000_000, 950_000_000_000, 0)
            .unwrap();
        assert_eq!(allocated(&t.samples), (901..=950).collect::<Vec<_>>());
        assert_eq!(t.events.len(), 5);
    }

    #[test]
    fn a_thinned_timeline_states_every_drop_on_the_point_that_stands_for_it() {
        let mut store = super::super::tests::store_with_a1();
        // Samples 1..=100, 1 s apart; three carry a statement of drops.
        let stated = |seq: u64| match seq {
            10 => Some((4, 40, 2)),
            30 => Some((6, 60, 4)),
            51 => Some((1, 0, 1)),
            _ => None,
        };
        let batch: Vec<pb::AgentMessage> = (1..=100)
            .map(|seq| pb::AgentMessage {
                seq,
                body: Some(Body::Sample(pb::Sample {
                    time_ns: seq as i64 * 1_000_000_000,
                    dropped_before: stated(seq).map(|(samples, requests, stride)| {
                        pb::DroppedBefore {
                            samples,
                            requests,
                            stride,
                            ..Default::default()
                        }
                    }),
                    ..Default::default()
                })),
            })
            .collect();
        store.insert_batch("a1", &batch).unwrap();
        let t = store.timeline("a1", 0, 0, 5).unwrap();
        let marks: Vec<(u64, u64, u64, u32)> = t
            .samples
            .iter()
            .filter_map(|p| {
                let d = p.sample.as_ref()?.dropped_before?;
                Some((p.seq, d.samples, d.requests, d.stride))
            })
            .collect();
        let kept: Vec<u64> = t.samples.iter().map(|p| p.seq).collect();
        assert_eq!(kept.len(), 5, "{kept:?}");
        // Seqs 10 and 30 fall before the second kept point (26 s or 51 s
        // on), 51 at or before the third: each total on the first kept
        // point at or after it, none lost, none twice.
        let first_after = |seq: u64| *kept.iter().find(|&&k| k >= seq).unwrap();
        let mut expected: Vec<(u64, u64, u64, u32)> = Vec::new();
        for seq in [10, 30, 51] {
            let (s, r, k) = stated(seq).unwrap();
            let at = first_after(seq);
            match expected.iter_mut().find(|e| e.0 == at) {
                Some(e) => (e.1, e.2, e.3) = (e.1 + s, e.2 + r, e.3.max(k)),
                None => expected.push((at, s, r, k)),
            }
        }
        assert_eq!(marks, expected, "kept {kept:?}");
        assert_eq!(marks.iter().map(|m| m.1).sum::<u64>(), 11);
        // Unthinned, each statement stays on its own sample.
        let whole = store.timeline("a1", 0, 0, 0).unwrap();
        let own: Vec<u64> = whole
            .samples
            .iter()
            .filter(|p| p.sample.as_ref().unwrap().dropped_before.is_some())
            .map(|p| p.seq)
            .collect();
        assert_eq!(own, [10, 30, 51]);
    }

    #[test]
    fn a_burst_thins_by_time_without_repeats() {
        let mut store = super::super::tests::store_with_a1();
        // 500 samples 1 ms apart, then 20 one second apart.
        let times = (0..500)
            .map(|i| i * 1_000_000)
            .chain((1..=20).map(|i| i * 1_000_000_000));
        let batch: Vec<pb::AgentMessage> = times
            .enumerate()
            .map(|(i, time_ns)| pb::AgentMessage {
                seq: i as u64 + 1,
                body: Some(Body::Sample(pb::Sample {
                    time_ns,
                    ..Default::default()
                })),
            })
            .collect();
        store.insert_batch("a1", &batch).unwrap();
        let keys = store.sample_keys("a1", i64::MIN, i64::MAX, 11).unwrap();
        let seqs: Vec<i64> = keys.iter().map(|k| k.1).collect();
        // 0 s, then the first sample at or after 2 s, 4 s, ... 18 s, and the last (20 s).
        assert_eq!(seqs, [1, 502, 504, 506, 508, 510, 512, 514, 516, 518, 520]);
        let keys = store.sample_keys("a1", 0, 499_000_000, 10_000).unwrap();
        assert_eq!(keys.len(), 500, "fewer than asked: all of them");
    }

    #[test]
    fn samples_over_the_budget_come_as_figures_and_then_thinner() {
        let store = agent(100, 100);
        let keys = store.sample_keys("a1", i64::MIN, i64::MAX, 100).unwrap();
        assert_eq!(keys.len(), 100);
        let whole_bytes: usize = {
            let sql =
                "SELECT sum(coalesce(whole_len, length(body))) FROM messages WHERE kind = 'sample'";
            store
                .conn
                .query_row(sql, [], |r| r.get::<_, i64>(0))
                .unwrap() as usize
        };
        assert!(store
            .whole_samples("a1", &keys, whole_bytes)
            .unwrap()
            .is_some());
        assert!(store
            .whole_samples("a1", &keys, whole_bytes / 2)
            .unwrap()
            .is_none());
        let figures = store.figures_within("a1", &keys, whole_bytes / 2).unwrap();
        assert_eq!(
            allocated(&figures),
            (1..=100).collect::<Vec<_>>(),
            "every figure fits"
        );
        assert!(figures
            .iter()
            .all(|s| s.sample.as_ref().unwrap().allocator[0].raw.is_empty()));
        let record: usize = {
            let sql = "SELECT max(length(sample)) FROM figures";
            store
                .conn
                .query_row(sql, [], |r| r.get::<_, i64>(0))
                .unwrap() as usize
        };
        assert!(
            record * 10 < whole_bytes / 100,
            "a record is a tenth of the sample: {record}"
        );
        // A budget for 25 of the largest records: what comes fits it, spread, ends kept.
        let budget = 25 * record;
        let thin = store.figures_within("a1", &keys, budget).unwrap();
        let got = allocated(&thin);
        let bytes: usize = thin
            .iter()
            .map(|s| prost::Message::encoded_len(s.sample.as_ref().unwrap()))
            .sum();
        assert!(bytes <= budget && got.len() >= 20, "{bytes} bytes: {got:?}");
        assert_eq!((got[0], *got.last().unwrap()), (1, 100));
        assert!(
            got.windows(2).all(|w| w[1] - w[0] >= 3 && w[1] - w[0] <= 5),
            "{got:?}"
        );
    }

    /// One boundary message of `n` requests, each begun and ended within
    /// its own second (the k-th ends at k s with k MiB of RSS), as agent-core's
    /// boundary ring sends them: the message is the newest end's point.
    fn boundary_message(seq: u64, n: u64) -> pb::AgentMessage {
        let context = |done| pb::RequestContext {
            requests_done: done,
            phase: "after_request".into(),
            ..Default::default()
        };
        let readings = (1..=n as i64)
            .flat_map(|k| {
                let boundary = |start| pb::RequestBoundary {
                    request_id: format!("r{k}"),
                    start,
                    ..Default::default()
                };
                [
                    pb::RequestReading {
                        time_ns: k * 1_000_000_000 - 500_000_000,
                        boundary: Some(boundary(true)),
                        ..Default::default()
                    },
                    pb::RequestReading {
                        time_ns: k * 1_000_000_000,
                        boundary: Some(boundary(false)),
                        rss_bytes: (k as u64) << 20,
                        context: (k < n as i64).then(|| context(k as u64)),
                        ..Default::default()
                    },
                ]
            })
            .collect();
        pb::AgentMessage {
            seq,
            body: Some(Body::Sample(pb::Sample {
                time_ns: n as i64 * 1_000_000_000,
                process: Some(pb::ProcessMemory {
                    vm_rss_bytes: n << 20,
                    ..Default::default()
                }),
                context: Some(context(n)),
                requests: Some(pb::RequestReadings {
                    readings,
                    ..Default::default()
                }),
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_boundary_message_is_one_stored_row_read_as_a_point_and_two_events_per_request() {
        let mut store = super::super::tests::store_with_a1();
        store
            .insert_batch("a1", &[boundary_message(1, 30)])
            .unwrap();
        let rows: i64 = store
            .conn
            .query_row(
                "SELECT count(*) FROM messages WHERE agent_id = 'a1'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(rows, 1);
        let e = store.evidence("a1", None).unwrap();
        let done: Vec<u64> = e
            .samples
            .iter()
            .map(|s| s.context.as_ref().unwrap().requests_done)
            .collect();
        assert_eq!(done, (1..=30).collect::<Vec<_>>());
        let rss: Vec<u64> = e
            .samples
            .iter()
            .map(|s| s.process.unwrap().vm_rss_bytes >> 20)
            .collect();
        assert_eq!(rss, (1..=30).collect::<Vec<_>>());
        let requests: Vec<(i64, bool)> = e
            .events
            .iter()
            .map(|ev| match &ev.kind {
                Some(pb::event::Kind::Request(b)) => (ev.time_ns, b.start),
                _ => panic!("not a request event"),
            })
            .collect();
        assert_eq!(requests.len(), 60);
        assert!(requests
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 != w[1].1));
        // The timeline shows the same, each under the message's seq.
        let t = store.timeline("a1", 0, 0, 0).unwrap();
        assert_eq!(t.samples.len(), 30);
        assert_eq!(t.events.len(), 60);
        assert!(t.samples.iter().all(|s| s.seq == 1) && t.events.iter().all(|e| e.seq == 1));
        // A restart storm's count of request starts finds them too.
        let starts = store.request_starts_of("svc", 0, i64::MAX).unwrap();
        assert_eq!(starts.len(), 30);
        assert_eq!(starts[0], 500_000_000);
    }

    /// A sample of host RSS `rss_mib` at `t_s` seconds.
    fn rss(seq: u64, t_s: i64, rss_mib: u64) -> pb::AgentMessage {
        pb::AgentMessage {
            seq,
            body: Some(Body::Sample(pb::Sample {
                time_ns: t_s * 1_000_000_000,
                process: Some(pb::ProcessMemory {
                    vm_rss_bytes: rss_mib << 20,
                    ..Default::default()
                }),
                ..Default::default()
            })),
        }
    }

    fn rss_of(s: Option<&pb::Sample>) -> u64 {
        s.and_then(|s| s.process.as_ref()).unwrap().vm_rss_bytes >> 20
    }

    #[test]
    fn a_thinned_timeline_carries_the_spikes_between_its_points() {
        let mut store = super::super::tests::store_with_a1();
        // 3,000 samples 1 s apart at 100 MiB, but one spike and one dip,
        // sent in batches as an agent sends them.
        let level = |seq: u64| match seq {
            1234 => 900,
            2222 => 10,
            _ => 100,
        };
        let all: Vec<pb::AgentMessage> = (1..=3000).map(|q| rss(q, q as i64, level(q))).collect();
        for batch in all.chunks(64) {
            store.insert_batch("a1", batch).unwrap();
        }
        let t = store.timeline("a1", 0, 0, 20).unwrap();
        assert_eq!(t.samples.len(), 20);
        let seqs: Vec<u64> = t.samples.iter().map(|s| s.seq).collect();
        assert!(
            !seqs.contains(&1234) && !seqs.contains(&2222),
            "the extremes fall between points: {seqs:?}"
        );
        assert!(t.samples.iter().all(|p| rss_of(p.sample.as_ref()) == 100));
        for p in &t.samples {
            let (lo, v, hi) = (
                rss_of(p.low.as_ref()),
                rss_of(p.sample.as_ref()),
                rss_of(p.high.as_ref()),
            );
            assert!(lo <= v && v <= hi, "seq {}: {lo} {v} {hi}", p.seq);
        }
        // The spike is drawn at the last point before it, the dip likewise.
        let holder = |t_s: u64| {
            t.samples
                .iter()
                .rposition(|p| p.sample.as_ref().unwrap().time_ns <= t_s as i64 * 1_000_000_000)
                .unwrap()
        };
        let highs: Vec<u64> = t.samples.iter().map(|p| rss_of(p.high.as_ref())).collect();
        let lows: Vec<u64> = t.samples.iter().map(|p| rss_of(p.low.as_ref())).collect();
        assert_eq!(highs[holder(1234)], 900, "{highs:?}");
        assert_eq!(lows[holder(2222)], 10, "{lows:?}");
        assert_eq!(highs.iter().filter(|&&h| h == 900).count(), 1);
        assert_eq!(lows.iter().filter(|&&l| l == 10).count(), 1);
        // A timeline that is not thinned has every reading, and no envelope.
        let whole = store.timeline("a1", 0, 0, 0).unwrap();
        assert_eq!(whole.samples.len(), 3000);
        assert!(whole
            .samples
            .iter()
            .all(|p| p.low.is_none() && p.high.is_none()));
    }

    #[test]
    fn rollups_stay_exact_across_a_writer_restart_and_late_samples() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let hello = pb::Hello {
            agent_id: "a1".into(),
            name: "svc".into(),
            ..Default::default()
        };
        // Seconds and RSS of each sample; the last two arrive late, into
        // buckets already written, and seq 3 is resent after the restart.
        let sent: Vec<(u64, i64, u64)> = (1..=60u64)
            .map(|q| (q, q as i64 * 3, (q * 37) % 101))
            .chain([(61, 5, 500), (62, 299, 1)])
            .collect();
        let msgs: Vec<pb::AgentMessage> = sent.iter().map(|&(q, t, r)| rss(q, t, r)).collect();
        {
            let mut w = Store::open(&path).unwrap();
            w.upsert_agent(&hello, 1).unwrap();
            for batch in msgs[..30].chunks(7) {
                w.insert_batch("a1", batch).unwrap();
            }
        }
        let mut w = Store::open(&path).unwrap();
        w.insert_batch("a1", &msgs[2..3]).unwrap();
        for batch in msgs[30..].chunks(5) {
            w.insert_batch("a1", batch).unwrap();
        }
        for width_s in rollups::WIDTHS_S {
            let mut want: std::collections::BTreeMap<i64, (i64, u64, u64)> = Default::default();
            for &(_, t, r) in &sent {
                let b = rollups::bucket_of(t * 1_000_000_000, width_s);
                let e = want.entry(b).or_insert((0, u64::MAX, 0));
                *e = (e.0 + 1, e.1.min(r), e.2.max(r));
            }
            let mut stmt = w
                .conn
                .prepare("SELECT bucket_ns, samples, low, high FROM rollups WHERE agent_id = 'a1' AND width_s = ?1 ORDER BY bucket_ns")
                .unwrap();
            let got: std::collections::BTreeMap<i64, (i64, u64, u64)> = stmt
                .query_map([width_s], |r| {
                    let low: Vec<u8> = r.get(2)?;
                    let high: Vec<u8> = r.get(3)?;
                    let low = pb::Sample::decode(low.as_slice()).unwrap();
                    let high = pb::Sample::decode(high.as_slice()).unwrap();
                    Ok((
                        r.get(0)?,
                        (r.get(1)?, rss_of(Some(&low)), rss_of(Some(&high))),
                    ))
                })
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap();
            assert_eq!(got, want, "width {width_s} s");
        }
    }

    #[test]
    fn events_keep_the_newest_within_their_budget() {
        let store = agent(100, 0);
        let (one, cut) = store
            .newest_events("a1", i64::MIN, i64::MAX, usize::MAX)
            .unwrap();
        assert_eq!((one.len(), cut), (10, 0));
        let size = prost::Message::encoded_len(&pb::AgentMessage {
            seq: 101,
            body: Some(Body::Event(one[9].event.clone().unwrap())),
        });
        // All ten are the same size but the oldest (a shorter time varint).
        let (newest, cut) = store
            .newest_events("a1", i64::MIN, i64::MAX, 3 * size)
            .unwrap();
        let seqs: Vec<u64> = newest.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [108, 109, 110]);
        let oldest_kept = newest[0].event.as_ref().unwrap().time_ns;
        assert_eq!(cut, oldest_kept, "the reply says where it was cut");
    }

    #[test]
    fn the_latest_reading_within_an_age() {
        let store = agent(10, 0);
        let at = |t: i64, age: i64| {
            store
                .sample_at("a1", t, age)
                .unwrap()
                .map(|s| s.allocator[0].allocated_bytes >> 20)
        };
        assert_eq!(at(5_500_000_000, 1_000_000_000), Some(5));
        assert_eq!(at(5_000_000_000, 0), Some(5));
        assert_eq!(at(500_000_000, 1_000_000_000), None);
        assert_eq!(at(30_000_000_000, 1_000_000_000), None, "too old");
        let h = store.history_samples("a1", 0, i64::MAX, 5).unwrap();
        assert!(h.is_none(), "more than the limit");
        let h = store
            .history_samples("a1", 3_000_000_000, 4_000_000_000, 5)
            .unwrap();
        assert_eq!(allocated(&h.unwrap()), [3, 4]);
    }

    #[test]
    fn downsample_keeps_ends_and_spreads_evenly() {
        let v: Vec<u32> = (0..100).collect();
        let d = downsample(v.clone(), 5);
        assert_eq!(d, vec![0, 24, 49, 74, 99]);
        assert_eq!(downsample(v.clone(), 0).len(), 100);
        assert_eq!(downsample(v.clone(), 200).len(), 100);
        assert_eq!(downsample(v.clone(), 1), vec![99]);
        assert_eq!(downsample(v, 99).len(), 99);
        assert!(downsample(Vec::<u8>::new(), 3).is_empty());
    }
}
