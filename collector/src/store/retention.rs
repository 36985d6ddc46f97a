//! Retention (`--retain`): what is older than the window goes, in bounded
//! batches, each its own transaction through the writer, so ingest goes on
//! between them. Times are the agents' clocks (`time_ns`), as stored.
//!
//! - A sample stored as changes needs its whole chain (`counters.rs`), so a
//!   chain goes only when none of its rows is still young.
//! - An incident goes with its window, unless a younger incident was merged
//!   into it (the younger one would name a leader that is gone).

use anyhow::Result;
use rusqlite::params;

use super::Store;

/// Rows one batch deletes at most, per table: about 1 MB of H200 samples,
/// a few milliseconds of the writer.
pub const MAX_RETENTION_BATCH: i64 = 2_000;

impl Store {
    /// Deletes at most `max` rows of each table older than `cutoff_ns`;
    /// returns how many rows went (fewer than `max` of each: done for now).
    pub fn prune_before(&mut self, cutoff_ns: i64, max: i64) -> Result<u64> {
        let tx = self.conn.savepoint()?;
        let mut gone = tx.execute(
            "DELETE FROM messages WHERE (agent_id, seq) IN (
               SELECT m.agent_id, m.seq FROM messages m
               WHERE m.time_ns < ?1
                 AND (m.key_seq IS NULL OR NOT EXISTS (
                   SELECT 1 FROM messages n
                   WHERE n.agent_id = m.agent_id AND n.key_seq = m.key_seq AND n.time_ns >= ?1))
               LIMIT ?2)",
            params![cutoff_ns, max],
        )?;
        gone += tx.execute(
            "DELETE FROM figures WHERE (agent_id, time_ns, seq) IN (
               SELECT agent_id, time_ns, seq FROM figures WHERE time_ns < ?1 LIMIT ?2)",
            params![cutoff_ns, max],
        )?;
        gone += tx.execute(
            "DELETE FROM dropped_marks WHERE (agent_id, time_ns, seq) IN (
               SELECT agent_id, time_ns, seq FROM dropped_marks WHERE time_ns < ?1 LIMIT ?2)",
            params![cutoff_ns, max],
        )?;
        gone += tx.execute(
            "DELETE FROM rollups WHERE (agent_id, width_s, bucket_ns) IN (
               SELECT agent_id, width_s, bucket_ns FROM rollups
               WHERE bucket_ns + width_s * 1000000000 <= ?1 LIMIT ?2)",
            params![cutoff_ns, max],
        )?;
        gone += tx.execute(
            "DELETE FROM incidents WHERE n IN (
               SELECT i.n FROM incidents i
               WHERE i.time_ns < ?1 AND NOT EXISTS (
                 SELECT 1 FROM incidents j WHERE j.merged_into = i.id AND j.time_ns >= ?1)
               LIMIT ?2)",
            params![cutoff_ns, max],
        )?;
        tx.commit()?;
        Ok(gone as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;
    use crate::pb::agent_message::Body;

    const DAY: i64 = 86_400_000_000_000;
    const T0: i64 = 1_700_000_000_000_000_000;

    /// A sample with allocator counters, so that it is stored in a chain.
    fn sample(seq: u64, time_ns: i64) -> pb::AgentMessage {
        pb::AgentMessage {
            seq,
            body: Some(Body::Sample(pb::Sample {
                time_ns,
                allocator: vec![pb::AllocatorStats {
                    allocated_bytes: seq,
                    raw: (0..20).map(|i| (format!("c{i}"), i + seq as i64)).collect(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
        }
    }

    fn count(store: &Store, table: &str) -> i64 {
        store
            .conn
            .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn old_rows_go_in_batches_and_young_chains_and_incidents_stay_whole() {
        let mut store = Store::open_in_memory().unwrap();
        store
            .upsert_agent(
                &pb::Hello {
                    agent_id: "a1".into(),
                    name: "svc".into(),
                    ..Default::default()
                },
                T0,
            )
            .unwrap();
        // Seqs 1..=40 twenty days ago; 41..=50 now. The chains are of 32
        // samples: 1..=32, then 33..=50 (its keyframe old, its tail young).
        let msgs: Vec<_> = (1..=50u64)
            .map(|s| {
                sample(
                    s,
                    if s <= 40 {
                        T0 - 20 * DAY + s as i64
                    } else {
                        T0 + s as i64
                    },
                )
            })
            .collect();
        store.insert_batch("a1", &msgs).unwrap();
        store
            .conn
            .execute_batch(&format!(
                "INSERT INTO incidents(id, agent_id, kind, time_ns, domain, summary, seq)
                 VALUES ('old', 'a1', 'oom', {}, 'gpu_vram', 'old', 0),
                        ('young', 'a1', 'oom', {}, 'gpu_vram', 'young', 0);",
                T0 - 20 * DAY,
                T0 - DAY
            ))
            .unwrap();
        let cutoff = T0 - 14 * DAY;
        let mut passes = 0;
        while store.prune_before(cutoff, 10).unwrap() > 0 {
            passes += 1;
            assert!(passes < 100);
        }
        assert!(passes >= 4, "bounded batches of 10: {passes}");
        // The first chain went whole; the second stays whole for its young tail.
        let seqs: Vec<i64> = store
            .conn
            .prepare("SELECT seq FROM messages ORDER BY seq")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(seqs, (33..=50).collect::<Vec<_>>());
        // Every kept sample still reads back complete.
        let tl = store.timeline("a1", 0, 0, 0).unwrap();
        assert_eq!(tl.samples.len(), 18);
        for s in &tl.samples {
            let raw = &s.sample.as_ref().unwrap().allocator[0].raw;
            assert_eq!(raw["c3"], 3 + s.seq as i64, "seq {}", s.seq);
        }
        assert_eq!(count(&store, "figures"), 10, "figures go by their own time");
        let left: Vec<String> = store
            .incidents(None)
            .unwrap()
            .into_iter()
            .map(|i| i.id)
            .collect();
        assert_eq!(left, ["young"]);
    }
}
