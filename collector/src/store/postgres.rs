//! The PostgreSQL store (`--db postgres://...`): one database shared by
//! several collectors, so any collector takes any agent and answers for the
//! whole fleet.
//!
//! - `message_keys` holds one row per stored `(agent, seq)`, its primary key
//!   the one place that makes a duplicate impossible across collectors
//!   (a partitioned table's unique keys must include its partition key, so
//!   the key cannot live on `messages` itself).
//! - `messages` holds each message complete (prost bytes, as the agent's
//!   stream decoded it), partitioned by day of `time_ns`: retention drops a
//!   day's partition instead of deleting its rows. Days far from now go to
//!   the default partition (see [`MAX_PARTITION_DAYS_BACK`]).
//! - A batch is one transaction of multi-row inserts (bound arrays through
//!   `unnest`); it returns once committed, and PostgreSQL's commit is
//!   durable (`synchronous_commit` on, its default), so an ack is a promise.
//! - Migrations run at start-up in one transaction under an advisory lock:
//!   collectors starting together on an empty database do not race.
//!
//! The interface is synchronous ([`Backend`]), as the embedded store's is;
//! the store runs its async client on a runtime of its own and waits for it,
//! so callers call it as they call SQLite: off the async workers.

use std::collections::HashSet;
use std::future::Future;
use std::str::FromStr;

use anyhow::{anyhow, bail, Context, Result};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use parking_lot::Mutex;
use prost::Message;
use tokio_postgres::NoTls;

use super::pg_writer::{Batch, GroupWriter};
use super::{
    decode_hello, decode_message, seq_to_sql, AgentFilter, Backend, BatchOutcome, Correlation,
    IncidentFilter, Store,
};
use crate::pb;
use crate::pb::agent_message::Body;

/// Connections in one collector's pool: each agent stream's batch holds one
/// for its transaction, so this bounds the batches in flight to the database
/// at once; a dozen keeps a small PostgreSQL (max_connections 100) able to
/// serve several collectors.
pub const DEFAULT_PG_POOL: usize = 12;

/// Bump when the schema changes, and add a step to `migrate`.
const PG_SCHEMA_VERSION: i32 = 2;

/// The advisory lock key migrations run under ("oomscope" in ASCII).
pub(super) const MIGRATION_LOCK: i64 = 0x6f6f_6d73_636f_7065;
/// The advisory lock key partition creation runs under: two collectors
/// creating the same day's partition would otherwise collide in the catalog.
const PARTITION_LOCK: i64 = MIGRATION_LOCK + 1;

const NS_PER_DAY: i64 = 86_400 * 1_000_000_000;

/// Days before today that get their own partition: a year covers any
/// retention window people set; rows older than that (a test's 1970 clock,
/// a skewed agent) go to the default partition, which retention prunes by rows.
pub const MAX_PARTITION_DAYS_BACK: i64 = 366;
/// Days after today that get their own partition (agents' clocks run ahead).
const MAX_PARTITION_DAYS_AHEAD: i64 = 1;

const SCHEMA_V1: &str = "
CREATE TABLE agents(
    agent_id      text PRIMARY KEY,
    name          text NOT NULL,
    hello         bytea NOT NULL,
    state         text NOT NULL,
    instance      text NOT NULL,
    first_seen_ns bigint NOT NULL,
    last_seen_ns  bigint NOT NULL,
    -- When its newest Hello came (collector clock): a lost check on one
    -- collector sees that the agent came back on another.
    last_hello_ns bigint NOT NULL,
    last_seq      bigint NOT NULL DEFAULT 0,
    samples       bigint NOT NULL DEFAULT 0,
    events        bigint NOT NULL DEFAULT 0
);
CREATE INDEX agents_by_name ON agents(name, first_seen_ns);
CREATE TABLE agent_tokens(
    agent_id text PRIMARY KEY,
    token    text NOT NULL           -- the token's name, never its secret
);
CREATE TABLE message_keys(
    agent_id text NOT NULL,
    seq      bigint NOT NULL,
    time_ns  bigint NOT NULL,
    PRIMARY KEY(agent_id, seq)
);
CREATE INDEX message_keys_by_time ON message_keys(time_ns);
CREATE TABLE messages(
    agent_id   text NOT NULL,
    seq        bigint NOT NULL,
    time_ns    bigint NOT NULL,
    kind       text NOT NULL,        -- 'sample' | 'event' | 'goodbye'
    event_kind text,
    body       bytea NOT NULL        -- the whole AgentMessage, complete
) PARTITION BY RANGE (time_ns);
CREATE INDEX messages_by_seq ON messages(agent_id, seq);
CREATE INDEX messages_by_time ON messages(agent_id, kind, time_ns);
CREATE TABLE messages_default PARTITION OF messages DEFAULT;
CREATE SEQUENCE incident_numbers;
CREATE TABLE incidents(
    n          bigint PRIMARY KEY,
    id         text NOT NULL UNIQUE,
    agent_id   text NOT NULL,
    agent_name text NOT NULL,
    kind       text NOT NULL,
    time_ns    bigint NOT NULL,
    domain     text NOT NULL,
    summary    text NOT NULL,
    seq        bigint NOT NULL
);
-- An event raises its incident once, whichever collectors see it.
CREATE UNIQUE INDEX incidents_by_source ON incidents(agent_id, seq, kind) WHERE seq > 0;
CREATE INDEX incidents_by_time ON incidents(time_ns);
";

/// Schema v2, as the embedded store's instances (`instances.rs`): the host
/// and pid that find a parent's instance, allocator samples per agent (which
/// member speaks for an instance), and merged incidents (the parts of one
/// failure, correlated in the store: see `pg_views.rs`); and statements of
/// dropped messages.
const SCHEMA_V2: &str = "
ALTER TABLE agents ADD COLUMN host text NOT NULL DEFAULT '';
ALTER TABLE agents ADD COLUMN pid bigint NOT NULL DEFAULT 0;
ALTER TABLE agents ADD COLUMN allocator_samples bigint NOT NULL DEFAULT 0;
CREATE INDEX agents_by_instance ON agents(instance, first_seen_ns);
CREATE INDEX agents_by_host_pid ON agents(host, pid);
ALTER TABLE incidents ADD COLUMN merged_into text;
CREATE INDEX incidents_by_leader ON incidents(merged_into);
-- As the embedded store's (schema v7, `marks.rs`): each sample's statement
-- of messages its agent dropped unsent, so that a timeline read from a
-- window of the history still folds the statements of what it thinned.
-- (Samples stored under v1 keep theirs in their bodies only.)
CREATE TABLE dropped_marks(
    agent_id  text NOT NULL,
    time_ns   bigint NOT NULL,
    seq       bigint NOT NULL,
    statement bytea NOT NULL,      -- the DroppedBefore the sample carried
    PRIMARY KEY(agent_id, time_ns, seq)
);
";

/// Whether `--db` names a PostgreSQL database rather than a SQLite file.
pub fn is_postgres_url(db: &str) -> bool {
    db.starts_with("postgres://") || db.starts_with("postgresql://")
}

/// A PostgreSQL database as the store of record.
pub struct PgStore {
    pub(super) pool: Pool,
    runtime: OwnRuntime,
    /// Day partitions known to exist (or known to be impossible: their days
    /// already have rows in the default partition).
    partitions: Mutex<HashSet<i64>>,
    /// Group commit of the agents' batches.
    writer: GroupWriter,
}

/// The store's own runtime, shut down without waiting when the store goes
/// (dropping a runtime from async code would panic).
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl PgStore {
    /// Connects to `url` (`postgres://user@host:port/db`; a Unix socket's
    /// directory as a percent-encoded host) and brings the schema up to date.
    pub fn connect(url: &str, pool_size: usize) -> Result<PgStore> {
        let config = tokio_postgres::Config::from_str(url)
            .with_context(|| format!("{}: not a PostgreSQL URL", redact(url)))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("oomscope-pg")
            .enable_all()
            .build()
            .context("starting the PostgreSQL client's runtime")?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .build()
            .context("building the PostgreSQL pool")?;
        let writer = GroupWriter::start(pool.clone(), runtime.handle());
        let store = PgStore {
            pool,
            runtime: OwnRuntime(Some(runtime)),
            partitions: Mutex::new(HashSet::new()),
            writer,
        };
        let pool = store.pool.clone();
        store
            .run(migrate(pool))
            .with_context(|| format!("preparing the PostgreSQL store {}", redact(url)))?;
        Ok(store)
    }

    /// Runs `work` on the store's runtime and waits for it: callable from a
    /// plain thread or a blocking task alike.
    pub(super) fn run<R: Send + 'static>(
        &self,
        work: impl Future<Output = Result<R>> + Send + 'static,
    ) -> Result<R> {
        let rt = self
            .runtime
            .0
            .as_ref()
            .expect("the runtime lives as long as the store");
        futures::executor::block_on(rt.spawn(work))
            .map_err(|e| anyhow!("a PostgreSQL task failed: {e}"))?
    }

    /// The one text column `sql` selects for the row of `key` (its `$1`).
    fn text_by_key(&self, sql: &'static str, key: &str) -> Result<Option<String>> {
        let (pool, key) = (self.pool.clone(), key.to_string());
        self.run(async move {
            Ok(pool
                .get()
                .await?
                .query_opt(sql, &[&key])
                .await?
                .map(|r| r.get(0)))
        })
    }

    /// Creates the day partitions `time_ns` values fall in, once each.
    fn ensure_partitions(&self, times: &[i64]) -> Result<()> {
        let today = super::now_ns().div_euclid(NS_PER_DAY);
        let wanted: Vec<i64> = {
            let known = self.partitions.lock();
            let mut days: Vec<i64> = times
                .iter()
                .map(|t| t.div_euclid(NS_PER_DAY))
                .filter(|d| {
                    (today - MAX_PARTITION_DAYS_BACK..=today + MAX_PARTITION_DAYS_AHEAD).contains(d)
                })
                .filter(|d| !known.contains(d))
                .collect();
            days.sort_unstable();
            days.dedup();
            days
        };
        if wanted.is_empty() {
            return Ok(());
        }
        let pool = self.pool.clone();
        let days = wanted.clone();
        self.run(async move {
            let mut client = pool.get().await?;
            for day in days {
                let tx = client.transaction().await?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PARTITION_LOCK])
                    .await?;
                let created = tx
                    .batch_execute(&format!(
                        "CREATE TABLE IF NOT EXISTS messages_d{day} PARTITION OF messages
                         FOR VALUES FROM ({}) TO ({})",
                        day * NS_PER_DAY,
                        (day + 1) * NS_PER_DAY
                    ))
                    .await;
                match created {
                    Ok(()) => tx.commit().await?,
                    // The default partition already holds rows of that day:
                    // they and the day's next rows stay there.
                    Err(e) => tracing::warn!(
                        day,
                        "no partition for this day ({e}); its rows go to the default partition"
                    ),
                }
            }
            Ok(())
        })?;
        self.partitions.lock().extend(wanted);
        Ok(())
    }

    /// The day partitions that exist now (tests and retention).
    /// (group transactions committed, batches in them) so far.
    pub fn group_counts(&self) -> (u64, u64) {
        self.writer.counts()
    }

    pub fn partition_days(&self) -> Result<Vec<i64>> {
        let pool = self.pool.clone();
        self.run(async move { partition_days(&**pool.get().await?).await })
    }
}

async fn migrate(pool: Pool) -> Result<()> {
    let mut client = pool.get().await.context("connecting")?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS oomscope_schema(version integer NOT NULL)")
        .await?;
    let version: i32 = tx
        .query_opt("SELECT version FROM oomscope_schema", &[])
        .await?
        .map_or(0, |r| r.get(0));
    if version > PG_SCHEMA_VERSION {
        bail!(
            "the database has oomscope schema version {version}, newer than this oomscope \
             understands ({PG_SCHEMA_VERSION}); use a newer oomscope"
        );
    }
    if version < 1 {
        tx.batch_execute(SCHEMA_V1).await?;
        tx.execute("INSERT INTO oomscope_schema(version) VALUES (1)", &[])
            .await?;
    }
    if version < 2 {
        tx.batch_execute(SCHEMA_V2).await?;
        tx.execute("UPDATE oomscope_schema SET version = 2", &[])
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

async fn partition_days(client: &impl tokio_postgres::GenericClient) -> Result<Vec<i64>> {
    let rows = client
        .query(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'messages'::regclass",
            &[],
        )
        .await?;
    let mut days: Vec<i64> = rows
        .iter()
        .filter_map(|r| {
            r.get::<_, String>(0)
                .strip_prefix("messages_d")?
                .parse()
                .ok()
        })
        .collect();
    days.sort_unstable();
    Ok(days)
}

/// A URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

pub(super) const INCIDENT_COLUMNS: &str =
    "id, agent_id, agent_name, kind, time_ns, domain, summary, seq";

pub(super) fn incident_from(r: &tokio_postgres::Row) -> pb::Incident {
    pb::Incident {
        id: r.get(0),
        agent_id: r.get(1),
        agent_name: r.get(2),
        kind: r.get(3),
        time_ns: r.get(4),
        domain: r.get(5),
        summary: r.get(6),
        seq: r.get::<_, i64>(7) as u64,
        parts: Vec::new(),
    }
}

/// Inserts `inc`, numbered by the database (collectors share one series of
/// ids); None when its event raised one already.
pub(super) async fn insert_incident(
    client: &impl tokio_postgres::GenericClient,
    inc: &pb::Incident,
    seq: i64,
) -> Result<Option<pb::Incident>> {
    let row = client
        .query_opt(
            &format!(
                "WITH n AS (SELECT nextval('incident_numbers') AS n)
                 INSERT INTO incidents(n, id, agent_id, agent_name, kind, time_ns, domain, summary, seq)
                 SELECT n.n, 'inc-' || lpad(n.n::text, 6, '0'), $1, $2, $3, $4, $5, $6, $7 FROM n
                 ON CONFLICT (agent_id, seq, kind) WHERE seq > 0 DO NOTHING
                 RETURNING {INCIDENT_COLUMNS}"
            ),
            &[
                &inc.agent_id,
                &inc.agent_name,
                &inc.kind,
                &inc.time_ns,
                &inc.domain,
                &inc.summary,
                &seq,
            ],
        )
        .await
        .with_context(|| format!("storing a {} incident of agent {}", inc.kind, inc.agent_id))?;
    Ok(row.as_ref().map(incident_from))
}

impl Backend for PgStore {
    fn bind_token(&self, agent_id: &str, token: &str) -> Result<String> {
        let (pool, agent_id, token) = (self.pool.clone(), agent_id.to_string(), token.to_string());
        self.run(async move {
            let client = pool.get().await?;
            client
                .execute(
                    "INSERT INTO agent_tokens(agent_id, token) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    &[&agent_id, &token],
                )
                .await
                .with_context(|| format!("binding agent {agent_id} to its token"))?;
            let row = client
                .query_one("SELECT token FROM agent_tokens WHERE agent_id = $1", &[&agent_id])
                .await?;
            Ok(row.get(0))
        })
    }

    fn record_hello(&self, hello: &pb::Hello, now_ns: i64) -> Result<()> {
        if hello.agent_id.is_empty() {
            bail!("a Hello without an agent_id");
        }
        let recovery = hello.recovery;
        let hello = pb::Hello {
            recovery: false,
            ..hello.clone()
        };
        let pool = self.pool.clone();
        self.run(async move {
            let client = pool.get().await?;
            let blob = hello.encode_to_vec();
            // The instance as the embedded store finds it (`instances.rs`):
            // the one the Hello names, else the parent process's agent's,
            // else a live agent's of the same name on the same host, else
            // its own id. An agent already known keeps its instance (the
            // conflict below leaves it).
            let instance: String = client
                .query_one(
                    "SELECT COALESCE(
                       NULLIF($1, ''),
                       (SELECT instance FROM agents WHERE $4::bigint <> 0 AND host = $3 AND pid = $4
                          AND state = 'connected' ORDER BY first_seen_ns DESC LIMIT 1),
                       (SELECT instance FROM agents WHERE host = $3 AND name = $5
                          AND state = 'connected' ORDER BY first_seen_ns LIMIT 1),
                       $2)",
                    &[
                        &hello.instance,
                        &hello.agent_id,
                        &hello.host,
                        &i64::from(hello.parent_pid),
                        &hello.name,
                    ],
                )
                .await?
                .get(0);
            // A recovered spool's Hello is a dead agent's: it never replaces
            // a live record, and a new one is stored as lost.
            let sql = match recovery {
                false => {
                    "INSERT INTO agents(agent_id, name, hello, state, instance, first_seen_ns, last_seen_ns, last_hello_ns, host, pid)
                     VALUES ($1, $2, $3, 'connected', $4, $5, $5, $5, $6, $7)
                     ON CONFLICT(agent_id) DO UPDATE SET
                       name = excluded.name, hello = excluded.hello, state = 'connected',
                       last_seen_ns = GREATEST(agents.last_seen_ns, excluded.last_seen_ns),
                       last_hello_ns = excluded.last_hello_ns"
                }
                true => {
                    "INSERT INTO agents(agent_id, name, hello, state, instance, first_seen_ns, last_seen_ns, last_hello_ns, host, pid)
                     VALUES ($1, $2, $3, 'lost', $4, $5, $5, $5, $6, $7) ON CONFLICT(agent_id) DO NOTHING"
                }
            };
            client
                .execute(
                    sql,
                    &[
                        &hello.agent_id,
                        &hello.name,
                        &blob,
                        &instance,
                        &now_ns,
                        &hello.host,
                        &i64::from(hello.pid),
                    ],
                )
                .await
                .with_context(|| format!("storing the Hello of agent {}", hello.agent_id))?;
            Ok(())
        })
    }

    /// Into the next group transaction (see `pg_writer.rs`).
    fn insert_batch(&self, agent_id: &str, messages: &[pb::AgentMessage]) -> Result<BatchOutcome> {
        let batch = Batch::of(agent_id, messages)?;
        if batch.is_empty() {
            return Ok(BatchOutcome::default());
        }
        self.ensure_partitions(&batch.times())?;
        self.writer.write(batch)
    }

    fn set_state(&self, agent_id: &str, state: &str, now_ns: i64) -> Result<()> {
        let (pool, agent_id, state) = (self.pool.clone(), agent_id.to_string(), state.to_string());
        self.run(async move {
            let changed = pool
                .get()
                .await?
                .execute(
                    "UPDATE agents SET state = $2, last_seen_ns = GREATEST(last_seen_ns, $3)
                     WHERE agent_id = $1",
                    &[&agent_id, &state, &now_ns],
                )
                .await?;
            if changed == 0 {
                bail!("unknown agent {agent_id:?}");
            }
            Ok(())
        })
    }

    fn state(&self, agent_id: &str) -> Result<Option<String>> {
        self.text_by_key("SELECT state FROM agents WHERE agent_id = $1", agent_id)
    }

    fn insert_incident(&self, incident: &pb::Incident) -> Result<Option<pb::Incident>> {
        let (pool, inc) = (self.pool.clone(), incident.clone());
        let seq = seq_to_sql(inc.seq)?;
        self.run(async move { insert_incident(&**pool.get().await?, &inc, seq).await })
    }

    fn file_incident(
        &self,
        incident: &pb::Incident,
        correlation: Correlation,
    ) -> Result<Option<pb::Incident>> {
        PgStore::file_incident(self, incident, correlation)
    }

    fn incident_agent(&self, id: &str) -> Result<Option<String>> {
        self.text_by_key("SELECT agent_id FROM incidents WHERE id = $1", id)
    }

    fn parts_of(&self, leaders: &[String]) -> Result<Vec<(String, pb::Incident)>> {
        let (pool, leaders) = (self.pool.clone(), leaders.to_vec());
        self.run(async move {
            let rows = pool
                .get()
                .await?
                .query(
                    &format!(
                        "SELECT {INCIDENT_COLUMNS}, merged_into FROM incidents
                         WHERE merged_into = ANY($1) ORDER BY n"
                    ),
                    &[&leaders],
                )
                .await?;
            Ok(rows.iter().map(|r| (r.get(8), incident_from(r))).collect())
        })
    }

    fn agents_where(&self, filter: &AgentFilter) -> Result<Vec<pb::AgentSummary>> {
        let (pool, filter) = (self.pool.clone(), filter.clone());
        self.run(async move {
            let client = pool.get().await?;
            let rows = client
                .query(
                    "SELECT agent_id, hello, state, first_seen_ns, last_seen_ns, last_seq, samples, events,
                            instance,
                            (SELECT body FROM messages m WHERE m.agent_id = a.agent_id AND m.kind = 'goodbye'
                             ORDER BY m.seq DESC LIMIT 1)
                     FROM agents a WHERE last_seen_ns >= $1 ORDER BY first_seen_ns, agent_id",
                    &[&filter.since_ns],
                )
                .await?;
            let mut agents = Vec::with_capacity(rows.len());
            for r in rows {
                let agent_id: String = r.get(0);
                let goodbye = match r.get::<_, Option<Vec<u8>>>(9) {
                    Some(body) => match decode_message(&agent_id, 0, &body)?.body {
                        Some(Body::Goodbye(g)) => Some(g),
                        _ => None,
                    },
                    None => None,
                };
                let state: String = r.get(2);
                let said_goodbye = state == "disconnected"
                    || state == oomscope_proto::EVIDENCE_INCOMPLETE_STATE;
                // The host is in the Hello: checked once it is decoded.
                let hello = decode_hello(&agent_id, r.get(1))?;
                if !filter.admits_host(&hello) {
                    continue;
                }
                agents.push(pb::AgentSummary {
                    hello: Some(hello),
                    state,
                    first_seen_ns: r.get(3),
                    last_seen_ns: r.get(4),
                    last_seq: r.get::<_, i64>(5) as u64,
                    samples: r.get::<_, i64>(6) as u64,
                    events: r.get::<_, i64>(7) as u64,
                    instance: r.get(8),
                    goodbye: goodbye.filter(|_| said_goodbye),
                    context: None,
                });
            }
            Ok(agents)
        })
    }

    fn incidents_where(
        &self,
        agent_id: Option<&str>,
        filter: &IncidentFilter,
    ) -> Result<Vec<pb::Incident>> {
        // The host is in each agent's Hello: its agents first.
        let on_host: Option<Vec<String>> = match filter.host.is_empty() {
            true => None,
            false => Some(
                self.agents_where(&filter.agents())?
                    .into_iter()
                    .filter_map(|a| a.hello.map(|h| h.agent_id))
                    .collect(),
            ),
        };
        let (pool, agent_id, f) = (
            self.pool.clone(),
            agent_id.map(str::to_string),
            filter.clone(),
        );
        self.run(async move {
            let rows = pool
                .get()
                .await?
                .query(
                    &format!(
                        "SELECT {INCIDENT_COLUMNS} FROM incidents
                         WHERE ($1::text IS NULL OR agent_id = $1) AND merged_into IS NULL
                           AND time_ns >= $2
                           AND ($3 = '' OR domain = $3) AND ($4 = '' OR kind = $4)
                           AND ($5::text[] IS NULL OR agent_id = ANY($5))
                         ORDER BY n"
                    ),
                    &[&agent_id, &f.since_ns, &f.domain, &f.cause, &on_host],
                )
                .await?;
            Ok(rows.iter().map(incident_from).collect())
        })
    }

    fn hello_since(&self, agent_id: &str, since_ns: i64) -> Result<bool> {
        let (pool, agent_id) = (self.pool.clone(), agent_id.to_string());
        self.run(async move {
            Ok(pool
                .get()
                .await?
                .query_opt(
                    "SELECT 1 FROM agents WHERE agent_id = $1 AND last_hello_ns > $2",
                    &[&agent_id, &since_ns],
                )
                .await?
                .is_some())
        })
    }

    fn snapshot(
        &self,
        agent_id: &str,
        max_messages: u32,
        older_samples: u32,
    ) -> Result<Option<Store>> {
        self.instance_view(agent_id, max_messages, older_samples)
    }

    fn message_count(&self, agent_id: &str) -> Result<u64> {
        let (pool, agent_id) = (self.pool.clone(), agent_id.to_string());
        self.run(async move {
            let n: i64 = pool
                .get()
                .await?
                .query_one(
                    "SELECT count(*) FROM messages WHERE agent_id = $1",
                    &[&agent_id],
                )
                .await?
                .get(0);
            Ok(n as u64)
        })
    }

    /// Drops every day partition wholly before `cutoff_ns`, and deletes the
    /// default partition's rows and the keys of those days; incidents go
    /// by `cutoff_ns` itself. Messages go whole days at a time, so a key
    /// never goes while its message stays (a resend would be stored twice).
    fn prune_before(&self, cutoff_ns: i64) -> Result<u64> {
        let pool = self.pool.clone();
        let day_cutoff = cutoff_ns.div_euclid(NS_PER_DAY) * NS_PER_DAY;
        let dropped = self.run(async move {
            let mut client = pool.get().await?;
            let tx = client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PARTITION_LOCK])
                .await?;
            let mut gone = 0u64;
            let mut dropped = Vec::new();
            for day in partition_days(&*tx).await? {
                if (day + 1) * NS_PER_DAY <= day_cutoff {
                    let rows: i64 = tx
                        .query_one(&format!("SELECT count(*) FROM messages_d{day}"), &[])
                        .await?
                        .get(0);
                    tx.batch_execute(&format!("DROP TABLE messages_d{day}"))
                        .await?;
                    gone += rows as u64;
                    dropped.push(day);
                }
            }
            gone += tx
                .execute(
                    "DELETE FROM messages_default WHERE time_ns < $1",
                    &[&day_cutoff],
                )
                .await?;
            gone += tx
                .execute(
                    "DELETE FROM message_keys WHERE time_ns < $1",
                    &[&day_cutoff],
                )
                .await?;
            tx.execute(
                "DELETE FROM dropped_marks WHERE time_ns < $1",
                &[&day_cutoff],
            )
            .await?;
            gone += tx
                .execute("DELETE FROM incidents WHERE time_ns < $1", &[&cutoff_ns])
                .await?;
            tx.commit().await?;
            Ok((gone, dropped))
        })?;
        let (gone, days) = dropped;
        let mut known = self.partitions.lock();
        for day in days {
            known.remove(&day);
        }
        Ok(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_postgres_and_hide_passwords() {
        assert!(is_postgres_url("postgres://u@h/db"));
        assert!(is_postgres_url("postgresql://u@h/db"));
        assert!(!is_postgres_url("oomscope.db"));
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
    }
}
