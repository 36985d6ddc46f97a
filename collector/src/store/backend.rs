//! The store interface the collector's ingest and fleet queries call: what
//! a store of record must do, whichever engine holds it. The embedded SQLite
//! [`Store`] implements it here by delegation (its own methods stay where
//! they live); `postgres.rs` implements it on a PostgreSQL shared by several
//! collectors. One conformance suite (`collector/tests/store_conformance.rs`)
//! runs on both.
//!
//! Every write returns only once it is durable: an ack built from
//! [`BatchOutcome::stored`] is a promise.

use anyhow::Result;

use super::{AgentFilter, BatchOutcome, Correlation, IncidentFilter, Store, MAX_RETENTION_BATCH};
use crate::pb;

/// A store of record: agents, their numbered messages, incidents.
pub trait Backend: Send + Sync {
    /// Binds `agent_id` to the token named `token` unless a token holds it
    /// already; returns the token that holds it.
    fn bind_token(&self, agent_id: &str, token: &str) -> Result<String>;
    /// Records a Hello (a live agent's, or a recovered spool's).
    fn record_hello(&self, hello: &pb::Hello, now_ns: i64) -> Result<()>;
    /// Stores a batch of one agent's numbered messages durably. A seq already
    /// stored with equal content (compared decoded and complete) is `stored`
    /// again (acked as a duplicate); with other content it is `conflicting`.
    fn insert_batch(&self, agent_id: &str, messages: &[pb::AgentMessage]) -> Result<BatchOutcome>;
    /// Sets the agent's state ("connected", "disconnected", "lost", ...).
    fn set_state(&self, agent_id: &str, state: &str, now_ns: i64) -> Result<()>;
    /// The agent's state, None if unknown.
    fn state(&self, agent_id: &str) -> Result<Option<String>>;
    /// Records an incident once per (agent, seq, kind) when seq > 0; None
    /// when that event already raised one. The store gives it its id.
    fn insert_incident(&self, incident: &pb::Incident) -> Result<Option<pb::Incident>>;
    /// Records an incident as [`Backend::insert_incident`] does and
    /// correlates it with what the store holds near it (any collector's),
    /// atomically: Some when it stands on its own, None when it was stored
    /// already or merged into another (it is then that one's part).
    fn file_incident(
        &self,
        incident: &pb::Incident,
        correlation: Correlation,
    ) -> Result<Option<pb::Incident>>;
    /// The agent of incident `id` (a part's too), None if unknown.
    fn incident_agent(&self, id: &str) -> Result<Option<String>>;
    /// The incidents merged into each of `leaders`, as (leader, part),
    /// oldest first.
    fn parts_of(&self, leaders: &[String]) -> Result<Vec<(String, pb::Incident)>>;
    /// Every agent, oldest first.
    fn list_agents(&self) -> Result<Vec<pb::AgentSummary>> {
        self.agents_where(&AgentFilter::default())
    }
    /// The agents `filter` admits, oldest first, filtered in the store's
    /// own query.
    fn agents_where(&self, filter: &AgentFilter) -> Result<Vec<pb::AgentSummary>>;
    /// All incidents (or one agent's), oldest first.
    fn incidents(&self, agent_id: Option<&str>) -> Result<Vec<pb::Incident>> {
        self.incidents_where(agent_id, &IncidentFilter::default())
    }
    /// The incidents (of one agent, or of any) that `filter` admits, oldest
    /// first, filtered in the store's own query.
    fn incidents_where(
        &self,
        agent_id: Option<&str>,
        filter: &IncidentFilter,
    ) -> Result<Vec<pb::Incident>>;
    /// How many messages of the agent are stored (each seq once).
    fn message_count(&self, agent_id: &str) -> Result<u64>;
    /// Deletes what is older than `cutoff_ns`; returns how many rows went.
    fn prune_before(&self, cutoff_ns: i64) -> Result<u64>;
    /// Whether a Hello of the agent came after `since_ns` (collector clock)
    /// through any collector: a stream that broke on one collector and
    /// resumed on another within the grace is no lost agent.
    fn hello_since(&self, agent_id: &str, since_ns: i64) -> Result<bool>;
    /// A throwaway embedded store holding the agent's instance: each
    /// member's Hello, newest `max_messages` messages and figures (and, from
    /// the history before those, `older_samples` samples spread evenly in
    /// time with every statement of dropped messages there), their
    /// incidents and the parts merged into them (under their ids), for
    /// queries that run the embedded store's code (timeline, diagnose,
    /// incidents) on what any collector stored; None for an unknown agent,
    /// or for a store that is queried in place.
    fn snapshot(
        &self,
        agent_id: &str,
        max_messages: u32,
        older_samples: u32,
    ) -> Result<Option<Store>>;
}

/// The embedded store behind the interface: a lock around the one
/// connection, as the collector holds it.
impl Backend for parking_lot::Mutex<Store> {
    fn bind_token(&self, agent_id: &str, token: &str) -> Result<String> {
        self.lock().bind_token(agent_id, token)
    }
    fn record_hello(&self, hello: &pb::Hello, now_ns: i64) -> Result<()> {
        self.lock().record_hello(hello, now_ns)
    }
    fn insert_batch(&self, agent_id: &str, messages: &[pb::AgentMessage]) -> Result<BatchOutcome> {
        self.lock().insert_batch(agent_id, messages)
    }
    fn set_state(&self, agent_id: &str, state: &str, now_ns: i64) -> Result<()> {
        self.lock().set_state(agent_id, state, now_ns)
    }
    fn state(&self, agent_id: &str) -> Result<Option<String>> {
        self.lock().state(agent_id)
    }
    fn insert_incident(&self, incident: &pb::Incident) -> Result<Option<pb::Incident>> {
        self.lock().insert_incident(incident)
    }
    fn file_incident(
        &self,
        incident: &pb::Incident,
        correlation: Correlation,
    ) -> Result<Option<pb::Incident>> {
        let mut store = self.lock();
        match store.insert_incident(incident)? {
            Some(stored) => (correlation.settle)(&mut store, stored),
            None => Ok(None),
        }
    }
    fn incident_agent(&self, id: &str) -> Result<Option<String>> {
        Ok(self.lock().incident(id)?.map(|i| i.agent_id))
    }
    fn parts_of(&self, leaders: &[String]) -> Result<Vec<(String, pb::Incident)>> {
        let store = self.lock();
        let mut parts = Vec::new();
        for leader in leaders {
            for part in store.merged_into(leader)? {
                parts.push((leader.clone(), part));
            }
        }
        Ok(parts)
    }
    fn agents_where(&self, filter: &AgentFilter) -> Result<Vec<pb::AgentSummary>> {
        self.lock().agents_where(filter)
    }
    fn incidents_where(
        &self,
        agent_id: Option<&str>,
        filter: &IncidentFilter,
    ) -> Result<Vec<pb::Incident>> {
        self.lock().incidents_where(agent_id, filter)
    }
    fn message_count(&self, agent_id: &str) -> Result<u64> {
        self.lock().message_count(agent_id)
    }
    /// One collector per file: its own links tell whether the agent came
    /// back (see `ingest.rs`), so the file keeps no Hello times.
    fn hello_since(&self, _agent_id: &str, _since_ns: i64) -> Result<bool> {
        Ok(false)
    }
    /// Queried in place: the collector reads the file itself.
    fn snapshot(&self, _agent_id: &str, _messages: u32, _older: u32) -> Result<Option<Store>> {
        Ok(None)
    }
    fn prune_before(&self, cutoff_ns: i64) -> Result<u64> {
        let mut total = 0;
        loop {
            let n = self.lock().prune_before(cutoff_ns, MAX_RETENTION_BATCH)?;
            total += n;
            if n == 0 {
                return Ok(total);
            }
        }
    }
}
