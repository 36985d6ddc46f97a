//! `oomscope collector`: serve both gRPC services on the embedded store.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use oomscope_collector::serve::{serve, ServeConfig};

pub fn run(listen: SocketAddr, db: PathBuf, lost_grace: Duration) -> anyhow::Result<i32> {
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
        eprintln!(
            "oomscope collector listening on {listen}, store {}",
            db.display()
        );
        serve(
            ServeConfig {
                listen,
                db,
                lost_grace,
            },
            shutdown,
        )
        .await
    })?;
    Ok(0)
}
