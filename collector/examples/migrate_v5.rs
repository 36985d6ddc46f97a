//! Times the schema v5 migration (allocator counters stored as changes) on
//! a version 4 store of N samples (default 200,000), written as version 4
//! wrote them: every body complete. The samples are PyTorch-sized (122
//! counters that move a little each time, ~4.5 KB), in one agent.
//!
//!     cargo run --release -p oomscope-collector --example migrate_v5 -- [N] [DIR]

use std::time::Instant;

mod common;

use oomscope_collector::pb;
use oomscope_collector::pb::agent_message::Body;
use oomscope_collector::store::Store;
use prost::Message;
use rusqlite::params;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).map_or(Ok(200_000), |a| a.parse())?;
    let dir = common::store_dir(args.get(2));
    let path = dir.join(format!("migrate-v5-{}.db", std::process::id()));
    let started = Instant::now();
    {
        let mut store = Store::open(&path)?;
        store.upsert_agent(
            &pb::Hello {
                agent_id: "a1".into(),
                name: "svc".into(),
                ..Default::default()
            },
            1,
        )?;
        drop(store);
        let mut conn = rusqlite::Connection::open(&path)?;
        let tx = conn.transaction()?;
        {
            let mut insert = tx.prepare(
                "INSERT INTO messages(agent_id, seq, time_ns, kind, body) VALUES ('a1', ?1, ?2, 'sample', ?3)",
            )?;
            for seq in 1..=n {
                let m = common::torch_sample(seq);
                let Some(Body::Sample(s)) = &m.body else {
                    unreachable!()
                };
                insert.execute(params![seq as i64, s.time_ns, m.encode_to_vec()])?;
            }
        }
        tx.execute_batch(
            "DROP INDEX IF EXISTS messages_by_chain;
             ALTER TABLE messages DROP COLUMN key_seq;
             ALTER TABLE messages DROP COLUMN whole_len;
             PRAGMA user_version = 4;",
        )?;
        tx.commit()?;
    }
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "a version 4 store of {n} samples written in {:.1?} ({} MB)",
        started.elapsed(),
        size(&path) / 1_000_000
    );
    tracing_subscriber_init();
    let started = Instant::now();
    let store = Store::open(&path)?;
    let took = started.elapsed();
    drop(store);
    println!("migrated {n} samples to schema v5 in {took:.1?}");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}

/// The migration's progress lines, as the collector prints them.
fn tracing_subscriber_init() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
