//! Schema v3: the layout that queries read (see `collector/STORAGE.md` for
//! the measurements behind it).
//!
//! - `figures`: one compact record per sample, clustered by
//!   (agent, time, seq): the Sample as the agent sent it without its
//!   allocators' `raw` stats dicts, which are ~90 % of a PyTorch sample's
//!   bytes and which no chart or verdict reads. Timelines, charts and the
//!   analysis read these; `messages` keeps every message whole for detail
//!   and export.
//! - per-agent message counts kept by the writer, so that listing agents
//!   counts nothing.

use anyhow::Result;
use prost::Message;
use rusqlite::{params, Connection, Transaction};

use super::decode_message;
use crate::pb;
use crate::pb::agent_message::Body;

pub(super) fn migrate_v3(tx: &Transaction<'_>) -> Result<()> {
    tx.execute_batch(
        "CREATE TABLE figures(
             agent_id TEXT NOT NULL,
             time_ns  INTEGER NOT NULL,
             seq      INTEGER NOT NULL,
             sample   BLOB NOT NULL,   -- the Sample less its allocators' raw dicts
             PRIMARY KEY(agent_id, time_ns, seq)
         ) WITHOUT ROWID;
         ALTER TABLE agents ADD COLUMN samples INTEGER NOT NULL DEFAULT 0;
         ALTER TABLE agents ADD COLUMN events INTEGER NOT NULL DEFAULT 0;
         UPDATE agents SET
           samples = (SELECT count(*) FROM messages m WHERE m.agent_id = agents.agent_id AND m.kind = 'sample'),
           events = (SELECT count(*) FROM messages m WHERE m.agent_id = agents.agent_id AND m.kind = 'event');",
    )?;
    // Every stored sample gets its record, read in one pass in key order.
    let mut read = tx.prepare("SELECT agent_id, seq, body FROM messages WHERE kind = 'sample'")?;
    let mut rows = read.query([])?;
    while let Some(row) = rows.next()? {
        let agent_id: String = row.get(0)?;
        let seq = row.get::<_, i64>(1)? as u64;
        let body: Vec<u8> = row.get(2)?;
        if let Some(Body::Sample(s)) = decode_message(&agent_id, seq, &body)?.body {
            insert(tx, &agent_id, seq as i64, &s)?;
        }
    }
    Ok(())
}

/// Stores the record of one sample (a new seq of `agent_id`).
pub(super) fn insert(tx: &Connection, agent_id: &str, seq: i64, sample: &pb::Sample) -> Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT OR IGNORE INTO figures(agent_id, time_ns, seq, sample) VALUES (?1, ?2, ?3, ?4)",
    )?;
    stmt.execute(params![agent_id, sample.time_ns, seq, encode(sample)])?;
    super::marks::record(tx, agent_id, seq, sample)
}

/// The record's bytes: the sample without the `raw` dicts (complete or as
/// changes). Built field by
/// field rather than cloned and cleared: a clone would copy each dict's
/// hundred keys on the ingest path only to drop them.
fn encode(s: &pb::Sample) -> Vec<u8> {
    if s.allocator
        .iter()
        .all(|a| a.raw.is_empty() && a.raw_changes.is_none())
    {
        return s.encode_to_vec();
    }
    pb::Sample {
        time_ns: s.time_ns,
        process: s.process,
        cgroup: s.cgroup.clone(),
        system: s.system,
        gpus: s.gpus.clone(),
        allocator: s.allocator.iter().map(lean).collect(),
        context: s.context.clone(),
        t_s: s.t_s,
        step: s.step,
        tree: s.tree.clone(),
        tree_rss_bytes: s.tree_rss_bytes,
        tree_pss_bytes: s.tree_pss_bytes,
        numa_nodes: s.numa_nodes.clone(),
        dropped_before: s.dropped_before,
        requests: s.requests.clone(),
        gpu_processes: s.gpu_processes.clone(),
        backlog: s.backlog,
    }
    .encode_to_vec()
}

/// An allocator's reading without its `raw` dict. Any field added later
/// stays out until it is named here (the default fills it).
#[allow(clippy::needless_update)]
fn lean(a: &pb::AllocatorStats) -> pb::AllocatorStats {
    pb::AllocatorStats {
        device: a.device,
        allocated_bytes: a.allocated_bytes,
        allocated_peak_bytes: a.allocated_peak_bytes,
        reserved_bytes: a.reserved_bytes,
        reserved_peak_bytes: a.reserved_peak_bytes,
        active_bytes: a.active_bytes,
        active_peak_bytes: a.active_peak_bytes,
        inactive_split_bytes: a.inactive_split_bytes,
        inactive_split_peak_bytes: a.inactive_split_peak_bytes,
        requested_bytes: a.requested_bytes,
        requested_peak_bytes: a.requested_peak_bytes,
        num_alloc_retries: a.num_alloc_retries,
        num_ooms: a.num_ooms,
        num_device_alloc: a.num_device_alloc,
        num_device_free: a.num_device_free,
        segments: a.segments,
        segments_peak: a.segments_peak,
        allocations: a.allocations,
        inactive_split_blocks: a.inactive_split_blocks,
        driver_free_bytes: a.driver_free_bytes,
        driver_total_bytes: a.driver_total_bytes,
        raw: Default::default(),
        ..Default::default()
    }
}

pub(super) fn decode(agent_id: &str, seq: u64, blob: &[u8]) -> Result<pb::Sample> {
    use anyhow::Context;
    pb::Sample::decode(blob)
        .with_context(|| format!("stored figures of agent {agent_id} seq {seq} do not decode"))
}
