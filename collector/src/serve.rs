//! Serving both services on one port: `AgentService` (agents' streams,
//! `ingest.rs`) and `QueryService` (people and tools, `query_service.rs`).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use oomscope_proto::MAX_MESSAGE_BYTES;
use tokio_stream::wrappers::TcpListenerStream;

use crate::ingest::{AgentApi, Collector};
use crate::pb::agent_service_server::AgentServiceServer;
use crate::pb::query_service_server::QueryServiceServer;
use crate::query_service::QueryApi;
use crate::store::FileWatch;
use crate::store::{ReaderPool, Store, DEFAULT_READERS};

pub struct ServeConfig {
    pub listen: SocketAddr,
    pub db: PathBuf,
    /// How long a stream that broke without a Goodbye may take to reconnect
    /// before the agent is recorded as lost.
    pub lost_grace: Duration,
}

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
    serve_with_listener(listener, collector, shutdown).await
}

/// Binds `cfg.listen`, then opens the store: a taken port fails before any
/// store file is created. Serve the pair with [`serve_with_listener`].
pub async fn bind(cfg: &ServeConfig) -> Result<(tokio::net::TcpListener, Collector)> {
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
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
        .with_file_watch(watch);
    Ok((listener, collector))
}

/// Serves both services on an already bound listener (tests bind port 0).
pub async fn serve_with_listener(
    listener: tokio::net::TcpListener,
    collector: Collector,
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
        let _ = stopping.send(true);
    };
    tonic::transport::Server::builder()
        .initial_stream_window_size(DEFAULT_STREAM_WINDOW)
        .initial_connection_window_size(DEFAULT_CONNECTION_WINDOW)
        .add_service(agents)
        .add_service(queries)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
        .context("the gRPC server failed")?;
    match collector.inner.fatal.lock().take() {
        Some(why) => Err(anyhow!("stopped serving: {why}")),
        None => Ok(()),
    }
}
