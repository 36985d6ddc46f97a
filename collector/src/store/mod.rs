//! The collector's embedded store: one SQLite file holding every agent's Hello,
//! every Sample and Event it sent (as raw protobuf bytes, so nothing is lost),
//! a compact record of each sample for queries (`figures.rs`), and the
//! incidents raised from them. `collector/STORAGE.md` gives the layout and the
//! measurements behind it; `history.rs` the bounded read path.
//!
//! Writes are durable before they return (WAL + `synchronous=FULL`): the server
//! acks a seq only after `insert_batch` has returned, which is the agent's
//! licence to drop its copy.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use prost::Message;
use rusqlite::{params, Connection, OptionalExtension};

use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::event::Kind as EventKind;

mod arrival;
mod backend;
mod counters;
mod figures;
mod file;
mod filters;
mod history;
mod instances;
mod marks;
mod pg_views;
mod pg_writer;
mod postgres;
mod readers;
mod retention;
mod rollups;

pub use arrival::BACK_TO_V7;
pub use backend::Backend;
pub use counters::{new_stream, Incoming, Received, StreamPlace, KEYFRAME_INTERVAL};
pub use file::{FileWatch, WriterLock, DB_FILE_MODE};
pub use filters::{AgentFilter, IncidentFilter};
pub use history::{
    AgentHistory, DEFAULT_ANALYSIS_EVENT_BYTES, DEFAULT_EVENT_REPLY_BYTES,
    DEFAULT_MAX_TIMELINE_SAMPLES, DEFAULT_SAMPLE_REPLY_BYTES,
};
pub use instances::{Instance, Member, Target};
pub use pg_views::{Correlation, Settle};
pub use postgres::{is_postgres_url, redact, PgStore, DEFAULT_PG_POOL};
pub use readers::{ReaderPool, DEFAULT_READERS};
pub use retention::MAX_RETENTION_BATCH;

/// The WAL's length in pages (4 KiB) at which a commit copies it into the
/// database file (SQLite's default is 1,000). A group commit of 2,000
/// agents' one-sample batches dirties ~2,400 pages, one per agent per
/// index, so at 1,000 every commit also checkpointed: each page written
/// twice and a second fsync. At 16,000 (a 64 MiB WAL) a checkpoint comes
/// every few commits and writes each page once for all of them: the paced
/// 2,000-agent run's p99 ack fell from 1.31-1.48 s to 0.32-0.79 s
/// (BENCHMARKS.md).
pub const WAL_CHECKPOINT_PAGES: i64 = 16_000;

/// The writer connection's page cache in KiB (SQLite's default is 2 MiB).
/// 2,000 agents' current index leaves are ~2,400 pages (10 MB), read back
/// from the OS on every group commit at the default. At 16 MiB the paced
/// 2,000-agent run's p99 ack was 0.62-0.65 s against 0.72-0.86 s; 32 MiB
/// gave 0.19-0.60 s but the closed-loop run's VmHWM 307 MiB (BENCHMARKS.md).
/// It is handed back with the allocator's free memory once agents leave
/// ([`Store::release_cache`]). Readers keep the default.
pub const WRITER_CACHE_KIB: i64 = 16 * 1024;

/// Bump when the schema changes, and add a step to `migrate`.
const SCHEMA_VERSION: i64 = 8;

const SCHEMA_V1: &str = "
CREATE TABLE agents(
    agent_id      TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    hello         BLOB NOT NULL,
    state         TEXT NOT NULL,
    first_seen_ns INTEGER NOT NULL,
    last_seen_ns  INTEGER NOT NULL,
    last_seq      INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX agents_by_name ON agents(name, first_seen_ns);
CREATE TABLE messages(
    agent_id   TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    time_ns    INTEGER NOT NULL,
    kind       TEXT NOT NULL,      -- 'sample' | 'event' | 'goodbye'
    event_kind TEXT,               -- the Event oneof's field name, e.g. 'oom'
    body       BLOB NOT NULL,      -- the whole AgentMessage, prost-encoded
    PRIMARY KEY(agent_id, seq)
) WITHOUT ROWID;
CREATE INDEX messages_by_time ON messages(agent_id, kind, time_ns);
CREATE TABLE incidents(
    n        INTEGER PRIMARY KEY AUTOINCREMENT,
    id       TEXT NOT NULL UNIQUE,
    agent_id TEXT NOT NULL,
    kind     TEXT NOT NULL,
    time_ns  INTEGER NOT NULL,
    domain   TEXT NOT NULL,
    summary  TEXT NOT NULL,
    seq      INTEGER NOT NULL
);
-- An event raises its incident once, however often the agent resends it.
CREATE UNIQUE INDEX incidents_by_source ON incidents(agent_id, seq, kind) WHERE seq > 0;
CREATE INDEX incidents_by_agent ON incidents(agent_id, time_ns);
";

/// v6: which token each agent id is bound to (see `auth.rs`), and the
/// chains' index for retention. Agents of a
/// collector without tokens have no row; the first token that names an
/// agent id after tokens are turned on takes it.
const SCHEMA_V6: &str = "
CREATE TABLE IF NOT EXISTS agent_tokens(
    agent_id TEXT PRIMARY KEY,
    token    TEXT NOT NULL        -- the token's name, never its secret
) WITHOUT ROWID;
-- Retention keeps a chain while any row of it is young (retention.rs).
CREATE INDEX IF NOT EXISTS messages_by_chain ON messages(agent_id, key_seq) WHERE key_seq IS NOT NULL;
";

/// What `insert_batch` did with one batch.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Every seq that is now durably stored (new or a duplicate), ascending.
    pub stored: Vec<u64>,
    /// The subset that this batch stored for the first time.
    pub fresh: Vec<u64>,
    /// Seqs already stored with other content: refused, neither stored nor
    /// acked (an acked message is never replaced, see [`Store::insert_batch`]).
    pub conflicting: Vec<u64>,
}

pub struct Store {
    conn: Connection,
    /// The writer's open rollup buckets (unused by readers).
    rollups: rollups::Open,
    /// The writer's open chains of counters as changes (unused by readers).
    chains: counters::Chains,
}

impl Store {
    /// Opens (or creates) the store at `path` and brings its schema up to date.
    pub fn open(path: &Path) -> Result<Store> {
        file::create_private(path)?;
        let conn = Connection::open(path)
            .with_context(|| format!("opening the store {}", path.display()))?;
        // WAL lets queries read while an ingest writes; FULL syncs the WAL on
        // every commit, which is what makes an ack a promise.
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .with_context(|| format!("setting WAL mode on {}", path.display()))?;
        if !mode.eq_ignore_ascii_case("wal") {
            bail!("{}: SQLite refused WAL mode (got {mode:?})", path.display());
        }
        file::quick_check(&conn, path)?;
        conn.pragma_update(None, "wal_autocheckpoint", WAL_CHECKPOINT_PAGES)?;
        conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
        Self::init(conn).with_context(|| format!("preparing the store {}", path.display()))
    }

    /// A read-only connection to the store at `path`, which [`Store::open`]
    /// has created. With WAL it reads the last committed state while the
    /// writer's connection goes on writing; any write through it fails.
    pub fn open_reader(path: &Path) -> Result<Store> {
        let conn = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .with_context(|| format!("opening the store {} for reading", path.display()))?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        Ok(Store {
            conn,
            rollups: Default::default(),
            chains: Default::default(),
        })
    }

    /// A throwaway store, for tests and `replay` without `--db`.
    pub fn open_in_memory() -> Result<Store> {
        Self::init(Connection::open_in_memory().context("opening an in-memory store")?)
    }

    fn init(conn: Connection) -> Result<Store> {
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        // Another process (a second CLI, a backup) may hold the lock briefly.
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let mut store = Store {
            conn,
            rollups: Default::default(),
            chains: Default::default(),
        };
        store.migrate()?;
        Ok(store)
    }

    fn migrate(&mut self) -> Result<()> {
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            bail!(
                "the store has schema version {version}, newer than this oomscope understands \
                 ({SCHEMA_VERSION}); use a newer oomscope"
            );
        }
        if version < 1 {
            let tx = self.conn.transaction()?;
            tx.execute_batch(SCHEMA_V1)?;
            tx.pragma_update(None, "user_version", 1)?;
            tx.commit()?;
        }
        if version < 2 {
            let tx = self.conn.transaction()?;
            instances::migrate_v2(&tx)?;
            tx.pragma_update(None, "user_version", 2)?;
            tx.commit()?;
        }
        if version < 3 {
            let tx = self.conn.transaction()?;
            figures::migrate_v3(&tx)?;
            tx.pragma_update(None, "user_version", 3)?;
            tx.commit()?;
        }
        if version < 4 {
            let tx = self.conn.transaction()?;
            rollups::migrate_v4(&tx)?;
            tx.pragma_update(None, "user_version", 4)?;
            tx.commit()?;
        }
        if version < 5 {
            let tx = self.conn.transaction()?;
            counters::migrate_v5(&tx)?;
            tx.pragma_update(None, "user_version", 5)?;
            tx.commit()?;
        }
        if version < 6 {
            let tx = self.conn.transaction()?;
            tx.execute_batch(SCHEMA_V6)?;
            tx.pragma_update(None, "user_version", 6)?;
            tx.commit()?;
        }
        if version < 7 {
            let tx = self.conn.transaction()?;
            marks::migrate_v7(&tx)?;
            tx.pragma_update(None, "user_version", 7)?;
            tx.commit()?;
        }
        if version < 8 {
            let tx = self.conn.transaction()?;
            arrival::migrate_v8(&tx)?;
            tx.pragma_update(None, "user_version", 8)?;
            tx.commit()?;
        }
        Ok(())
    }

    /// Records an agent's Hello (sent again on every connect) and marks it connected.
    pub fn upsert_agent(&mut self, hello: &pb::Hello, now_ns: i64) -> Result<()> {
        if hello.agent_id.is_empty() {
            bail!("a Hello without an agent_id");
        }
        let instance = self.instance_for(hello)?;
        self.conn
            .execute(
                "INSERT INTO agents(agent_id, name, hello, state, first_seen_ns, last_seen_ns, instance, host, pid)
                 VALUES (?1, ?2, ?3, 'connected', ?4, ?4, ?5, ?6, ?7)
                 ON CONFLICT(agent_id) DO UPDATE SET
                   name = excluded.name, hello = excluded.hello,
                   state = 'connected', last_seen_ns = excluded.last_seen_ns",
                params![
                    hello.agent_id,
                    hello.name,
                    hello.encode_to_vec(),
                    now_ns,
                    instance,
                    hello.host,
                    hello.pid
                ],
            )
            .with_context(|| format!("storing the Hello of agent {}", hello.agent_id))?;
        Ok(())
    }

    /// Stores a batch of an agent's messages in one transaction. A seq that is
    /// already stored is left as it was: with the same content (the agent
    /// resent it after a lost ack) it still counts as stored; with other
    /// content it is `conflicting`, since the stored one may have been acked
    /// and an ack promises it is kept. Contents are compared decoded and
    /// complete, not as bytes: counters travel and are stored as changes, so
    /// a resend encodes differently, and maps encode in any order. Hello
    /// messages carry no seq and are skipped: use `upsert_agent`.
    ///
    /// `messages` are complete ([`pb::AgentMessage`]) or as their stream
    /// delivered them ([`Received`]: counters as changes are stored as they
    /// came where they continue the agent's chain).
    pub fn insert_batch<M: Incoming>(
        &mut self,
        agent_id: &str,
        messages: &[M],
    ) -> Result<BatchOutcome> {
        let stored = self.insert_batch_once(agent_id, messages);
        if stored.is_err() {
            self.forget_writer_state();
        }
        stored
    }

    /// Opens a group transaction: what the writer stores until
    /// [`Store::commit_group`] becomes durable in one commit (one fsync for
    /// every agent's batch in it). Each part runs in [`Store::group_part`].
    pub fn begin_group(&mut self) -> Result<()> {
        self.conn
            .execute_batch("BEGIN IMMEDIATE")
            .context("starting a group transaction")
    }

    /// Commits the group; on failure nothing of it is stored.
    pub fn commit_group(&mut self) -> Result<()> {
        let committed = self.conn.execute_batch("COMMIT");
        if committed.is_err() {
            let _ = self.conn.execute_batch("ROLLBACK");
            self.forget_writer_state();
        }
        committed.context("committing a group of batches")
    }

    /// Runs one part of a group: a part that fails (or panics) leaves
    /// nothing behind, and the parts beside it are committed.
    pub fn group_part<R>(&mut self, part: impl FnOnce(&mut Store) -> Result<R>) -> Result<R> {
        self.conn.execute_batch("SAVEPOINT group_part")?;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| part(self)))
            .unwrap_or_else(|_| Err(anyhow!("storing a batch panicked")));
        match &result {
            Ok(_) => self.conn.execute_batch("RELEASE group_part")?,
            Err(_) => {
                self.conn
                    .execute_batch("ROLLBACK TO group_part; RELEASE group_part")?;
                // What memory holds may include the rows just undone.
                self.forget_writer_state();
            }
        }
        result
    }

    /// Hands back the pages the connection's cache holds (they are read
    /// again as needed): the collector calls it when agents have left.
    pub fn release_cache(&self) -> Result<()> {
        Ok(self.conn.execute_batch("PRAGMA shrink_memory")?)
    }

    /// Drops the writer's open rollup buckets and chains: the next batch
    /// reads or starts afresh, so nothing uncommitted is built upon.
    fn forget_writer_state(&mut self) {
        self.rollups.forget();
        self.chains.forget();
    }

    /// The agent's stream ended: the writer frees what it held for it (its
    /// next sample, on a new stream, starts a new chain).
    pub fn forget_agent(&mut self, agent_id: &str) {
        self.chains.forget_agent(agent_id);
        self.rollups.forget_agent(agent_id);
    }

    fn insert_batch_once<M: Incoming>(
        &mut self,
        agent_id: &str,
        messages: &[M],
    ) -> Result<BatchOutcome> {
        let mut out = BatchOutcome::default();
        // A savepoint: its own transaction alone, a part of the writer's
        // group transaction inside one (see `begin_group`).
        let tx = self.conn.savepoint()?;
        let mut max_seq = 0u64;
        let (mut allocator_samples, mut samples, mut events) = (0i64, 0i64, 0i64);
        {
            let mut insert = tx.prepare_cached(
                "INSERT OR IGNORE INTO messages(agent_id, seq, time_ns, kind, event_kind, body, key_seq, whole_len)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?;
            for incoming in messages {
                let msg = incoming.message();
                let Some((kind, event_kind, time_ns)) = classify(msg) else {
                    continue;
                };
                let seq = seq_to_sql(msg.seq)?;
                let stored = self.chains.encode(agent_id, seq, msg, incoming.place());
                let added = insert
                    .execute(params![
                        agent_id,
                        seq,
                        time_ns,
                        kind,
                        event_kind,
                        stored.body,
                        stored.key_seq,
                        stored.whole_len
                    ])
                    .with_context(|| format!("storing seq {} of agent {agent_id}", msg.seq))?;
                if added == 0 && stored.key_seq.is_some() {
                    self.chains.not_stored(agent_id);
                }
                if added == 0 && !same_as_stored(&tx, agent_id, seq, &incoming.complete())? {
                    out.conflicting.push(msg.seq);
                    continue;
                }
                if added > 0 {
                    out.fresh.push(msg.seq);
                    match &msg.body {
                        Some(Body::Sample(s)) => {
                            figures::insert(&tx, agent_id, seq, s)?;
                            self.rollups.fold(&tx, agent_id, s)?;
                            samples += 1;
                            allocator_samples += i64::from(!s.allocator.is_empty());
                        }
                        Some(Body::Event(_)) => events += 1,
                        _ => {}
                    }
                }
                out.stored.push(msg.seq);
                max_seq = max_seq.max(msg.seq);
            }
        }
        if !out.stored.is_empty() {
            // Cached: prepared afresh it cost each batch more than the
            // update itself (one-sample batches from 2,000 paced agents).
            tx.prepare_cached(
                "UPDATE agents SET last_seq = max(last_seq, ?2), last_seen_ns = max(last_seen_ns, ?3),
                   allocator_samples = allocator_samples + ?4, samples = samples + ?5, events = events + ?6
                 WHERE agent_id = ?1",
            )?
            .execute(params![
                    agent_id,
                    seq_to_sql(max_seq)?,
                    now_ns(),
                    allocator_samples,
                    samples,
                    events
                ],
            )?;
        }
        self.rollups.flush_agent(&tx, agent_id)?;
        tx.commit()
            .with_context(|| format!("committing a batch of agent {agent_id}"))?;
        out.stored.sort_unstable();
        out.stored.dedup();
        out.fresh.sort_unstable();
        out.fresh.dedup();
        out.conflicting.sort_unstable();
        out.conflicting.dedup();
        // A seq sent twice in one batch, the second time different.
        out.stored
            .retain(|s| out.conflicting.binary_search(s).is_err());
        Ok(out)
    }

    /// Binds `agent_id` to the token named `token` if no token holds it yet;
    /// returns the token that holds it (so `token` where the binding is
    /// new or already its own).
    pub fn bind_token(&mut self, agent_id: &str, token: &str) -> Result<String> {
        self.conn
            .execute(
                "INSERT OR IGNORE INTO agent_tokens(agent_id, token) VALUES (?1, ?2)",
                params![agent_id, token],
            )
            .with_context(|| format!("binding agent {agent_id} to its token"))?;
        Ok(self.conn.query_row(
            "SELECT token FROM agent_tokens WHERE agent_id = ?1",
            [agent_id],
            |r| r.get(0),
        )?)
    }

    /// Records a Hello as it arrives: a live agent's (see
    /// [`Store::upsert_agent`]), or a dead one's whose spool another process
    /// is delivering (`Hello.recovery`, see [`Store::record_recovered_agent`]).
    pub fn record_hello(&mut self, hello: &pb::Hello, now_ns: i64) -> Result<()> {
        match hello.recovery {
            true => self.record_recovered_agent(hello, now_ns),
            false => self.upsert_agent(hello, now_ns),
        }
    }

    /// Records the Hello of a dead agent whose spool another process is
    /// delivering (`Hello.recovery`): an agent the store already knows keeps
    /// its Hello and state; a new one is stored as "lost", since it is dead.
    pub fn record_recovered_agent(&mut self, hello: &pb::Hello, now_ns: i64) -> Result<()> {
        if hello.agent_id.is_empty() {
            bail!("a Hello without an agent_id");
        }
        let hello = pb::Hello {
            recovery: false,
            ..hello.clone()
        };
        let instance = self.instance_for(&hello)?;
        self.conn
            .execute(
                "INSERT INTO agents(agent_id, name, hello, state, first_seen_ns, last_seen_ns, instance, host, pid)
                 VALUES (?1, ?2, ?3, 'lost', ?4, ?4, ?5, ?6, ?7)
                 ON CONFLICT(agent_id) DO NOTHING",
                params![
                    hello.agent_id,
                    hello.name,
                    hello.encode_to_vec(),
                    now_ns,
                    instance,
                    hello.host,
                    hello.pid
                ],
            )
            .with_context(|| format!("storing the Hello of agent {}", hello.agent_id))?;
        Ok(())
    }

    /// The agent's state (see [`Store::set_state`]), `None` if unknown.
    pub fn state(&self, agent_id: &str) -> Result<Option<String>> {
        Ok(self
            .conn
            .query_row(
                "SELECT state FROM agents WHERE agent_id = ?1",
                [agent_id],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// The agent clock's time of its newest stored sample or event.
    pub fn last_message_time(&self, agent_id: &str) -> Result<Option<i64>> {
        Ok(self.conn.query_row(
            "SELECT max(time_ns) FROM messages WHERE agent_id = ?1 AND kind != 'goodbye'",
            [agent_id],
            |r| r.get(0),
        )?)
    }

    /// Replaces the domain of a recorded incident (more evidence arrived).
    pub fn set_incident_domain(&mut self, id: &str, domain: &str) -> Result<()> {
        self.conn.execute(
            "UPDATE incidents SET domain = ?2 WHERE id = ?1",
            params![id, domain],
        )?;
        Ok(())
    }

    /// How many of `agent_id`'s messages numbered just below `seq` (its
    /// Goodbye's) are not stored: the unsent tail of a process that ended
    /// before its acks came. Counts from the newest stored one below `seq`,
    /// so older gaps (thinned while the collector was away) are not counted.
    pub fn unsent_before(&self, agent_id: &str, seq: u64) -> Result<u64> {
        let newest: Option<i64> = self.conn.query_row(
            "SELECT max(seq) FROM messages WHERE agent_id = ?1 AND seq < ?2",
            params![agent_id, seq as i64],
            |r| r.get(0),
        )?;
        let below = seq.saturating_sub(1);
        Ok(below - newest.map_or(0, |n| (n as u64).min(below)))
    }

    /// "connected", "disconnected" (said Goodbye), "lost" (went silent),
    /// "ended" (see `incidents::record_lost`) or
    /// [`oomscope_proto::EVIDENCE_INCOMPLETE_STATE`] (said Goodbye, its last
    /// messages missing).
    pub fn set_state(&mut self, agent_id: &str, state: &str, now_ns: i64) -> Result<()> {
        let changed = self.conn.execute(
            "UPDATE agents SET state = ?2, last_seen_ns = max(last_seen_ns, ?3) WHERE agent_id = ?1",
            params![agent_id, state, now_ns],
        )?;
        if changed == 0 {
            bail!("unknown agent {agent_id:?}");
        }
        Ok(())
    }

    /// Agents the store believes connected; after a collector restart their
    /// streams are gone, so they must reconnect or be declared lost.
    pub fn connected_agents(&self) -> Result<Vec<String>> {
        let mut stmt = self
            .conn
            .prepare("SELECT agent_id FROM agents WHERE state = 'connected'")?;
        let ids = stmt
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(ids)
    }

    /// Stores an incident and gives it the next id ("inc-000001", ...) unless
    /// it has one. Returns None, storing nothing, when the same event already
    /// raised an incident of that kind.
    pub fn insert_incident(&mut self, incident: &pb::Incident) -> Result<Option<pb::Incident>> {
        let tx = self.conn.savepoint()?;
        let stored = insert_incident_tx(&tx, incident)?;
        tx.commit()?;
        Ok(stored)
    }

    /// Where the incidents stored so far end: [`Store::incidents_after`]
    /// it reads those stored since.
    pub fn incident_mark(&self) -> Result<i64> {
        Ok(self
            .conn
            .query_row("SELECT coalesce(max(n), 0) FROM incidents", [], |r| {
                r.get(0)
            })?)
    }

    /// Every incident stored after `mark`, merged or not, oldest first.
    pub fn incidents_after(&self, mark: i64) -> Result<Vec<pb::Incident>> {
        let mut stmt = self
            .conn
            .prepare_cached(&format!("{INCIDENT_SELECT} WHERE i.n > ?1 ORDER BY i.n"))?;
        let rows = stmt.query_map([mark], incident_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// True when the event at `seq` already raised an incident of `kind`.
    pub fn has_incident(&self, agent_id: &str, seq: u64, kind: &str) -> Result<bool> {
        Ok(self
            .conn
            .query_row(
                "SELECT 1 FROM incidents WHERE agent_id = ?1 AND seq = ?2 AND kind = ?3",
                params![agent_id, seq_to_sql(seq)?, kind],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }

    /// Every agent, oldest first. The counts are the writer's (see
    /// `figures.rs`): listing counts no rows.
    pub fn list_agents(&self) -> Result<Vec<pb::AgentSummary>> {
        self.agents_where(&AgentFilter::default())
    }

    /// The agents `filter` admits, oldest first.
    pub fn agents_where(&self, filter: &AgentFilter) -> Result<Vec<pb::AgentSummary>> {
        self.summaries(None, filter)
    }

    /// The agents of one instance, oldest first.
    pub fn agents_of_instance(&self, instance: &str) -> Result<Vec<pb::AgentSummary>> {
        self.summaries(Some(instance), &AgentFilter::default())
    }

    fn summaries(
        &self,
        instance: Option<&str>,
        filter: &AgentFilter,
    ) -> Result<Vec<pb::AgentSummary>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT a.agent_id, a.hello, a.state, a.first_seen_ns, a.last_seen_ns, a.last_seq,
                    a.samples, a.events, a.instance
             FROM agents a WHERE (?1 IS NULL OR a.instance = ?1) AND a.last_seen_ns >= ?2
               AND (?3 = '' OR a.host = ?3)
             ORDER BY a.first_seen_ns, a.agent_id",
        )?;
        let rows = stmt.query_map(params![instance, filter.since_ns, filter.host], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                pb::AgentSummary {
                    hello: None,
                    state: r.get(2)?,
                    first_seen_ns: r.get(3)?,
                    last_seen_ns: r.get(4)?,
                    last_seq: r.get::<_, i64>(5)? as u64,
                    samples: r.get::<_, i64>(6)? as u64,
                    events: r.get::<_, i64>(7)? as u64,
                    instance: r.get(8)?,
                    goodbye: None,
                    context: None,
                },
            ))
        })?;
        let mut agents = Vec::new();
        for row in rows {
            let (agent_id, hello, mut summary) = row?;
            summary.hello = Some(decode_hello(&agent_id, &hello)?);
            if summary.state == "disconnected"
                || summary.state == oomscope_proto::EVIDENCE_INCOMPLETE_STATE
            {
                // An index seek (messages_by_time) per agent that said one.
                summary.goodbye = self.latest_goodbye(&agent_id)?.map(|(_, g)| g);
            }
            agents.push(summary);
        }
        Ok(agents)
    }

    /// An agent id as given, or else the newest agent with that name.
    pub fn resolve_agent(&self, id_or_name: &str) -> Result<Option<String>> {
        let by_id = self
            .conn
            .query_row(
                "SELECT agent_id FROM agents WHERE agent_id = ?1",
                [id_or_name],
                |r| r.get(0),
            )
            .optional()?;
        if by_id.is_some() {
            return Ok(by_id);
        }
        Ok(self
            .conn
            .query_row(
                "SELECT agent_id FROM agents WHERE name = ?1
                 ORDER BY first_seen_ns DESC, last_seen_ns DESC LIMIT 1",
                [id_or_name],
                |r| r.get(0),
            )
            .optional()?)
    }

    pub fn hello(&self, agent_id: &str) -> Result<Option<pb::Hello>> {
        let blob: Option<Vec<u8>> = self
            .conn
            .query_row(
                "SELECT hello FROM agents WHERE agent_id = ?1",
                [agent_id],
                |r| r.get(0),
            )
            .optional()?;
        blob.map(|b| decode_hello(agent_id, &b)).transpose()
    }

    /// All incidents (or one agent's), oldest first.
    pub fn incidents(&self, agent_id: Option<&str>) -> Result<Vec<pb::Incident>> {
        self.incidents_where(agent_id, &IncidentFilter::default())
    }

    /// The incidents (of one agent, or of any) that `filter` admits, oldest first.
    pub fn incidents_where(
        &self,
        agent_id: Option<&str>,
        filter: &IncidentFilter,
    ) -> Result<Vec<pb::Incident>> {
        let mut stmt = self.conn.prepare(&format!(
            "{INCIDENT_SELECT} WHERE (?1 IS NULL OR i.agent_id = ?1) AND i.merged_into IS NULL
               AND i.time_ns >= ?2 AND (?3 = '' OR i.domain = ?3) AND (?4 = '' OR i.kind = ?4)
               AND (?5 = '' OR i.agent_id IN (SELECT agent_id FROM agents WHERE host = ?5))
             ORDER BY i.n"
        ))?;
        let rows = stmt.query_map(
            params![
                agent_id,
                filter.since_ns,
                filter.domain,
                filter.cause,
                filter.host
            ],
            incident_row,
        )?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The incident `id`, or the one it was merged into (a correlated
    /// incident answers for all of its parts).
    pub fn incident(&self, id: &str) -> Result<Option<pb::Incident>> {
        let Some(leader) = self.leader_of(id)? else {
            return Ok(None);
        };
        Ok(self
            .conn
            .query_row(
                &format!("{INCIDENT_SELECT} WHERE i.id = ?1"),
                [leader],
                incident_row,
            )
            .optional()?)
    }

    /// The most recently recorded incident (of one agent, or of any).
    pub fn latest_incident(&self, agent_id: Option<&str>) -> Result<Option<pb::Incident>> {
        Ok(self
            .conn
            .query_row(
                &format!(
                    "{INCIDENT_SELECT} WHERE (?1 IS NULL OR i.agent_id = ?1) AND i.merged_into IS NULL
                     ORDER BY i.n DESC LIMIT 1"
                ),
                [agent_id],
                incident_row,
            )
            .optional()?)
    }

    /// Rows in `messages` for one agent, duplicates impossible by construction;
    /// tests use it to check that a resend was stored once.
    pub fn message_count(&self, agent_id: &str) -> Result<u64> {
        let n: i64 = self.conn.query_row(
            "SELECT count(*) FROM messages WHERE agent_id = ?1",
            [agent_id],
            |r| r.get(0),
        )?;
        Ok(n as u64)
    }
}

/// What the fleet detectors need: one service's (agent name's) starts,
/// deaths and requests over a time range.
impl Store {
    /// When each instance with agents named `name` started (its first
    /// agent's Hello, collector clock), for the instances started from
    /// `since_ns` on.
    pub fn starts_of(&self, name: &str, since_ns: i64) -> Result<Vec<crate::fleet::Start>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT instance, MIN(first_seen_ns) AS started FROM agents WHERE name = ?1
             GROUP BY instance HAVING started >= ?2 ORDER BY started",
        )?;
        let rows = stmt.query_map(params![name, since_ns], |r| {
            Ok(crate::fleet::Start {
                instance: r.get(0)?,
                time_ns: r.get(1)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The failures of instances named `name` (a death by signal, of the
    /// child or another member, a kernel kill, a failed exit with OOM text,
    /// a failed start, a lost stream), from `since_ns` on: one per instance, its first. The
    /// deaths of several processes of one start are one failure; a crash
    /// loop needs starts.
    pub fn deaths_of(&self, name: &str, since_ns: i64) -> Result<Vec<crate::fleet::Death>> {
        use oomscope_proto::IncidentKind as K;
        let deaths = [
            K::Signal,
            K::MemberDied,
            K::MemberFailed,
            K::KernelOomKill,
            K::ExitOomText,
            K::FailedStart,
            K::AgentLost,
        ];
        let deaths = deaths.map(|k| format!("'{k}'")).join(", ");
        // SQLite takes the bare columns from the row with the MIN.
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT i.agent_id, MIN(i.time_ns) AS t, i.kind FROM incidents i JOIN agents a ON a.agent_id = i.agent_id
             WHERE a.name = ?1 AND i.time_ns >= ?2
               AND i.kind IN ({deaths})
             GROUP BY a.instance ORDER BY t",
        ))?;
        let rows = stmt.query_map(params![name, since_ns], |r| {
            Ok(crate::fleet::Death {
                agent_id: r.get(0)?,
                time_ns: r.get(1)?,
                kind: r.get(2)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The times of request starts (`RequestBoundary` with `start`, as an
    /// event or in a batch of request readings) sent by any agent named
    /// `name` within [from_ns, to_ns) (a batch by its sample's time).
    pub fn request_starts_of(&self, name: &str, from_ns: i64, to_ns: i64) -> Result<Vec<i64>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT m.agent_id, m.seq, m.body FROM messages m JOIN agents a ON a.agent_id = m.agent_id
             WHERE a.name = ?1 AND ((m.kind = 'event' AND m.event_kind = 'request')
                                   OR (m.kind = 'sample' AND m.event_kind = 'requests'))
               AND m.time_ns >= ?2 AND m.time_ns < ?3",
        )?;
        let rows = stmt.query_map(params![name, from_ns, to_ns], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, Vec<u8>>(2)?,
            ))
        })?;
        let mut times = Vec::new();
        for row in rows {
            let (agent_id, seq, body) = row?;
            match decode_message(&agent_id, seq, &body)?.body {
                Some(Body::Event(e)) => {
                    if matches!(&e.kind, Some(EventKind::Request(r)) if r.start) {
                        times.push(e.time_ns);
                    }
                }
                Some(Body::Sample(s)) => {
                    let readings = s.requests.iter().flat_map(|b| &b.readings);
                    times.extend(
                        readings
                            .filter(|r| r.boundary.as_ref().is_some_and(|b| b.start))
                            .map(|r| r.time_ns),
                    );
                }
                _ => {}
            }
        }
        times.sort_unstable();
        Ok(times)
    }

    /// Whether an incident of `kind` was recorded for any agent named `name` at or after `since_ns`.
    pub fn has_incident_of_name(&self, name: &str, kind: &str, since_ns: i64) -> Result<bool> {
        Ok(self
            .conn
            .query_row(
                "SELECT 1 FROM incidents i JOIN agents a ON a.agent_id = i.agent_id
                 WHERE a.name = ?1 AND i.kind = ?2 AND i.time_ns >= ?3 LIMIT 1",
                params![name, kind, since_ns],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }
}

const INCIDENT_SELECT: &str = "
    SELECT i.id, i.agent_id, coalesce(a.name, ''), i.kind, i.time_ns, i.domain, i.summary, i.seq
    FROM incidents i LEFT JOIN agents a ON a.agent_id = i.agent_id";

fn incident_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<pb::Incident> {
    Ok(pb::Incident {
        id: r.get(0)?,
        agent_id: r.get(1)?,
        agent_name: r.get(2)?,
        kind: r.get(3)?,
        time_ns: r.get(4)?,
        domain: r.get(5)?,
        summary: r.get(6)?,
        seq: r.get::<_, i64>(7)? as u64,
        parts: Vec::new(),
    })
}

fn insert_incident_tx(tx: &Connection, inc: &pb::Incident) -> Result<Option<pb::Incident>> {
    // A placeholder id first: the real one derives from the row number, which
    // SQLite assigns on insert, so ids stay dense and sortable.
    let placeholder = format!("pending-{}", now_ns());
    let added = tx.execute(
        "INSERT OR IGNORE INTO incidents(id, agent_id, kind, time_ns, domain, summary, seq)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            if inc.id.is_empty() {
                &placeholder
            } else {
                &inc.id
            },
            inc.agent_id,
            inc.kind,
            inc.time_ns,
            inc.domain,
            inc.summary,
            seq_to_sql(inc.seq)?
        ],
    )?;
    if added == 0 {
        return Ok(None);
    }
    let n = tx.last_insert_rowid();
    let mut stored = inc.clone();
    if inc.id.is_empty() {
        stored.id = format!("inc-{n:06}");
        tx.execute(
            "UPDATE incidents SET id = ?1 WHERE n = ?2",
            params![stored.id, n],
        )?;
    }
    if stored.agent_name.is_empty() {
        stored.agent_name = tx
            .query_row(
                "SELECT name FROM agents WHERE agent_id = ?1",
                [&inc.agent_id],
                |r| r.get(0),
            )
            .optional()?
            .unwrap_or_default();
    }
    Ok(Some(stored))
}

/// (kind, event_kind, time_ns) of a storable message; None for Hello or an empty body.
pub(super) fn classify(
    msg: &pb::AgentMessage,
) -> Option<(&'static str, Option<&'static str>, i64)> {
    match msg.body.as_ref()? {
        // A sample carrying request readings is marked, so request starts
        // are found without decoding every sample (`request_starts_of`).
        Body::Sample(s) => Some((
            "sample",
            s.requests.is_some().then_some(REQUESTS_SAMPLE_KIND),
            s.time_ns,
        )),
        Body::Event(e) => Some(("event", Some(event_kind_name(e)), e.time_ns)),
        // Kept for the record (the exit code and reason); no timeline shows it.
        Body::Goodbye(_) => Some(("goodbye", None, now_ns())),
        Body::Hello(_) => None,
    }
}

/// `event_kind` of a stored sample that carries request readings
/// (`Sample.requests`); other samples have none.
pub const REQUESTS_SAMPLE_KIND: &str = "requests";

/// The Event oneof's field name, as the proto spells it.
pub fn event_kind_name(event: &pb::Event) -> &'static str {
    match &event.kind {
        Some(EventKind::Phase(_)) => "phase",
        Some(EventKind::Gc(_)) => "gc",
        Some(EventKind::CacheRelease(_)) => "cache_release",
        Some(EventKind::Oom(_)) => "oom", // vocab: the oneof's field name
        Some(EventKind::ProcessList(_)) => "process_list",
        Some(EventKind::Snapshot(_)) => "snapshot",
        Some(EventKind::HeapCensus(_)) => "heap_census",
        Some(EventKind::ChildStart(_)) => "child_start",
        Some(EventKind::ChildExit(_)) => "child_exit",
        Some(EventKind::Request(_)) => "request",
        Some(EventKind::KernelOomKill(_)) => "kernel_oom_kill", // vocab: the oneof's field name
        Some(EventKind::StopForwarded(_)) => "stop_forwarded",
        Some(EventKind::KernelAllocFailure(_)) => "kernel_alloc_failure",
        None => "",
    }
}

/// The largest seq the store holds: SQLite integers are i64. Ingest rejects
/// a message above it on its own (see `ingest::ingest`).
pub const MAX_SEQ: u64 = i64::MAX as u64;

pub(super) fn seq_to_sql(seq: u64) -> Result<i64> {
    i64::try_from(seq)
        .map_err(|_| anyhow!("seq {seq} is beyond what the store can hold ({MAX_SEQ})"))
}

/// Whether `msg` equals what is stored at (`agent_id`, `seq`), both complete
/// (the stored one rebuilt from its chain). Read only for a resent seq.
fn same_as_stored(
    conn: &Connection,
    agent_id: &str,
    seq: i64,
    msg: &pb::AgentMessage,
) -> Result<bool> {
    let (body, key_seq): (Vec<u8>, Option<i64>) = conn
        .prepare_cached("SELECT body, key_seq FROM messages WHERE agent_id = ?1 AND seq = ?2")?
        .query_row(params![agent_id, seq], |r| Ok((r.get(0)?, r.get(1)?)))
        .with_context(|| format!("reading stored seq {seq} of agent {agent_id}"))?;
    let stored = decode_message(agent_id, seq as u64, &body)?;
    let stored = counters::Rebuilder::default().complete(conn, agent_id, seq, key_seq, stored)?;
    Ok(stored == *msg)
}

pub(super) fn decode_message(agent_id: &str, seq: u64, body: &[u8]) -> Result<pb::AgentMessage> {
    pb::AgentMessage::decode(body)
        .with_context(|| format!("stored message of agent {agent_id} seq {seq} does not decode"))
}

pub(super) fn decode_hello(agent_id: &str, blob: &[u8]) -> Result<pb::Hello> {
    pb::Hello::decode(blob)
        .with_context(|| format!("stored Hello of agent {agent_id} (seq 0) does not decode"))
}

pub use oomscope_proto::now_ns;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reader_sees_commits_and_refuses_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let mut writer = Store::open(&path).unwrap();
        let mut reader = Store::open_reader(&path).unwrap();
        assert!(reader.list_agents().unwrap().is_empty());
        let hello = pb::Hello {
            agent_id: "a1".into(),
            name: "svc".into(),
            ..Default::default()
        };
        writer.upsert_agent(&hello, 1).unwrap();
        let agents = reader.list_agents().unwrap();
        assert_eq!(agents.len(), 1, "a commit is visible to the reader");
        assert_eq!(agents[0].state, "connected");
        let err = reader.upsert_agent(&hello, 2).unwrap_err();
        assert!(format!("{err:#}").contains("readonly"), "{err:#}");
        // A read in progress does not hold the writer back (WAL).
        let mut stmt = reader.conn.prepare("SELECT agent_id FROM agents").unwrap();
        let mut rows = stmt.query([]).unwrap();
        assert!(rows.next().unwrap().is_some());
        writer.set_state("a1", "lost", 3).unwrap();
    }

    #[test]
    fn a_version_2_store_is_migrated_with_its_samples() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v2.db");
        let hello = pb::Hello {
            agent_id: "a1".into(),
            name: "svc".into(),
            ..Default::default()
        };
        let sample = |seq: u64| pb::AgentMessage {
            seq,
            body: Some(Body::Sample(pb::Sample {
                time_ns: seq as i64 * 1_000,
                allocator: vec![pb::AllocatorStats {
                    allocated_bytes: seq * 7,
                    raw: [("allocated_bytes.all.current".to_string(), seq as i64 * 7)].into(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
        };
        {
            // The schema as version 2 left it, with its rows written as it wrote them.
            let mut conn = Connection::open(&path).unwrap();
            let tx = conn.transaction().unwrap();
            tx.execute_batch(SCHEMA_V1).unwrap();
            instances::migrate_v2(&tx).unwrap();
            tx.pragma_update(None, "user_version", 2).unwrap();
            tx.execute(
                "INSERT INTO agents(agent_id, name, hello, state, first_seen_ns, last_seen_ns, instance)
                 VALUES ('a1', 'svc', ?1, 'lost', 1, 1, 'a1')",
                [hello.encode_to_vec()],
            )
            .unwrap();
            for seq in 1..=5u64 {
                let msg = sample(seq);
                tx.execute(
                    "INSERT INTO messages VALUES ('a1', ?1, ?2, 'sample', NULL, ?3)",
                    params![seq as i64, seq as i64 * 1_000, msg.encode_to_vec()],
                )
                .unwrap();
            }
            tx.commit().unwrap();
        }
        let mut store = Store::open(&path).unwrap();
        let version: i64 = store
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        assert_eq!(
            store.list_agents().unwrap()[0].samples,
            5,
            "counted at migration"
        );
        let h = store.history("a1", i64::MIN, i64::MAX).unwrap();
        let allocated: Vec<u64> = h
            .samples
            .iter()
            .map(|s| s.sample.as_ref().unwrap().allocator[0].allocated_bytes)
            .collect();
        assert_eq!(
            allocated,
            [7, 14, 21, 28, 35],
            "every sample has its record"
        );
        // Whole messages still come back where they fit.
        let t = store.timeline("a1", 0, 0, 0).unwrap();
        assert_eq!(t.samples.len(), 5);
        assert_eq!(
            t.samples[4].sample.as_ref().unwrap().allocator[0].raw.len(),
            1
        );
        // The rollups are filled from the stored samples.
        let bucket = |store: &Store| -> (i64, u64) {
            let (n, high): (i64, Vec<u8>) = store
                .conn
                .query_row(
                    "SELECT samples, high FROM rollups WHERE agent_id = 'a1' AND width_s = 10",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .unwrap();
            let high = pb::Sample::decode(high.as_slice()).unwrap();
            (n, high.allocator[0].allocated_bytes)
        };
        assert_eq!(bucket(&store), (5, 35));
        // And the writer goes on where the old one stopped.
        store.insert_batch("a1", &[sample(5), sample(6)]).unwrap();
        assert_eq!(
            store.list_agents().unwrap()[0].samples,
            6,
            "the resent 5 counts once"
        );
        assert_eq!(bucket(&store), (6, 42), "in the rollups too");
        assert_eq!(
            store
                .history("a1", i64::MIN, i64::MAX)
                .unwrap()
                .samples
                .len(),
            6
        );
    }

    /// `store`, told of agent "a1" (named "svc").
    fn knowing_a1(mut store: Store) -> Store {
        let hello = pb::Hello {
            agent_id: "a1".into(),
            name: "svc".into(),
            ..Default::default()
        };
        store.upsert_agent(&hello, 1).unwrap();
        store
    }

    /// A store at `path` that knows agent "a1" (named "svc").
    pub(super) fn store_at(path: &Path) -> Store {
        knowing_a1(Store::open(path).unwrap())
    }

    /// An in-memory store that knows agent "a1" (named "svc").
    pub(super) fn store_with_a1() -> Store {
        knowing_a1(Store::open_in_memory().unwrap())
    }

    #[test]
    fn corrupt_blob_names_agent_and_seq() {
        let store = store_with_a1();
        store
            .conn
            .execute(
                "INSERT INTO messages(agent_id, seq, time_ns, kind, event_kind, body) VALUES ('a1', 7, 5, 'sample', NULL, x'12ff')",
                [],
            )
            .unwrap();
        let err = store.timeline("a1", 0, 0, 0).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("agent a1 seq 7"), "{text}");
        store
            .conn
            .execute("INSERT INTO figures VALUES ('a1', 5, 7, x'12ff')", [])
            .unwrap();
        let err = store.history("a1", 0, 10).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("figures of agent a1 seq 7"), "{text}");
    }
}
