//! Schema v4: time-bucketed rollups, so that a chart of a long history reads
//! a few thousand rows and still shows what happened between its points
//! (see `collector/STORAGE.md`).
//!
//! For every agent, every [`WIDTHS_S`] width and every bucket of that width
//! with samples in it: the number of samples and an envelope, two
//! [`pb::Sample`]s holding each charted figure at its lowest and its highest
//! over the bucket. The ingest transaction keeps them: the writer holds each
//! agent's open bucket per width in memory, folds every new sample into it,
//! and writes it once per batch; a bucket it does not hold (after a restart,
//! or a sample older than the open one) is read back first, so the rows stay
//! exact whatever the order of arrival.

use std::collections::HashMap;

use anyhow::{Context, Result};
use prost::Message;
use rusqlite::{params, Connection, OptionalExtension, Transaction};

use super::figures;
use crate::pb;

/// Bucket widths in seconds. A timeline's points use the widest bucket no
/// wider than their spacing: 5-minute buckets for a chart of days (a week is
/// 2,016 rows), 10-second ones for a chart of hours (an hour is 360).
pub const WIDTHS_S: [i64; 2] = [10, 300];

/// Open buckets the writer holds at most (two per live agent); past it they
/// are written and dropped, and read back as their agents send again.
pub const MAX_OPEN_BUCKETS: usize = 8192;

pub(super) fn migrate_v4(tx: &Transaction<'_>) -> Result<()> {
    tx.execute_batch(
        "CREATE TABLE rollups(
             agent_id  TEXT NOT NULL,
             width_s   INTEGER NOT NULL,
             bucket_ns INTEGER NOT NULL,   -- the bucket's start, a multiple of the width
             samples   INTEGER NOT NULL,
             low       BLOB NOT NULL,      -- a Sample: each charted figure at its lowest
             high      BLOB NOT NULL,      -- and at its highest
             PRIMARY KEY(agent_id, width_s, bucket_ns)
         ) WITHOUT ROWID;",
    )?;
    // Every stored sample folded in, read once in the figures' key order
    // (agent, time), which is each agent's buckets in order.
    let mut open = Open::default();
    let mut read = tx.prepare("SELECT agent_id, seq, sample FROM figures")?;
    let mut rows = read.query([])?;
    while let Some(row) = rows.next()? {
        let agent_id: String = row.get(0)?;
        let seq = row.get::<_, i64>(1)? as u64;
        let sample = figures::decode(&agent_id, seq, row.get_ref(2)?.as_blob()?)?;
        open.fold(tx, &agent_id, &sample)?;
    }
    open.flush(tx)
}

/// One bucket: how many samples, and their envelope.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Envelope {
    pub samples: i64,
    pub low: pb::Sample,
    pub high: pb::Sample,
}

impl Envelope {
    /// Widens the envelope to take in `s` (a sample, or another envelope's
    /// low or high).
    pub fn take(&mut self, s: &pb::Sample) {
        if self.samples == 0 {
            self.low = charted(s);
            self.high = self.low.clone();
        } else {
            widen(&mut self.low, s, u64::min);
            widen(&mut self.high, s, u64::max);
        }
        self.samples += 1;
    }

    /// Takes in another bucket's envelope.
    pub fn merge(&mut self, other: &Envelope) {
        if other.samples == 0 {
            return;
        }
        let n = self.samples;
        self.take(&other.low);
        self.take(&other.high);
        self.samples = n + other.samples;
    }
}

/// The figures of `s` that the charts draw (`report/src/domains.rs`), and
/// nothing else: a rollup's low and high are small.
pub fn charted(s: &pb::Sample) -> pb::Sample {
    pb::Sample {
        time_ns: s.time_ns,
        process: s.process.as_ref().map(|p| pb::ProcessMemory {
            vm_rss_bytes: p.vm_rss_bytes,
            ..Default::default()
        }),
        cgroup: s
            .cgroup
            .first()
            .map(|c| pb::CgroupLevel {
                usage_bytes: c.usage_bytes,
                limit_bytes: c.limit_bytes,
                ..Default::default()
            })
            .into_iter()
            .collect(),
        system: s.system.as_ref().map(|m| pb::SystemMemory {
            mem_total_bytes: m.mem_total_bytes,
            mem_available_bytes: m.mem_available_bytes,
            swap_total_bytes: m.swap_total_bytes,
            swap_free_bytes: m.swap_free_bytes,
            ..Default::default()
        }),
        allocator: s.allocator.iter().map(charted_allocator).collect(),
        context: s
            .context
            .as_ref()
            .filter(|c| c.kv_cache_bytes > 0)
            .map(|c| pb::RequestContext {
                kv_cache_bytes: c.kv_cache_bytes,
                ..Default::default()
            }),
        ..Default::default()
    }
}

fn charted_allocator(a: &pb::AllocatorStats) -> pb::AllocatorStats {
    pb::AllocatorStats {
        device: a.device,
        allocated_bytes: a.allocated_bytes,
        reserved_bytes: a.reserved_bytes,
        driver_free_bytes: a.driver_free_bytes,
        driver_total_bytes: a.driver_total_bytes,
        ..Default::default()
    }
}

/// `env` (a charted sample) with each of its figures replaced by
/// `pick(env's, s's)`; a figure `env` lacks is taken from `s` whole. A used
/// figure derived from a total (RAM, swap, a GPU's driver view) is picked as
/// used, then stored back as total and free, so the chart derives it again.
fn widen(env: &mut pb::Sample, s: &pb::Sample, pick: fn(u64, u64) -> u64) {
    let used_as = |total: &mut u64, free: &mut u64, s_total: u64, s_free: u64| {
        if s_total == 0 {
            return;
        }
        let used = match *total {
            0 => s_total.saturating_sub(s_free),
            t => pick(t.saturating_sub(*free), s_total.saturating_sub(s_free)),
        };
        *total = s_total;
        *free = s_total.saturating_sub(used);
    };
    match (&mut env.process, &s.process) {
        (Some(e), Some(p)) => e.vm_rss_bytes = pick(e.vm_rss_bytes, p.vm_rss_bytes),
        (e @ None, Some(_)) => *e = charted(s).process,
        _ => {}
    }
    match (env.cgroup.first_mut(), s.cgroup.first()) {
        (Some(e), Some(c)) => e.usage_bytes = pick(e.usage_bytes, c.usage_bytes),
        (None, Some(_)) => env.cgroup = charted(s).cgroup,
        _ => {}
    }
    match (&mut env.system, &s.system) {
        (Some(e), Some(m)) => {
            used_as(
                &mut e.mem_total_bytes,
                &mut e.mem_available_bytes,
                m.mem_total_bytes,
                m.mem_available_bytes,
            );
            used_as(
                &mut e.swap_total_bytes,
                &mut e.swap_free_bytes,
                m.swap_total_bytes,
                m.swap_free_bytes,
            );
        }
        (e @ None, Some(_)) => *e = charted(s).system,
        _ => {}
    }
    for a in &s.allocator {
        match env.allocator.iter_mut().find(|e| e.device == a.device) {
            Some(e) => {
                e.allocated_bytes = pick(e.allocated_bytes, a.allocated_bytes);
                e.reserved_bytes = pick(e.reserved_bytes, a.reserved_bytes);
                used_as(
                    &mut e.driver_total_bytes,
                    &mut e.driver_free_bytes,
                    a.driver_total_bytes,
                    a.driver_free_bytes,
                );
            }
            None => env.allocator.push(charted_allocator(a)),
        }
    }
    let kv = s.context.as_ref().map_or(0, |c| c.kv_cache_bytes);
    match (&mut env.context, kv) {
        (_, 0) => {}
        (Some(e), kv) => e.kv_cache_bytes = pick(e.kv_cache_bytes, kv),
        (e @ None, _) => *e = charted(s).context,
    }
}

/// The start of the `width_s` bucket holding `time_ns`.
pub fn bucket_of(time_ns: i64, width_s: i64) -> i64 {
    let w = width_s * 1_000_000_000;
    time_ns.div_euclid(w) * w
}

/// The writer's open buckets: per (agent, width), the bucket the agent's
/// newest samples fall in, folded in memory and written at each batch's end.
#[derive(Debug, Default)]
pub(super) struct Open {
    buckets: HashMap<(String, i64), OpenBucket>,
}

#[derive(Debug)]
struct OpenBucket {
    bucket_ns: i64,
    envelope: Envelope,
    /// Changed since it was last written.
    dirty: bool,
}

impl Open {
    /// Folds one newly stored sample of `agent_id` into its buckets.
    pub(super) fn fold(&mut self, tx: &Connection, agent_id: &str, s: &pb::Sample) -> Result<()> {
        if self.buckets.len() >= MAX_OPEN_BUCKETS {
            self.flush(tx)?;
            self.buckets.clear();
        }
        for width_s in WIDTHS_S {
            let bucket_ns = bucket_of(s.time_ns, width_s);
            let key = (agent_id.to_string(), width_s);
            let held = self.buckets.get(&key).map(|b| b.bucket_ns);
            if held != Some(bucket_ns) {
                // Another bucket: the held one is written before it goes,
                // and the new one continues from its stored row, if any.
                if let Some(old) = self.buckets.remove(&key) {
                    write(tx, agent_id, width_s, &old)?;
                }
                let envelope = read(tx, agent_id, width_s, bucket_ns)?.unwrap_or_default();
                self.buckets.insert(
                    key.clone(),
                    OpenBucket {
                        bucket_ns,
                        envelope,
                        dirty: false,
                    },
                );
            }
            let open = self.buckets.get_mut(&key).expect("inserted above");
            open.envelope.take(s);
            open.dirty = true;
        }
        Ok(())
    }

    /// Writes `agent_id`'s buckets changed since its last flush: a batch
    /// folds one agent's samples, so only its buckets can be dirty at the
    /// batch's end. (Walking every open bucket instead cost each batch
    /// 4,000 map entries with 2,000 agents connected: with one-sample
    /// batches, more than the sample's own rows.)
    pub(super) fn flush_agent(&mut self, tx: &Connection, agent_id: &str) -> Result<()> {
        for width_s in WIDTHS_S {
            if let Some(open) = self.buckets.get_mut(&(agent_id.to_string(), width_s)) {
                write(tx, agent_id, width_s, open)?;
                open.dirty = false;
            }
        }
        Ok(())
    }

    /// Writes every bucket changed since the last flush.
    fn flush(&mut self, tx: &Connection) -> Result<()> {
        for ((agent_id, width_s), open) in self.buckets.iter_mut() {
            if open.dirty {
                write(tx, agent_id, *width_s, open)?;
                open.dirty = false;
            }
        }
        Ok(())
    }

    /// Drops the agent's buckets (its stream ended). Every batch ends
    /// with a flush, so nothing unwritten goes; a later sample reads its
    /// bucket's row back.
    pub(super) fn forget_agent(&mut self, agent_id: &str) {
        self.buckets.retain(|(a, _), _| a != agent_id);
    }

    /// Drops what is held: after a failed transaction, memory may hold
    /// samples the store does not, so the next fold reads the rows again.
    pub(super) fn forget(&mut self) {
        self.buckets.clear();
    }
}

fn write(tx: &Connection, agent_id: &str, width_s: i64, open: &OpenBucket) -> Result<()> {
    if !open.dirty {
        return Ok(());
    }
    let mut stmt = tx.prepare_cached(
        "INSERT OR REPLACE INTO rollups(agent_id, width_s, bucket_ns, samples, low, high)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    let e = &open.envelope;
    stmt.execute(params![
        agent_id,
        width_s,
        open.bucket_ns,
        e.samples,
        e.low.encode_to_vec(),
        e.high.encode_to_vec()
    ])?;
    Ok(())
}

fn read(tx: &Connection, agent_id: &str, width_s: i64, bucket_ns: i64) -> Result<Option<Envelope>> {
    let mut stmt = tx.prepare_cached(
        "SELECT samples, low, high FROM rollups
         WHERE agent_id = ?1 AND width_s = ?2 AND bucket_ns = ?3",
    )?;
    stmt.query_row(params![agent_id, width_s, bucket_ns], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, Vec<u8>>(1)?,
            r.get::<_, Vec<u8>>(2)?,
        ))
    })
    .optional()?
    .map(|(samples, low, high)| envelope(agent_id, bucket_ns, samples, &low, &high))
    .transpose()
}

/// A stored row's envelope.
pub(super) fn envelope(
    agent_id: &str,
    bucket_ns: i64,
    samples: i64,
    low: &[u8],
    high: &[u8],
) -> Result<Envelope> {
    let decode = |b: &[u8]| {
        pb::Sample::decode(b).with_context(|| {
            format!("the rollup of agent {agent_id} at {bucket_ns} ns does not decode")
        })
    };
    Ok(Envelope {
        samples,
        low: decode(low)?,
        high: decode(high)?,
    })
}

/// The width whose buckets a timeline with points `spacing_ns` apart reads:
/// the widest no wider than the spacing, else the narrowest.
pub fn width_for(spacing_ns: i64) -> i64 {
    WIDTHS_S
        .iter()
        .rev()
        .copied()
        .find(|w| w * 1_000_000_000 <= spacing_ns)
        .unwrap_or(WIDTHS_S[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: i64, rss: u64, ram_used: u64, allocated: u64) -> pb::Sample {
        pb::Sample {
            time_ns: t,
            process: Some(pb::ProcessMemory {
                vm_rss_bytes: rss,
                vm_size_bytes: 99,
                ..Default::default()
            }),
            system: Some(pb::SystemMemory {
                mem_total_bytes: 1000,
                mem_available_bytes: 1000 - ram_used,
                ..Default::default()
            }),
            allocator: vec![pb::AllocatorStats {
                device: 1,
                allocated_bytes: allocated,
                raw: [("x".to_string(), 1)].into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn an_envelope_holds_each_figures_extremes_and_nothing_else() {
        let mut e = Envelope::default();
        for (t, rss, ram, alloc) in [(1, 50, 300, 7), (2, 90, 100, 3), (3, 70, 200, 9)] {
            e.take(&sample(t, rss, ram, alloc));
        }
        assert_eq!(e.samples, 3);
        let rss = |s: &pb::Sample| s.process.unwrap().vm_rss_bytes;
        let ram = |s: &pb::Sample| {
            let m = s.system.unwrap();
            m.mem_total_bytes - m.mem_available_bytes
        };
        assert_eq!((rss(&e.low), rss(&e.high)), (50, 90));
        assert_eq!((ram(&e.low), ram(&e.high)), (100, 300));
        assert_eq!(
            (
                e.low.allocator[0].allocated_bytes,
                e.high.allocator[0].allocated_bytes
            ),
            (3, 9)
        );
        assert_eq!(e.high.process.unwrap().vm_size_bytes, 0, "not charted");
        assert!(e.high.allocator[0].raw.is_empty());
    }

    #[test]
    fn merged_envelopes_equal_one_envelope_over_all_samples() {
        let samples: Vec<pb::Sample> = (0..20)
            .map(|i| sample(i, (i * 37 % 11) as u64, (i * 13 % 7) as u64, (i % 5) as u64))
            .collect();
        let mut whole = Envelope::default();
        samples.iter().for_each(|s| whole.take(s));
        let (mut a, mut b) = (Envelope::default(), Envelope::default());
        samples[..7].iter().for_each(|s| a.take(s));
        samples[7..].iter().for_each(|s| b.take(s));
        a.merge(&b);
        assert_eq!(a.samples, whole.samples);
        assert_eq!(a.low, whole.low);
        assert_eq!(a.high, whole.high);
    }

    #[test]
    fn a_figure_missing_from_the_first_sample_is_taken_when_it_appears() {
        let mut e = Envelope::default();
        e.take(&pb::Sample::default());
        e.take(&sample(1, 5, 10, 2));
        e.take(&sample(2, 8, 20, 1));
        assert_eq!(e.low.process.unwrap().vm_rss_bytes, 5);
        assert_eq!(e.high.allocator[0].allocated_bytes, 2);
    }

    #[test]
    fn widths_follow_the_points_spacing() {
        let s = 1_000_000_000;
        assert_eq!(width_for(2 * s), 10);
        assert_eq!(width_for(10 * s), 10);
        assert_eq!(width_for(299 * s), 10);
        assert_eq!(width_for(3024 * s), 300);
        assert_eq!(bucket_of(25 * s, 10), 20 * s);
        assert_eq!(bucket_of(-1, 10), -10 * s);
    }
}
