//! Serving both services on one port: `AgentService` (agents' streams,
//! `server.rs`) and `QueryService` (people and tools, `query.rs`).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use oomscope_proto::MAX_MESSAGE_BYTES;
use tokio_stream::wrappers::TcpListenerStream;

use crate::pb::agent_service_server::AgentServiceServer;
use crate::pb::query_service_server::QueryServiceServer;
use crate::query::QueryApi;
use crate::server::{AgentApi, Collector};
use crate::store::{ReaderPool, Store, DEFAULT_READERS};

pub struct ServeConfig {
    pub listen: SocketAddr,
    pub db: PathBuf,
    /// How long a stream that broke without a Goodbye may take to reconnect
    /// before the agent is recorded as lost.
    pub lost_grace: Duration,
}

pub const DEFAULT_LOST_GRACE: Duration = Duration::from_secs(5);

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
    let collector = Collector::new(store, cfg.lost_grace).with_readers(reader);
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
    // Agent streams never end on their own; tell them to, or a graceful
    // shutdown would wait for them forever.
    let shutdown = async move {
        shutdown.await;
        let _ = stopping.send(true);
    };
    tonic::transport::Server::builder()
        .add_service(agents)
        .add_service(queries)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
        .context("the gRPC server failed")
}
