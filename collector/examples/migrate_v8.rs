//! Times the schema v8 migration (messages and figures in arrival order)
//! on a version 7 store of N samples (default 200,000) from A agents
//! (default 16), interleaved as a group commit stores them: PyTorch-sized
//! samples (122 counters that move a little each time), stored as v7 did
//! (counters as changes in chains, rows clustered by key).
//!
//!     cargo run --release -p oomscope-collector --example migrate_v8 -- [N] [A] [DIR]

use std::time::Instant;

mod common;

use oomscope_collector::pb;
use oomscope_collector::store::{Store, BACK_TO_V7};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).map_or(Ok(200_000), |a| a.parse())?;
    let agents: u64 = args.get(2).map_or(Ok(16), |a| a.parse())?;
    let dir = common::store_dir(args.get(3));
    let path = dir.join(format!("migrate-v8-{}.db", std::process::id()));
    let started = Instant::now();
    {
        let mut store = Store::open(&path)?;
        let ids: Vec<String> = (0..agents).map(|a| format!("agent-{a}")).collect();
        for id in &ids {
            let hello = pb::Hello {
                agent_id: id.clone(),
                name: "svc".into(),
                ..Default::default()
            };
            store.upsert_agent(&hello, 1)?;
        }
        let per_agent = n / agents.max(1);
        // Groups of 1,000 batches, one sample each: the writer's commits.
        store.begin_group()?;
        for seq in 1..=per_agent {
            for id in &ids {
                store.insert_batch(id, &[common::torch_sample(seq)])?;
            }
            if seq % (1_000 / agents.max(1)).max(1) == 0 {
                store.commit_group()?;
                store.begin_group()?;
            }
        }
        store.commit_group()?;
        drop(store);
        rusqlite::Connection::open(&path)?.execute_batch(BACK_TO_V7)?;
    }
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "a version 7 store of {n} samples from {agents} agents written in {:.1?} ({} MB)",
        started.elapsed(),
        size(&path) / 1_000_000
    );
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let started = Instant::now();
    let store = Store::open(&path)?;
    let took = started.elapsed();
    drop(store);
    println!(
        "migrated {n} samples to schema v8 in {took:.1?} ({} MB after)",
        size(&path) / 1_000_000
    );
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}
