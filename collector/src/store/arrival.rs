//! Schema v8: messages and figures stored in the order they arrive.
//!
//! Both tables were clustered by their keys (`WITHOUT ROWID`, agent first).
//! When 2,000 agents' batches share one group commit, each row lands in its
//! own agent's leaf page, so every commit rewrites a page per agent per
//! table: 51 µs of CPU a row against 18.7 µs in arrival order
//! (`scripts/bench-store-layout`, BENCHMARKS.md). As rowid tables the rows
//! append; the keys become unique indexes, whose small entries still
//! scatter by agent but fill a page a hundred at a time. Every statement
//! reads as before, through the indexes.

use std::time::Instant;

use anyhow::Result;
use rusqlite::Transaction;

/// Rebuilds `messages` and `figures` as rowid tables, each row copied in
/// its old key order (one agent's rows stay together on disk).
pub(super) fn migrate_v8(tx: &Transaction<'_>) -> Result<()> {
    let rows: i64 = tx.query_row("SELECT count(*) FROM messages", [], |r| r.get(0))?;
    let started = Instant::now();
    if rows > 0 {
        tracing::info!("storing {rows} messages in arrival order (schema v8)");
    }
    tx.execute_batch(
        "CREATE TABLE messages_v8(
             agent_id   TEXT NOT NULL,
             seq        INTEGER NOT NULL,
             time_ns    INTEGER NOT NULL,
             kind       TEXT NOT NULL,      -- 'sample' | 'event' | 'goodbye'
             event_kind TEXT,               -- the Event oneof's field name
             body       BLOB NOT NULL,      -- the AgentMessage, counters as changes (counters.rs)
             key_seq    INTEGER,            -- the chain's keyframe (counters.rs)
             whole_len  INTEGER             -- the complete message's bytes, if not body's
         );
         INSERT INTO messages_v8
             SELECT agent_id, seq, time_ns, kind, event_kind, body, key_seq, whole_len FROM messages;
         DROP TABLE messages;
         ALTER TABLE messages_v8 RENAME TO messages;
         CREATE UNIQUE INDEX messages_by_key ON messages(agent_id, seq);
         -- With seq: a rowid table's index carries the rowid, not the key,
         -- and the range reads order by (time, seq) and read nothing else.
         CREATE INDEX messages_by_time ON messages(agent_id, kind, time_ns, seq);
         -- Retention keeps a chain while any row of it is young (retention.rs).
         -- With seq for the same reason: a chain is read in seq order.
         CREATE INDEX messages_by_chain ON messages(agent_id, key_seq, seq) WHERE key_seq IS NOT NULL;

         CREATE TABLE figures_v8(
             agent_id TEXT NOT NULL,
             time_ns  INTEGER NOT NULL,
             seq      INTEGER NOT NULL,
             sample   BLOB NOT NULL        -- the Sample less its allocators' raw dicts
         );
         INSERT INTO figures_v8 SELECT agent_id, time_ns, seq, sample FROM figures;
         DROP TABLE figures;
         ALTER TABLE figures_v8 RENAME TO figures;
         CREATE UNIQUE INDEX figures_by_key ON figures(agent_id, time_ns, seq);",
    )?;
    if rows > 0 {
        tracing::info!(
            "stored {rows} messages in arrival order in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Turns a v8 store back into v7's layout (the same rows, clustered by key
/// again): how the migration's test and `examples/migrate_v8.rs` make a v7
/// store to migrate. Not for production use.
#[doc(hidden)]
pub const BACK_TO_V7: &str = "
BEGIN;
CREATE TABLE m7(agent_id TEXT NOT NULL, seq INTEGER NOT NULL, time_ns INTEGER NOT NULL,
    kind TEXT NOT NULL, event_kind TEXT, body BLOB NOT NULL, key_seq INTEGER,
    whole_len INTEGER, PRIMARY KEY(agent_id, seq)) WITHOUT ROWID;
INSERT INTO m7 SELECT agent_id, seq, time_ns, kind, event_kind, body, key_seq, whole_len FROM messages;
DROP TABLE messages;
ALTER TABLE m7 RENAME TO messages;
CREATE INDEX messages_by_time ON messages(agent_id, kind, time_ns);
CREATE INDEX messages_by_chain ON messages(agent_id, key_seq) WHERE key_seq IS NOT NULL;
CREATE TABLE f7(agent_id TEXT NOT NULL, time_ns INTEGER NOT NULL, seq INTEGER NOT NULL,
    sample BLOB NOT NULL, PRIMARY KEY(agent_id, time_ns, seq)) WITHOUT ROWID;
INSERT INTO f7 SELECT agent_id, time_ns, seq, sample FROM figures;
DROP TABLE figures;
ALTER TABLE f7 RENAME TO figures;
PRAGMA user_version = 7;
COMMIT;";

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::pb;
    use crate::pb::agent_message::Body;
    use crate::store::Store;

    /// Two agents' samples (counters as changes across keyframes) and
    /// events, interleaved as a group commit stores them.
    fn fill(store: &mut Store) {
        for seq in 1..=80u64 {
            for agent in ["a1", "a2"] {
                let body = if seq % 10 == 0 {
                    Body::Event(pb::Event {
                        time_ns: seq as i64 * 1_000,
                        ..Default::default()
                    })
                } else {
                    Body::Sample(testkit_sample(seq))
                };
                store
                    .insert_batch(
                        agent,
                        &[pb::AgentMessage {
                            seq,
                            body: Some(body),
                        }],
                    )
                    .unwrap();
            }
        }
    }

    fn testkit_sample(seq: u64) -> pb::Sample {
        let mut raw = std::collections::HashMap::new();
        raw.insert(
            "allocated_bytes.all.current".to_string(),
            (seq * 4096) as i64,
        );
        raw.insert("num_alloc_retries".to_string(), 0);
        pb::Sample {
            time_ns: seq as i64 * 1_000,
            process: Some(pb::ProcessMemory {
                vm_rss_bytes: seq * 1024,
                ..Default::default()
            }),
            allocator: vec![pb::AllocatorStats {
                device: 0,
                reserved_bytes: seq * 8192,
                raw,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn read(store: &Store, agent: &str) -> pb::TimelineResponse {
        store.timeline(agent, 0, 0, 0).unwrap()
    }

    /// A v7 store: the same rows, clustered by key as v7 kept them.
    fn back_to_v7(path: &Path) {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.execute_batch(super::BACK_TO_V7).unwrap();
    }

    fn clustered(path: &Path) -> Vec<String> {
        let conn = rusqlite::Connection::open(path).unwrap();
        let mut stmt = conn
            .prepare(
                "SELECT name FROM sqlite_schema WHERE sql LIKE '%WITHOUT ROWID%' ORDER BY name",
            )
            .unwrap();
        let names = stmt.query_map([], |r| r.get(0)).unwrap();
        names.map(Result::unwrap).collect()
    }

    #[test]
    fn a_v7_store_reads_back_the_same_after_the_migration() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v7.db");
        let before = {
            let mut store = Store::open(&path).unwrap();
            for agent in ["a1", "a2"] {
                let hello = pb::Hello {
                    agent_id: agent.into(),
                    name: "svc".into(),
                    ..Default::default()
                };
                store.upsert_agent(&hello, 1).unwrap();
            }
            fill(&mut store);
            // Reread after the writer's state is gone: chains rebuilt from disk.
            ["a1", "a2"].map(|a| read(&store, a))
        };
        assert_eq!(before[0].samples.len(), 72);
        assert_eq!(before[0].events.len(), 8);
        back_to_v7(&path);
        assert!(clustered(&path).contains(&"messages".to_string()));

        let store = Store::open(&path).unwrap();
        assert!(
            !clustered(&path)
                .iter()
                .any(|t| t == "messages" || t == "figures"),
            "{:?}",
            clustered(&path)
        );
        for (agent, was) in ["a1", "a2"].iter().zip(&before) {
            let now = read(&store, agent);
            assert_eq!(&now, was, "agent {agent}");
            // The complete counters, rebuilt across keyframes after the move.
            let last = now.samples.last().unwrap().sample.as_ref().unwrap();
            assert_eq!(
                last.allocator[0].raw["allocated_bytes.all.current"],
                79 * 4096
            );
        }
        // A resent message is still a duplicate, not a second row.
        let mut store = store;
        let again = store
            .insert_batch(
                "a1",
                &[pb::AgentMessage {
                    seq: 5,
                    body: Some(Body::Sample(testkit_sample(5))),
                }],
            )
            .unwrap();
        assert_eq!((again.stored, again.fresh), (vec![5], vec![]));
    }
}
