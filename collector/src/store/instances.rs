//! Instances: one running service, however many processes it has. A vLLM
//! under `oomscope run` is a supervisor, an API server, an engine core, its
//! workers and short-lived helpers: each sends its own agent stream, and all
//! of them are one instance, so that a name means the service, never
//! whichever of its processes started last.
//!
//! An agent's instance is fixed at its first Hello: the one it names
//! (`oomscope run` passes its own agent id to everything it starts), else
//! the instance of its parent process's agent, else that of a live agent of
//! the same name on the same host, else its own id.

use anyhow::Result;
use rusqlite::{params, OptionalExtension, Transaction};

use super::{decode_hello, decode_message, incident_row, Store, INCIDENT_SELECT};
use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::event::Kind as EventKind;
use oomscope_proto::Role;

/// One process of an instance, as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub agent_id: String,
    pub role: String,
    pub runtime: String,
    pub state: String,
    pub first_seen_ns: i64,
    /// Samples that carried allocator readings (a PyTorch or cudarc process).
    pub allocator_samples: i64,
}

/// An instance and its members, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    pub id: String,
    pub members: Vec<Member>,
}

impl Instance {
    /// The member that speaks for the instance: the process with the
    /// allocator's view (most allocator samples, the newest on a tie), else
    /// the supervisor, else the process that founded the instance. Its
    /// samples are the instance's timeline; the supervisor's process tree is
    /// joined to them (see `query`).
    pub fn main(&self) -> &Member {
        self.members
            .iter()
            .filter(|m| m.allocator_samples > 0)
            .max_by_key(|m| (m.allocator_samples, m.first_seen_ns))
            .or_else(|| self.supervisor())
            .or_else(|| self.members.iter().find(|m| m.agent_id == self.id))
            .unwrap_or(&self.members[0])
    }

    /// The `oomscope run` that supervises the instance, if one does.
    pub fn supervisor(&self) -> Option<&Member> {
        self.members.iter().find(|m| m.role == Role::Supervisor)
    }
}

/// What a name, an instance id or an agent id given to a query stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One process, asked for by its agent id.
    Agent(String),
    /// A whole instance, asked for by its id or its name.
    Instance(Instance),
}

impl Target {
    /// The agent whose samples answer for the target.
    pub fn main_agent(&self) -> &str {
        match self {
            Target::Agent(a) => a,
            Target::Instance(i) => &i.main().agent_id,
        }
    }
}

/// Schema v2: the instance (and the host and pid that find a parent's
/// instance), allocator samples per agent, and merged incidents.
pub(super) fn migrate_v2(tx: &Transaction<'_>) -> Result<()> {
    tx.execute_batch(
        "ALTER TABLE agents ADD COLUMN instance TEXT NOT NULL DEFAULT '';
         ALTER TABLE agents ADD COLUMN host TEXT NOT NULL DEFAULT '';
         ALTER TABLE agents ADD COLUMN pid INTEGER NOT NULL DEFAULT 0;
         ALTER TABLE agents ADD COLUMN allocator_samples INTEGER NOT NULL DEFAULT 0;
         ALTER TABLE incidents ADD COLUMN merged_into TEXT;",
    )?;
    // Agents stored before instances existed: each is its own, unless its
    // Hello already named one.
    let rows: Vec<(String, Vec<u8>)> = {
        let mut stmt = tx.prepare("SELECT agent_id, hello FROM agents")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    for (agent_id, blob) in rows {
        let hello = decode_hello(&agent_id, &blob)?;
        let instance = if hello.instance.is_empty() {
            agent_id.clone()
        } else {
            hello.instance.clone()
        };
        tx.execute(
            "UPDATE agents SET instance = ?2, host = ?3, pid = ?4 WHERE agent_id = ?1",
            params![agent_id, instance, hello.host, hello.pid],
        )?;
    }
    tx.execute_batch(
        "CREATE INDEX agents_by_instance ON agents(instance, first_seen_ns);
         CREATE INDEX agents_by_host_pid ON agents(host, pid);",
    )?;
    Ok(())
}

impl Store {
    /// The instance a new agent joins (see the module's doc). An agent the
    /// store already knows keeps the instance it joined.
    pub(super) fn instance_for(&self, hello: &pb::Hello) -> Result<String> {
        if let Some(known) = self.instance_of(&hello.agent_id)? {
            return Ok(known);
        }
        if !hello.instance.is_empty() {
            return Ok(hello.instance.clone());
        }
        if hello.parent_pid != 0 {
            let parent: Option<String> = self
                .conn
                .query_row(
                    "SELECT instance FROM agents WHERE host = ?1 AND pid = ?2 AND state = 'connected'
                     ORDER BY first_seen_ns DESC LIMIT 1",
                    params![hello.host, hello.parent_pid],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(p) = parent {
                return Ok(p);
            }
        }
        let sibling: Option<String> = self
            .conn
            .query_row(
                "SELECT instance FROM agents WHERE host = ?1 AND name = ?2 AND state = 'connected'
                 ORDER BY first_seen_ns LIMIT 1",
                params![hello.host, hello.name],
                |r| r.get(0),
            )
            .optional()?;
        Ok(sibling.unwrap_or_else(|| hello.agent_id.clone()))
    }

    /// When `agent_id` first said Hello (collector clock).
    pub fn first_seen(&self, agent_id: &str) -> Result<Option<i64>> {
        Ok(self
            .conn
            .query_row(
                "SELECT first_seen_ns FROM agents WHERE agent_id = ?1",
                [agent_id],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// The instance `agent_id` belongs to.
    pub fn instance_of(&self, agent_id: &str) -> Result<Option<String>> {
        Ok(self
            .conn
            .query_row(
                "SELECT instance FROM agents WHERE agent_id = ?1",
                [agent_id],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// The instance `id` and its members, oldest first; None when no agent belongs to it.
    pub fn instance(&self, id: &str) -> Result<Option<Instance>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT agent_id, hello, state, first_seen_ns, allocator_samples FROM agents
             WHERE instance = ?1 ORDER BY first_seen_ns, agent_id",
        )?;
        let rows = stmt.query_map([id], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, i64>(4)?,
            ))
        })?;
        let mut members = Vec::new();
        for row in rows {
            let (agent_id, blob, state, first_seen_ns, allocator_samples) = row?;
            let hello = decode_hello(&agent_id, &blob)?;
            members.push(Member {
                agent_id,
                role: hello.role,
                runtime: hello.runtime,
                state,
                first_seen_ns,
                allocator_samples,
            });
        }
        Ok((!members.is_empty()).then(|| Instance {
            id: id.to_string(),
            members,
        }))
    }

    /// What `x` names: an agent id is that process; an instance id, or a
    /// name (its newest instance), is the whole instance.
    pub fn resolve(&self, x: &str) -> Result<Option<Target>> {
        let is_agent = self
            .conn
            .query_row("SELECT 1 FROM agents WHERE agent_id = ?1", [x], |_| Ok(()))
            .optional()?
            .is_some();
        if is_agent && self.instance_of(x)?.as_deref() != Some(x) {
            return Ok(Some(Target::Agent(x.to_string())));
        }
        if let Some(i) = self.instance(x)? {
            return Ok(Some(Target::Instance(i)));
        }
        // A name: the instance whose first process started last.
        let newest: Option<String> = self
            .conn
            .query_row(
                "SELECT instance FROM agents
                 WHERE instance IN (SELECT instance FROM agents WHERE name = ?1)
                 GROUP BY instance ORDER BY min(first_seen_ns) DESC LIMIT 1",
                [x],
                |r| r.get(0),
            )
            .optional()?;
        match newest {
            Some(id) => Ok(self.instance(&id)?.map(Target::Instance)),
            None => Ok(None),
        }
    }

    /// The latest incident, not merged into another, of any member of `instance`.
    pub fn latest_incident_of_instance(&self, instance: &str) -> Result<Option<pb::Incident>> {
        Ok(self
            .conn
            .query_row(
                &format!(
                    "{INCIDENT_SELECT} WHERE a.instance = ?1 AND i.merged_into IS NULL
                     ORDER BY i.n DESC LIMIT 1"
                ),
                [instance],
                incident_row,
            )
            .optional()?)
    }

    /// Incidents of `instance`'s members (not merged) between `from_ns` and
    /// `to_ns`, oldest first: the candidates a new one correlates with.
    pub fn incidents_of_instance(
        &self,
        instance: &str,
        from_ns: i64,
        to_ns: i64,
    ) -> Result<Vec<pb::Incident>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "{INCIDENT_SELECT} WHERE a.instance = ?1 AND i.merged_into IS NULL
             AND i.time_ns BETWEEN ?2 AND ?3 ORDER BY i.n"
        ))?;
        let rows = stmt.query_map(params![instance, from_ns, to_ns], incident_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Incidents of `kind` of any agent (not merged) between `from_ns` and `to_ns`.
    pub fn incidents_of_kind(
        &self,
        kind: &str,
        from_ns: i64,
        to_ns: i64,
    ) -> Result<Vec<pb::Incident>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "{INCIDENT_SELECT} WHERE i.kind = ?1 AND i.merged_into IS NULL
             AND i.time_ns BETWEEN ?2 AND ?3 ORDER BY i.n"
        ))?;
        let rows = stmt.query_map(params![kind, from_ns, to_ns], incident_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Folds incident `id` into `into`: it stays on record (and `incident`
    /// finds its leader) but no longer lists or counts as its own.
    pub fn merge_incident(&mut self, id: &str, into: &str) -> Result<()> {
        self.conn.execute(
            "UPDATE incidents SET merged_into = ?2 WHERE id = ?1",
            params![id, into],
        )?;
        // Anything already merged into `id` follows it.
        self.conn.execute(
            "UPDATE incidents SET merged_into = ?2 WHERE merged_into = ?1",
            params![id, into],
        )?;
        Ok(())
    }

    /// Rewrites an incident's kind and summary (a lost agent that turned out
    /// to be one of many: a mass disconnect).
    pub fn update_incident(&mut self, id: &str, kind: &str, summary: &str) -> Result<()> {
        self.conn.execute(
            "UPDATE incidents SET kind = ?2, summary = ?3 WHERE id = ?1",
            params![id, kind, summary],
        )?;
        Ok(())
    }

    /// The incidents merged into `id`.
    pub fn merged_into(&self, id: &str) -> Result<Vec<pb::Incident>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "{INCIDENT_SELECT} WHERE i.merged_into = ?1 ORDER BY i.n"
        ))?;
        let rows = stmt.query_map([id], incident_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// How many incidents were merged into `id`.
    pub fn merged_count(&self, id: &str) -> Result<u64> {
        let n: i64 = self.conn.query_row(
            "SELECT count(*) FROM incidents WHERE merged_into = ?1",
            [id],
            |r| r.get(0),
        )?;
        Ok(n as u64)
    }

    /// `agent_id`'s events in `from_ns..=to_ns`, tagged with it, oldest
    /// first: the newest that fit a reply (see `history.rs`), and the time
    /// before which events were left out (0: none were).
    pub fn events_of(
        &self,
        agent_id: &str,
        from_ns: i64,
        to_ns: i64,
    ) -> Result<(Vec<pb::TimedEvent>, i64)> {
        let (mut events, cut_ns) =
            self.newest_events(agent_id, from_ns, to_ns, super::DEFAULT_EVENT_REPLY_BYTES)?;
        for e in &mut events {
            e.agent_id = agent_id.to_string();
        }
        Ok((events, cut_ns))
    }

    /// Which run of `supervisor`'s child `time_ns` falls in: the seq of the
    /// latest ChildStart at or before it (None before the first).
    pub fn run_of(&self, supervisor: &str, time_ns: i64) -> Result<Option<u64>> {
        Ok(self
            .conn
            .query_row(
                "SELECT seq FROM messages
                 WHERE agent_id = ?1 AND kind = 'event' AND event_kind = 'child_start' AND time_ns <= ?2
                 ORDER BY time_ns DESC LIMIT 1",
                params![supervisor, time_ns],
                |r| r.get::<_, i64>(0),
            )
            .optional()?
            .map(|s| s as u64))
    }
}

/// How many of a supervisor's newest child ends [`Store::child_exits`] reads:
/// its tree's processes' ends are budgeted (60 failures a minute), so this
/// covers the minutes around any one death.
pub const CHILD_EXITS_READ: i64 = 200;

impl Store {
    /// The newest [`CHILD_EXITS_READ`] ChildExits `agent_id` (a supervisor)
    /// sent, its child's and its tree's other processes', newest first.
    pub fn child_exits(&self, agent_id: &str) -> Result<Vec<(i64, pb::ChildExit)>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq, time_ns, body FROM messages
             WHERE agent_id = ?1 AND kind = 'event' AND event_kind = 'child_exit'
             ORDER BY time_ns DESC LIMIT ?2",
        )?;
        let rows = stmt.query_map(params![agent_id, CHILD_EXITS_READ], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, Vec<u8>>(2)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (seq, time_ns, body) = row?;
            if let Some(Body::Event(pb::Event {
                kind: Some(EventKind::ChildExit(x)),
                ..
            })) = decode_message(agent_id, seq as u64, &body)?.body
            {
                out.push((time_ns, x));
            }
        }
        Ok(out)
    }

    /// When `agent_id` (a supervisor) last passed a stop signal on.
    pub fn latest_stop_forwarded(&self, agent_id: &str) -> Result<Option<i64>> {
        Ok(self
            .newest_message(agent_id, "event", Some("stop_forwarded"))?
            .map(|(t, _)| t))
    }

    /// The Goodbye `agent_id` sent, with the (collector's) time it was stored.
    pub fn latest_goodbye(&self, agent_id: &str) -> Result<Option<(i64, pb::Goodbye)>> {
        let newest = self.newest_message(agent_id, "goodbye", None)?;
        Ok(newest.and_then(|(t, body)| match body {
            Body::Goodbye(g) => Some((t, g)),
            _ => None,
        }))
    }

    /// The newest stored message of `kind` (and `event_kind`) of `agent_id`, with its time.
    fn newest_message(
        &self,
        agent_id: &str,
        kind: &str,
        event_kind: Option<&str>,
    ) -> Result<Option<(i64, Body)>> {
        let row: Option<(i64, i64, Vec<u8>)> = self
            .conn
            .query_row(
                "SELECT seq, time_ns, body FROM messages
                 WHERE agent_id = ?1 AND kind = ?2 AND (?3 IS NULL OR event_kind = ?3)
                 ORDER BY time_ns DESC LIMIT 1",
                params![agent_id, kind, event_kind],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        let Some((seq, time_ns, body)) = row else {
            return Ok(None);
        };
        Ok(decode_message(agent_id, seq as u64, &body)?
            .body
            .map(|b| (time_ns, b)))
    }

    /// The incident `id` stands under: itself, or the one it was merged into.
    pub fn leader_of(&self, id: &str) -> Result<Option<String>> {
        Ok(self
            .conn
            .query_row(
                "SELECT coalesce(merged_into, id) FROM incidents WHERE id = ?1",
                [id],
                |r| r.get(0),
            )
            .optional()?)
    }
}
