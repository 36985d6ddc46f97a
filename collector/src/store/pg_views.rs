//! What a query or a correlation reads from the PostgreSQL store, put into a
//! throwaway embedded [`Store`] so that the embedded store's own code answers
//! on both engines: an instance's members with their newest messages and
//! figures as PostgreSQL counts them, and incidents with their merges.
//!
//! - A query's view ([`PgStore::instance_view`]) is one instance: timeline,
//!   diagnose and incidents join its members as the file store joins them.
//! - A correlation's view ([`PgStore::file_incident`]) is every incident near
//!   the new one in time, with their agents and the supervisors' run starts,
//!   read and written back in one transaction under an advisory lock: two
//!   collectors that see parts of one failure record one incident.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result};
use rusqlite::params;
use tokio_postgres::GenericClient;

use super::postgres::{incident_from, insert_incident, PgStore, INCIDENT_COLUMNS, MIGRATION_LOCK};
use super::{decode_hello, decode_message, insert_incident_tx, seq_to_sql, Store};
use crate::pb;
use oomscope_proto::Role;

/// The advisory lock incidents are filed under: correlation reads what is
/// near and writes its merges back, so two collectors filing parts of one
/// failure take turns. Incidents are rare; waiting costs nothing.
const INCIDENT_LOCK: i64 = MIGRATION_LOCK + 2;

/// How many of a supervisor's newest run starts a correlation reads: which
/// run an incident falls in is the latest start before it, and a
/// supervisor's restarts are budgeted, so this covers any window.
const RUN_STARTS_READ: i64 = 64;

/// Correlates a newly stored incident in a store (`correlate::settle`):
/// Some when it stands on its own, None when it merged into another.
pub type Settle = fn(&mut Store, pb::Incident) -> Result<Option<pb::Incident>>;

/// How correlation runs in a shared store: its rule, and how far in time
/// (either side) an incident can be related to another.
#[derive(Clone, Copy)]
pub struct Correlation {
    pub settle: Settle,
    pub window_ns: i64,
}

/// One agent as PostgreSQL holds it.
struct AgentRow {
    agent_id: String,
    hello: pb::Hello,
    instance: String,
    state: String,
    first_seen_ns: i64,
    last_seen_ns: i64,
    last_seq: i64,
    samples: i64,
    events: i64,
    allocator_samples: i64,
}

const AGENT_COLUMNS: &str = "agent_id, hello, instance, state, first_seen_ns, last_seen_ns, \
     last_seq, samples, events, allocator_samples";

fn agent_row(r: &tokio_postgres::Row) -> Result<AgentRow> {
    let agent_id: String = r.get(0);
    Ok(AgentRow {
        hello: decode_hello(&agent_id, r.get(1))?,
        agent_id,
        instance: r.get(2),
        state: r.get(3),
        first_seen_ns: r.get(4),
        last_seen_ns: r.get(5),
        last_seq: r.get(6),
        samples: r.get(7),
        events: r.get(8),
        allocator_samples: r.get(9),
    })
}

/// An incident as stored, with the incident it merged into.
type IncidentRow = (pb::Incident, Option<String>);

fn incident_row(r: &tokio_postgres::Row) -> IncidentRow {
    (incident_from(r), r.get(8))
}

/// A statement of dropped messages as stored: (time_ns, seq, DroppedBefore).
type Mark = (i64, i64, Vec<u8>);

/// The most statements of dropped messages one member's view reads from
/// the history before its window: an agent states a drop once per
/// collector outage it outlived, so this is years of outages, and bounds a
/// query's memory (a few MB) whatever an agent sent.
const MAX_VIEW_MARKS: i64 = 50_000;

/// What a view holds, read in one go and built into a [`Store`] off the
/// store's runtime: each agent with its messages (the newest, then a thinned
/// selection of older samples) and the drop statements older than those.
#[derive(Default)]
struct View {
    agents: Vec<(AgentRow, Vec<pb::AgentMessage>, Vec<Mark>)>,
    incidents: Vec<IncidentRow>,
}

impl View {
    fn build(&self) -> Result<Store> {
        let mut store = Store::open_in_memory()?;
        for (agent, messages, marks) in &self.agents {
            store.restore_agent(agent, messages, marks)?;
        }
        store.restore_incidents(&self.incidents)?;
        Ok(store)
    }
}

async fn agents_where(
    client: &impl GenericClient,
    clause: &str,
    ids: &[String],
) -> Result<Vec<AgentRow>> {
    client
        .query(
            &format!("SELECT {AGENT_COLUMNS} FROM agents WHERE {clause} ORDER BY first_seen_ns, agent_id"),
            &[&ids],
        )
        .await?
        .iter()
        .map(agent_row)
        .collect()
}

async fn newest_messages(
    client: &impl GenericClient,
    agent_id: &str,
    max: u32,
) -> Result<Vec<pb::AgentMessage>> {
    if max == 0 {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT seq, body FROM messages WHERE agent_id = $1 ORDER BY seq DESC LIMIT $2",
            &[&agent_id, &i64::from(max)],
        )
        .await?;
    let mut messages = rows
        .iter()
        .map(|r| decode_message(agent_id, r.get::<_, i64>(0) as u64, r.get(1)))
        .collect::<Result<Vec<_>>>()?;
    messages.reverse();
    Ok(messages)
}

/// Up to `k` of `agent_id`'s samples before seq `before`, spread evenly
/// in time (the first of each of `k` equal stretches), oldest first.
async fn older_samples_of(
    client: &impl GenericClient,
    agent_id: &str,
    before: i64,
    k: u32,
) -> Result<Vec<pb::AgentMessage>> {
    let picked: Vec<i64> = client
        .query(
            "WITH older AS (
               SELECT seq, time_ns FROM messages
               WHERE agent_id = $1 AND kind = 'sample' AND seq < $2),
             span AS (SELECT min(time_ns) AS lo, max(time_ns) + 1 AS hi FROM older)
             SELECT DISTINCT ON (b) seq FROM (
               SELECT seq, time_ns,
                      width_bucket(time_ns::numeric, lo::numeric, hi::numeric, $3::int4) AS b
               FROM older, span) o
             ORDER BY b, time_ns, seq",
            &[&agent_id, &before, &(k.min(i32::MAX as u32) as i32)],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if picked.is_empty() {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT seq, body FROM messages WHERE agent_id = $1 AND seq = ANY($2) ORDER BY seq",
            &[&agent_id, &picked],
        )
        .await?;
    rows.iter()
        .map(|r| decode_message(agent_id, r.get::<_, i64>(0) as u64, r.get(1)))
        .collect()
}

/// `agent_id`'s drop statements before seq `before` (see [`MAX_VIEW_MARKS`]).
async fn marks_before(
    client: &impl GenericClient,
    agent_id: &str,
    before: i64,
) -> Result<Vec<Mark>> {
    Ok(client
        .query(
            "SELECT time_ns, seq, statement FROM dropped_marks
             WHERE agent_id = $1 AND seq < $2 ORDER BY time_ns DESC, seq DESC LIMIT $3",
            &[&agent_id, &before, &MAX_VIEW_MARKS],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

/// The incidents `clause` picks (binding `$1` to ids), oldest first.
async fn incidents_picked(
    client: &impl GenericClient,
    clause: &str,
    ids: &[String],
) -> Result<Vec<IncidentRow>> {
    Ok(client
        .query(
            &format!(
                "SELECT {INCIDENT_COLUMNS}, merged_into FROM incidents WHERE {clause} ORDER BY n"
            ),
            &[&ids],
        )
        .await?
        .iter()
        .map(incident_row)
        .collect())
}

/// The agents of `incidents` that `view` lacks, without their messages: an
/// incident's name and instance come from its agent.
async fn add_incident_agents(client: &impl GenericClient, view: &mut View) -> Result<()> {
    let known: BTreeSet<&str> = view
        .agents
        .iter()
        .map(|(a, _, _)| a.agent_id.as_str())
        .collect();
    let missing: Vec<String> = view
        .incidents
        .iter()
        .map(|(i, _)| i.agent_id.as_str())
        .filter(|a| !known.contains(a))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(str::to_string)
        .collect();
    if !missing.is_empty() {
        for a in agents_where(client, "agent_id = ANY($1)", &missing).await? {
            view.agents.push((a, Vec::new(), Vec::new()));
        }
    }
    Ok(())
}

impl PgStore {
    /// The instance of `agent_id` as an embedded store: every member with
    /// its newest `max_messages` messages, the members' incidents and the
    /// parts merged into them (with those parts' agents); None for an
    /// unknown agent.
    pub(super) fn instance_view(
        &self,
        agent_id: &str,
        max_messages: u32,
        older_samples: u32,
    ) -> Result<Option<Store>> {
        let (pool, id) = (self.pool.clone(), agent_id.to_string());
        let view = self.run(async move {
            let client = pool.get().await?;
            let members = agents_where(
                &**client,
                "instance = (SELECT instance FROM agents WHERE agent_id = ($1::text[])[1])",
                &[id],
            )
            .await?;
            if members.is_empty() {
                return Ok(None);
            }
            let mut view = View::default();
            for m in members {
                let mut messages = newest_messages(&**client, &m.agent_id, max_messages).await?;
                let mut marks = Vec::new();
                // A history longer than the window: its older part thinned,
                // with every drop statement there.
                if messages.len() as u64 == u64::from(max_messages) && older_samples > 0 {
                    let before = messages.first().map_or(0, |m| m.seq as i64);
                    let mut older =
                        older_samples_of(&**client, &m.agent_id, before, older_samples).await?;
                    older.append(&mut messages);
                    messages = older;
                    marks = marks_before(&**client, &m.agent_id, before).await?;
                }
                view.agents.push((m, messages, marks));
            }
            let ids: Vec<String> = view
                .agents
                .iter()
                .map(|(a, _, _)| a.agent_id.clone())
                .collect();
            view.incidents = incidents_picked(
                &**client,
                "agent_id = ANY($1)
                 OR merged_into IN (SELECT id FROM incidents WHERE agent_id = ANY($1))",
                &ids,
            )
            .await?;
            add_incident_agents(&**client, &mut view).await?;
            Ok(Some(view))
        })?;
        view.map(|v| v.build()).transpose()
    }

    /// Stores `incident` once per (agent, seq, kind) and correlates it with
    /// what any collector stored near it, in one transaction under
    /// [`INCIDENT_LOCK`]: the merges and rewrites the rule makes are written
    /// back before the next collector's incident is filed. Returns it (with
    /// its id) when it stands on its own; None when it was stored already or
    /// merged into another.
    pub(super) fn file_incident(
        &self,
        incident: &pb::Incident,
        correlation: Correlation,
    ) -> Result<Option<pb::Incident>> {
        let (pool, inc) = (self.pool.clone(), incident.clone());
        let seq = seq_to_sql(inc.seq)?;
        let neighbourhood = self.run(async move {
            let mut client = pool.get().await?;
            let tx = client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&INCIDENT_LOCK])
                .await?;
            let Some(stored) = insert_incident(&*tx, &inc, seq).await? else {
                return Ok(None);
            };
            let (from, to) = (
                inc.time_ns.saturating_sub(correlation.window_ns),
                inc.time_ns.saturating_add(correlation.window_ns),
            );
            let mut view = View {
                incidents: tx
                    .query(
                        &format!(
                            "SELECT {INCIDENT_COLUMNS}, merged_into FROM incidents
                             WHERE time_ns BETWEEN $1 AND $2 ORDER BY n"
                        ),
                        &[&from, &to],
                    )
                    .await?
                    .iter()
                    .map(incident_row)
                    .collect(),
                agents: agents_where(
                    &*tx,
                    "instance = (SELECT instance FROM agents WHERE agent_id = ($1::text[])[1])",
                    std::slice::from_ref(&inc.agent_id),
                )
                .await?
                .into_iter()
                .map(|a| (a, Vec::new(), Vec::new()))
                .collect(),
            };
            add_incident_agents(&*tx, &mut view).await?;
            // Which run of its supervisor each incident falls in.
            for (agent, messages, _) in &mut view.agents {
                if agent.hello.role == Role::Supervisor {
                    *messages = run_starts(&*tx, &agent.agent_id, to).await?;
                }
            }
            let before: BTreeMap<String, IncidentRow> = view
                .incidents
                .iter()
                .map(|r| (r.0.id.clone(), r.clone()))
                .collect();
            let filed = tokio::task::block_in_place(|| -> Result<_> {
                let mut store = view.build()?;
                let own = (correlation.settle)(&mut store, stored)?;
                Ok((own, store.incident_rows()?))
            });
            let (own, after) = filed?;
            for (inc, merged_into) in &after {
                let Some((was, was_merged)) = before.get(&inc.id) else {
                    continue;
                };
                if was.kind == inc.kind && was.summary == inc.summary && was_merged == merged_into {
                    continue;
                }
                tx.execute(
                    "UPDATE incidents SET kind = $2, summary = $3, merged_into = $4 WHERE id = $1",
                    &[&inc.id, &inc.kind, &inc.summary, merged_into],
                )
                .await?;
                // What merged into it (outside the window too) follows it.
                if let Some(leader) = merged_into.as_ref().filter(|_| was_merged.is_none()) {
                    tx.execute(
                        "UPDATE incidents SET merged_into = $2 WHERE merged_into = $1",
                        &[&inc.id, leader],
                    )
                    .await?;
                }
            }
            tx.commit().await.with_context(|| {
                format!("filing a {} incident of agent {}", inc.kind, inc.agent_id)
            })?;
            Ok(own)
        })?;
        Ok(neighbourhood)
    }
}

/// A supervisor's newest run starts up to `to_ns`.
async fn run_starts(
    client: &impl GenericClient,
    agent_id: &str,
    to_ns: i64,
) -> Result<Vec<pb::AgentMessage>> {
    let rows = client
        .query(
            "SELECT seq, body FROM messages
             WHERE agent_id = $1 AND kind = 'event' AND event_kind = 'child_start' AND time_ns <= $2
             ORDER BY time_ns DESC LIMIT $3",
            &[&agent_id, &to_ns, &RUN_STARTS_READ],
        )
        .await?;
    let mut starts = rows
        .iter()
        .map(|r| decode_message(agent_id, r.get::<_, i64>(0) as u64, r.get(1)))
        .collect::<Result<Vec<_>>>()?;
    starts.sort_by_key(|m| m.seq);
    Ok(starts)
}

impl Store {
    /// Adds an agent of a view with `messages`, then its figures as the
    /// store of record counts them (the view holds only the newest messages).
    fn restore_agent(
        &mut self,
        a: &AgentRow,
        messages: &[pb::AgentMessage],
        marks: &[Mark],
    ) -> Result<()> {
        use prost::Message;
        self.conn.execute(
            "INSERT INTO agents(agent_id, name, hello, state, first_seen_ns, last_seen_ns, instance, host, pid)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![
                a.agent_id,
                a.hello.name,
                a.hello.encode_to_vec(),
                a.state,
                a.first_seen_ns,
                a.last_seen_ns,
                a.instance,
                a.hello.host,
                a.hello.pid
            ],
        )?;
        if !messages.is_empty() {
            self.insert_batch(&a.agent_id, messages)?;
        }
        // Those of samples the view left out too (its own samples' are in).
        for (time_ns, seq, statement) in marks {
            self.conn.execute(
                "INSERT OR IGNORE INTO dropped_marks(agent_id, time_ns, seq, statement)
                 VALUES (?1, ?2, ?3, ?4)",
                params![a.agent_id, time_ns, seq, statement],
            )?;
        }
        self.conn.execute(
            "UPDATE agents SET state = ?2, last_seen_ns = ?3, last_seq = ?4, samples = ?5,
               events = ?6, allocator_samples = ?7 WHERE agent_id = ?1",
            params![
                a.agent_id,
                a.state,
                a.last_seen_ns,
                a.last_seq,
                a.samples,
                a.events,
                a.allocator_samples
            ],
        )?;
        Ok(())
    }

    /// Adds incidents under their ids, in the order they were numbered, and
    /// then their merges.
    fn restore_incidents(&mut self, incidents: &[IncidentRow]) -> Result<()> {
        let tx = self.conn.savepoint()?;
        for (inc, _) in incidents {
            insert_incident_tx(&tx, inc)?;
        }
        for (inc, merged_into) in incidents {
            if let Some(leader) = merged_into {
                tx.execute(
                    "UPDATE incidents SET merged_into = ?2 WHERE id = ?1",
                    params![inc.id, leader],
                )?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Every incident with the one it merged into, oldest first.
    fn incident_rows(&self) -> Result<Vec<IncidentRow>> {
        let mut stmt = self
            .conn
            .prepare("SELECT id, kind, summary, merged_into FROM incidents ORDER BY n")?;
        let rows = stmt.query_map([], |r| {
            Ok((
                pb::Incident {
                    id: r.get(0)?,
                    kind: r.get(1)?,
                    summary: r.get(2)?,
                    ..Default::default()
                },
                r.get::<_, Option<String>>(3)?,
            ))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}
