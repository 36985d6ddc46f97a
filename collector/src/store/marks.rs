//! Schema v7: where an agent dropped messages unsent (`Sample.dropped_before`,
//! its memory or spool bound during a collector outage), kept beside the
//! figures so a thinned timeline still says so.
//!
//! A timeline thinned to `max_points` reads only the samples it keeps; the
//! statements ride on whichever samples followed a drop, most of them left
//! out. Finding them in `figures` would decode every record of the range,
//! so each statement has its own row, and the thinned timeline folds those
//! between two kept points into the later one.

use anyhow::Result;
use prost::Message;
use rusqlite::{params, Connection, Transaction};

use crate::pb;

pub(super) fn migrate_v7(tx: &Transaction<'_>) -> Result<()> {
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS dropped_marks(
             agent_id  TEXT NOT NULL,
             time_ns   INTEGER NOT NULL,
             seq       INTEGER NOT NULL,
             statement BLOB NOT NULL,   -- the DroppedBefore the sample carried
             PRIMARY KEY(agent_id, time_ns, seq)
         ) WITHOUT ROWID;",
    )?;
    // The statements already stored, from the samples' records (one pass).
    let mut read = tx.prepare("SELECT agent_id, seq, sample FROM figures")?;
    let mut rows = read.query([])?;
    while let Some(row) = rows.next()? {
        let agent_id: String = row.get(0)?;
        let seq: i64 = row.get(1)?;
        let blob: Vec<u8> = row.get(2)?;
        // A record that does not decode is left to the readers to report.
        if let Ok(s) = pb::Sample::decode(blob.as_slice()) {
            record(tx, &agent_id, seq, &s)?;
        }
    }
    Ok(())
}

/// Keeps `sample`'s statement of dropped messages, if it carries one.
pub(super) fn record(
    conn: &Connection,
    agent_id: &str,
    seq: i64,
    sample: &pb::Sample,
) -> Result<()> {
    let Some(d) = &sample.dropped_before else {
        return Ok(());
    };
    conn.prepare_cached(
        "INSERT OR IGNORE INTO dropped_marks(agent_id, time_ns, seq, statement) VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![agent_id, sample.time_ns, seq, d.encode_to_vec()])?;
    Ok(())
}

/// Puts on each of `points` (a thinned timeline of `agent_id`, oldest
/// first) every statement stored after the point before it, up to its own
/// place: what was dropped anywhere in the stretch it stands for.
pub(super) fn fold_into(
    conn: &Connection,
    agent_id: &str,
    points: &mut [pb::TimedSample],
) -> Result<()> {
    let key = |p: &pb::TimedSample| (p.sample.as_ref().map_or(0, |s| s.time_ns), p.seq as i64);
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return Ok(());
    };
    let (from, to) = (key(first), key(last));
    let mut stmt = conn.prepare_cached(
        "SELECT time_ns, seq, statement FROM dropped_marks
         WHERE agent_id = ?1 AND (time_ns, seq) >= (?2, ?3) AND (time_ns, seq) <= (?4, ?5)
         ORDER BY time_ns, seq",
    )?;
    let mut rows = stmt.query(params![agent_id, from.0, from.1, to.0, to.1])?;
    let mut folded: Vec<Option<pb::DroppedBefore>> = vec![None; points.len()];
    while let Some(row) = rows.next()? {
        let at = (row.get::<_, i64>(0)?, row.get::<_, i64>(1)?);
        let Ok(d) = pb::DroppedBefore::decode(row.get_ref(2)?.as_blob()?) else {
            continue;
        };
        // The first kept point at or after the statement.
        let i = points.partition_point(|p| key(p) < at);
        if let Some(slot) = folded.get_mut(i) {
            add(
                slot.get_or_insert_with(|| pb::DroppedBefore {
                    stride: 1,
                    ..Default::default()
                }),
                &d,
            );
        }
    }
    for (p, d) in points.iter_mut().zip(folded) {
        if let (Some(s), Some(d)) = (p.sample.as_mut(), d) {
            s.dropped_before = Some(d);
        }
    }
    Ok(())
}

/// `more` added into `into`: counts summed, the widest stride kept.
fn add(into: &mut pb::DroppedBefore, more: &pb::DroppedBefore) {
    into.samples += more.samples;
    into.events += more.events;
    into.by_spool += more.by_spool;
    into.requests += more.requests;
    into.stride = into.stride.max(more.stride);
}

#[cfg(test)]
mod tests {
    use super::super::Store;
    use crate::pb;
    use crate::pb::agent_message::Body;

    fn marks(store: &Store) -> Vec<(i64, Vec<u8>)> {
        let mut stmt = store
            .conn
            .prepare("SELECT seq, statement FROM dropped_marks ORDER BY seq")
            .unwrap();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(|r| r.unwrap()).collect()
    }

    #[test]
    fn a_version_6_store_gets_the_statements_it_already_held() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v6.db");
        let batch: Vec<pb::AgentMessage> = (1..=5)
            .map(|seq| pb::AgentMessage {
                seq,
                body: Some(Body::Sample(pb::Sample {
                    time_ns: seq as i64,
                    dropped_before: (seq == 3).then_some(pb::DroppedBefore {
                        samples: 7,
                        requests: 70,
                        stride: 2,
                        ..Default::default()
                    }),
                    ..Default::default()
                })),
            })
            .collect();
        let before = {
            let mut store = super::super::tests::store_at(&path);
            store.insert_batch("a1", &batch).unwrap();
            let before = marks(&store);
            store
                .conn
                .execute_batch("DROP TABLE dropped_marks; PRAGMA user_version = 6;")
                .unwrap();
            before
        };
        assert_eq!(before.len(), 1, "the statement kept as it was stored");
        let store = Store::open(&path).unwrap();
        assert_eq!(marks(&store), before);
    }
}
