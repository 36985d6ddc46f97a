//! `oomscope collector`: serve both gRPC services on the embedded store, or on
//! a PostgreSQL database that several collectors share (`--db postgres://...`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use oomscope_collector::auth::Tokens;
use oomscope_collector::serve::{bind, serve_with_limits, ConnectionLimits, ServeConfig, TlsFiles};

/// What `oomscope collector` was given.
pub struct Options {
    pub listen: SocketAddr,
    pub db: PathBuf,
    pub lost_grace: Duration,
    pub limits: ConnectionLimits,
    pub token_file: Option<PathBuf>,
    pub insecure: bool,
    pub tls: Option<TlsFiles>,
    pub metrics: Option<SocketAddr>,
    pub retain: Option<Duration>,
}

pub fn run(opts: Options) -> anyhow::Result<i32> {
    let Options {
        listen,
        db,
        lost_grace,
        limits,
        token_file,
        insecure,
        tls,
        metrics,
        retain,
    } = opts;
    if !listen.ip().is_loopback() && token_file.is_none() && !insecure {
        anyhow::bail!(
            "refusing to listen on {listen} without --token-file: any host that reaches it could \
             write as any agent and read every agent's command lines and environment; give \
             --token-file FILE (lines of name:secret), or --insecure on a network you trust"
        );
    }
    let tokens = token_file.as_deref().map(Tokens::read).transpose()?;
    let rt = oomscope_collector::serve::runtime()?;
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
            tokens,
            tls,
        };
        // Only once the port is ours and the store open: a "listening" line
        // is a promise that agents can connect.
        // Both ports first: a taken one fails before the store opens.
        let metrics_listener = match metrics {
            Some(addr) => Some(oomscope_collector::metrics::bind(addr).await?),
            None => None,
        };
        let (listener, collector) = bind(&cfg).await?;
        if let Some(window) = retain {
            collector.retain(window);
        }
        if let Some(l) = metrics_listener {
            eprintln!(
                "oomscope collector metrics on http://{}/metrics",
                l.local_addr()?
            );
            let c = collector.clone();
            let stop = collector.until_stopping();
            tokio::spawn(async move {
                let render = move || c.render_metrics();
                if let Err(e) = oomscope_collector::metrics::serve(l, render, stop).await {
                    tracing::error!("serving /metrics failed: {e:#}");
                }
            });
        }
        eprintln!(
            "oomscope collector listening on {}{}, store {}",
            listener.local_addr()?,
            if collector.serves_tls() { " (TLS)" } else { "" },
            oomscope_collector::store::redact(&cfg.db.display().to_string())
        );
        let limits = cfg.limits.clone();
        serve_with_limits(listener, collector, limits, shutdown).await
    })?;
    Ok(0)
}
