//! `oomscope collector`: serve both gRPC services on the embedded store.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use oomscope_collector::serve::{bind, serve_with_limits, ConnectionLimits, ServeConfig};

pub fn run(
    listen: SocketAddr,
    db: PathBuf,
    lost_grace: Duration,
    limits: ConnectionLimits,
) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("install SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("shutting down");
        };
        let cfg = ServeConfig {
            listen,
            db,
            lost_grace,
            limits,
        };
        // Only once the port is ours and the store open: a "listening" line
        // is a promise that agents can connect.
        let (listener, collector) = bind(&cfg).await?;
        eprintln!(
            "oomscope collector listening on {}, store {}",
            listener.local_addr()?,
            cfg.db.display()
        );
        let limits = cfg.limits.clone();
        serve_with_limits(listener, collector, limits, shutdown).await
    })?;
    Ok(0)
}
