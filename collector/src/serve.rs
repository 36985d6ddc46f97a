//! Serving both services on one port: `AgentService` (agents' streams,
//! `ingest.rs`) and `QueryService` (people and tools, `query_service.rs`).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use oomscope_proto::MAX_MESSAGE_BYTES;
use tonic::service::interceptor::InterceptedService;

use crate::accept::Incoming;
use crate::inbound::{InboundLayer, InboundLimits};
use crate::ingest::{AgentApi, Collector};
use crate::pb::agent_service_server::AgentServiceServer;
use crate::pb::query_service_server::QueryServiceServer;
use crate::query_service::QueryApi;
use crate::store::{FileWatch, WriterLock};
use crate::store::{PgStore, ReaderPool, Store, DEFAULT_PG_POOL, DEFAULT_READERS};

/// Blocking threads the collector's runtime keeps at most (tokio's default
/// is 512). Its blocking work is the store's (one writer lock, a few
/// reader connections, the shared store's pool), so more threads only
/// wait; with 2,000 agents connecting at once the default spawned hundreds,
/// whose stacks and allocator arenas outlived the agents.
pub const DEFAULT_BLOCKING_THREADS: usize = 32;
/// How long an idle blocking thread lives (tokio's default is 10 s), so the
/// memory of a burst is returned soon after it.
pub const DEFAULT_BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(2);

/// The runtime a collector process serves on: tokio's multi-threaded one,
/// its blocking pool bounded by [`DEFAULT_BLOCKING_THREADS`].
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(DEFAULT_BLOCKING_THREADS)
        .thread_keep_alive(DEFAULT_BLOCKING_KEEP_ALIVE)
        .thread_name("oomscope-collector")
        .build()
}

pub struct ServeConfig {
    pub listen: SocketAddr,
    pub db: PathBuf,
    /// How long a stream that broke without a Goodbye may take to reconnect
    /// before the agent is recorded as lost.
    pub lost_grace: Duration,
    pub limits: ConnectionLimits,
    /// Tokens every call must carry (`--token-file`); None: no check.
    pub tokens: Option<crate::auth::Tokens>,
    /// Serve TLS with these files; None: plaintext.
    pub tls: Option<TlsFiles>,
}

/// The collector's TLS: its certificate chain and key, and optionally the
/// CA that client certificates must chain to (then every client needs one).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// tonic's server config from the files (rustls, TLS 1.2 and 1.3).
    pub fn server_config(&self) -> Result<tonic::transport::ServerTlsConfig> {
        use tonic::transport::{Certificate, Identity, ServerTlsConfig};
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p).with_context(|| format!("reading the {what} {}", p.display()))
        };
        let identity = Identity::from_pem(
            read(&self.cert, "TLS certificate")?,
            read(&self.key, "TLS key")?,
        );
        let mut cfg = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca {
            cfg = cfg.client_ca_root(Certificate::from_pem(read(ca, "client CA")?));
        }
        Ok(cfg)
    }
}

/// What one client may hold of the collector: streams, time and memory.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    /// Streams one connection may have open at once (HTTP/2
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`, so a client learns it up front).
    pub max_streams: u32,
    /// How long one message may take to arrive once its first byte came.
    pub message_deadline: Duration,
    /// Bytes of partly arrived messages, across every stream.
    pub max_buffered_bytes: usize,
    /// A connection with no stream for this long is closed.
    pub idle_connection: Duration,
}

/// An agent holds one stream; a tool a few queries at once. 100 is what
/// the HTTP/2 RFC recommends as the least a server should allow.
pub const DEFAULT_MAX_STREAMS: u32 = 100;
/// The largest message (16 MiB) at 1 MiB/s, twice over: a slow but live
/// link finishes well within it; a sender that stopped mid-message lets go.
pub const DEFAULT_MESSAGE_DEADLINE: Duration = Duration::from_secs(30);
/// Eight largest messages arriving at once; a normal sample is 0.5-5 KB and
/// arrives in one frame, so only a flood of huge messages ever reaches it.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 128 * 1024 * 1024;
/// Agents keep their stream open and tools open a connection per command,
/// so a connection without a stream for a minute is forgotten or hostile.
pub const DEFAULT_IDLE_CONNECTION: Duration = Duration::from_secs(60);

impl Default for ConnectionLimits {
    fn default() -> ConnectionLimits {
        ConnectionLimits {
            max_streams: DEFAULT_MAX_STREAMS,
            message_deadline: DEFAULT_MESSAGE_DEADLINE,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
            idle_connection: DEFAULT_IDLE_CONNECTION,
        }
    }
}

/// The services' names, as grpc.health.v1 is asked about them.
pub const AGENT_SERVICE: &str = "oomscope.v1.AgentService";
pub const QUERY_SERVICE: &str = "oomscope.v1.QueryService";

pub const DEFAULT_LOST_GRACE: Duration = Duration::from_secs(5);

/// HTTP/2 flow control for each agent stream: what a client may send before
/// the collector reads it. One stream's worth of DATA frames, even of the
/// smallest gRPC message (7 bytes) in frames of their own (Python's grpcio
/// frames each message alone), stays within h2's flood guard, which charges
/// each frame under 256 bytes against a budget of half the connection
/// window and answers GOAWAY "too_many_data_frames" past it:
/// 256 KiB / 7 x 249 = 9.1 MiB of the 16 MiB budget. Tonic clients (every
/// agent built on agent-core) pack messages into large frames and never
/// come near it.
pub const DEFAULT_STREAM_WINDOW: u32 = 256 * 1024;
/// HTTP/2 flow control for a whole connection (see [`DEFAULT_STREAM_WINDOW`]):
/// at most this much unread data per connection, whatever its streams.
pub const DEFAULT_CONNECTION_WINDOW: u32 = 32 * 1024 * 1024;

/// Binds `cfg.listen` and serves until `shutdown` completes.
pub async fn serve(cfg: ServeConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    let (listener, collector) = bind(&cfg).await?;
    serve_with_limits(listener, collector, cfg.limits, shutdown).await
}

/// Binds `cfg.listen`, then opens the store: a taken port fails before any
/// store file is created. Serve the pair with [`serve_with_listener`].
pub async fn bind(cfg: &ServeConfig) -> Result<(tokio::net::TcpListener, Collector)> {
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    if let Some(url) = cfg.db.to_str().filter(|d| crate::store::is_postgres_url(d)) {
        return Ok((listener, bind_postgres(cfg, url).await?));
    }
    // Before the store opens: a second collector must not even migrate it.
    let lock = WriterLock::acquire(&cfg.db, &format!("a collector listening on {}", cfg.listen))?;
    let db = cfg.db.clone();
    let (store, reader) = tokio::task::spawn_blocking(move || {
        let store = Store::open(&db)?;
        Ok::<_, anyhow::Error>((store, ReaderPool::open(&db, DEFAULT_READERS)?))
    })
    .await
    .map_err(|e| anyhow!("opening the store: {e}"))??;
    let watch = FileWatch::new(&cfg.db)?;
    let collector = Collector::new(store, cfg.lost_grace)
        .with_readers(reader)
        .with_file_watch(watch)
        .with_writer_lock(lock);
    Ok((listener, secure(collector, cfg)?))
}

/// A collector of a PostgreSQL store that other collectors may share: it
/// is the store of record, and this collector's own store (in memory) holds
/// the streams it serves (see [`Collector::with_shared_store`]). No file
/// lock: several collectors on one database is the point.
async fn bind_postgres(cfg: &ServeConfig, url: &str) -> Result<Collector> {
    let url = url.to_string();
    let (shared, own) = tokio::task::spawn_blocking(move || {
        let shared = PgStore::connect(&url, DEFAULT_PG_POOL)?;
        Ok::<_, anyhow::Error>((shared, Store::open_in_memory()?))
    })
    .await
    .map_err(|e| anyhow!("opening the store: {e}"))??;
    let collector = Collector::new(own, cfg.lost_grace).with_shared_store(Arc::new(shared));
    collector.keep_own_for(crate::ingest::DEFAULT_WORKING_WINDOW);
    secure(collector, cfg)
}

fn secure(collector: Collector, cfg: &ServeConfig) -> Result<Collector> {
    let collector = match cfg.tokens.clone() {
        Some(tokens) => collector.with_tokens(tokens),
        None => collector,
    };
    Ok(match &cfg.tls {
        Some(files) => collector.with_tls(files.server_config()?),
        None => collector,
    })
}

/// Serves both services on an already bound listener (tests bind port 0),
/// with the default [`ConnectionLimits`].
pub async fn serve_with_listener(
    listener: tokio::net::TcpListener,
    collector: Collector,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    serve_with_limits(listener, collector, ConnectionLimits::default(), shutdown).await
}

/// Serves both services on an already bound listener, holding each client
/// to `limits`.
pub async fn serve_with_limits(
    listener: tokio::net::TcpListener,
    collector: Collector,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let addr = listener.local_addr().ok();
    collector.watch_stale_agents().await;
    let agents = AgentServiceServer::new(AgentApi {
        collector: collector.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let queries = QueryServiceServer::new(QueryApi::new(collector.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    // Checked before any handler runs: a refused call writes nothing.
    let check = crate::auth::interceptor(collector.inner.tokens.clone());
    let agents = InterceptedService::new(agents, check.clone());
    let queries = InterceptedService::new(queries, check);
    // grpc.health.v1, unauthenticated: what a load balancer or a
    // Kubernetes probe asks. It says NOT_SERVING once shutdown begins.
    let (health_reporter, health) = tonic_health::server::health_reporter();
    for name in ["", AGENT_SERVICE, QUERY_SERVICE] {
        health_reporter
            .set_service_status(name, tonic_health::ServingStatus::Serving)
            .await;
    }
    tracing::info!(?addr, "collector serving");
    let stopping = collector.inner.stopping.clone();
    let mut stopped = stopping.subscribe();
    // Agent streams never end on their own; tell them to, or a graceful
    // shutdown would wait for them forever. A store that went away under a
    // write (see `Inner::check_file`) stops the collector too.
    let shutdown = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = stopped.wait_for(|s| *s) => {}
        }
        for name in ["", AGENT_SERVICE, QUERY_SERVICE] {
            health_reporter
                .set_service_status(name, tonic_health::ServingStatus::NotServing)
                .await;
        }
        let _ = stopping.send(true);
    };
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = collector.inner.tls.clone() {
        // A bad certificate or key fails here, before anything is served.
        server = server
            .tls_config(tls)
            .context("the collector's TLS certificate or key")?;
    }
    server
        .initial_stream_window_size(DEFAULT_STREAM_WINDOW)
        .initial_connection_window_size(DEFAULT_CONNECTION_WINDOW)
        .max_concurrent_streams(limits.max_streams)
        .layer(InboundLayer::new(InboundLimits {
            message_deadline: limits.message_deadline,
            max_buffered_bytes: limits.max_buffered_bytes,
        }))
        .add_service(agents)
        .add_service(queries)
        .add_service(health)
        .serve_with_incoming_shutdown(Incoming::new(listener, limits.idle_connection), shutdown)
        .await
        .context("the gRPC server failed")?;
    let (groups, batches) = collector.group_commits();
    tracing::info!(
        groups,
        batches,
        "stopped: the writer committed {batches} batches in {groups} group transactions"
    );
    match collector.inner.fatal.lock().take() {
        Some(why) => Err(anyhow!("stopped serving: {why}")),
        None => Ok(()),
    }
}
