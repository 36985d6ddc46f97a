//! A small Rust inference server that embeds the oomscope tracking pool:
//! it loads weights, serves POST /generate with per-sequence KV pages, and
//! reports everything to the collector. Runs on a real GPU when libcuda and
//! a device are present, else on the simulated device.

mod config;
mod engine;
mod http;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use oomscope_agent_cuda::{Agent, AgentConfig, Cuda, DeviceMemory, Simulated, TrackingPool};
use tokio::sync::Semaphore;

use config::Config;
use engine::Engine;

/// How long the exit waits for the collector to ack what is queued.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OOMSCOPE_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = Config::parse();
    let code = match cfg.device.as_str() {
        "sim" => serve(TrackingPool::new(Simulated::new(cfg.capacity)), cfg),
        want => match Cuda::open(cfg.gpu) {
            Ok(cuda) => serve(TrackingPool::new(cuda), cfg),
            Err(e) if want == "auto" => {
                eprintln!(
                    "no CUDA device ({e}); using the simulated device of {} bytes",
                    cfg.capacity
                );
                serve(TrackingPool::new(Simulated::new(cfg.capacity)), cfg)
            }
            Err(e) => {
                eprintln!("error: {e}");
                2
            }
        },
    };
    std::process::exit(code);
}

fn serve<D: DeviceMemory>(pool: TrackingPool<D>, cfg: Config) -> i32 {
    let mut acfg = AgentConfig::new(cfg.name.clone());
    acfg.collector_url = cfg.collector.clone();
    acfg.sample_interval = Duration::from_millis(cfg.sample_interval_ms);
    acfg.models = vec![oomscope_agent_cuda::pb::Model {
        name: "oomscope-demo".into(),
        dtype: "bfloat16".into(),
        bytes: cfg.model_bytes,
        ..Default::default()
    }];
    let agent = match Agent::start_with_pool(acfg, &pool) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let info = pool.device().info().clone();
    eprintln!(
        "device {}: {} ({} bytes)",
        info.index, info.name, info.total_bytes
    );
    let engine = Arc::new(Engine::new(pool, agent.clone(), cfg.clone()));
    if let Err(e) = engine.load() {
        // The OOM event was sent (and acked, or spooled) before this returned.
        eprintln!("loading the weights failed: {e}");
        agent.shutdown("load failed", 1, SHUTDOWN_FLUSH);
        return 1;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: no async runtime: {e}");
            return 1;
        }
    };
    let app = Arc::new(http::App {
        engine,
        admit: (cfg.max_active > 0).then(|| Arc::new(Semaphore::new(cfg.max_active))),
    });
    let served = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&cfg.listen).await?;
        println!("listening on http://{}", listener.local_addr()?);
        let _ = std::io::stdout().flush();
        axum::serve(listener, http::router(app))
            .with_graceful_shutdown(shutdown_signal())
            .await
    });
    let code = match served {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    };
    agent.shutdown("stopped", code, SHUTDOWN_FLUSH);
    code
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
