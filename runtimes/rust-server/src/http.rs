//! The HTTP endpoint: POST /generate, GET /stats, GET /snapshot, GET /healthz.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use oomscope_agent_cuda::{DeviceMemory, PoolError};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::engine::Engine;

pub struct App<D: DeviceMemory> {
    pub engine: Arc<Engine<D>>,
    /// --max-active: sequences past it wait here (None: no limit).
    pub admit: Option<Arc<Semaphore>>,
}

#[derive(serde::Deserialize)]
pub struct GenerateRequest {
    pub prompt_tokens: u64,
    pub max_tokens: u64,
}

pub fn router<D: DeviceMemory>(app: Arc<App<D>>) -> Router {
    Router::new()
        .route("/generate", post(generate::<D>))
        .route("/stats", get(stats::<D>))
        .route("/snapshot", get(snapshot::<D>))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(app)
}

async fn generate<D: DeviceMemory>(
    State(app): State<Arc<App<D>>>,
    Json(req): Json<GenerateRequest>,
) -> (StatusCode, Json<Value>) {
    let _permit = match &app.admit {
        Some(s) => match s.clone().acquire_owned().await {
            Ok(p) => Some(p),
            Err(_) => {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(json!({"error": "shutting down"})),
                )
            }
        },
        None => None,
    };
    let engine = app.engine.clone();
    let id = engine.next_id();
    // Decoding sleeps and may wait on the collector's ack after an OOM:
    // keep it off the async workers.
    let done =
        tokio::task::spawn_blocking(move || engine.generate(id, req.prompt_tokens, req.max_tokens))
            .await;
    match done {
        Ok(Ok(c)) => (StatusCode::OK, Json(json!(c))),
        Ok(Err(PoolError::OutOfMemory(e))) => (
            StatusCode::INSUFFICIENT_STORAGE,
            Json(json!({"id": id, "error": e.message, "requested_bytes": e.requested_bytes})),
        ),
        Ok(Err(e)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"id": id, "error": e.to_string()})),
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"id": id, "error": e.to_string()})),
        ),
    }
}

async fn stats<D: DeviceMemory>(State(app): State<Arc<App<D>>>) -> Json<Value> {
    let s = app.engine.pool.stats();
    let c = app.engine.agent.context();
    Json(json!({
        "allocated_bytes": s.allocated_bytes,
        "reserved_bytes": s.reserved_bytes,
        "active_bytes": s.active_bytes,
        "inactive_split_bytes": s.inactive_split_bytes,
        "requested_bytes": s.requested_bytes,
        "num_alloc_retries": s.num_alloc_retries,
        "num_ooms": s.num_ooms,
        "segments": s.segments,
        "driver_free_bytes": s.driver_free_bytes,
        "driver_total_bytes": s.driver_total_bytes,
        "requests_done": c.requests_done,
        "weight_bytes": c.weight_bytes,
    }))
}

async fn snapshot<D: DeviceMemory>(State(app): State<Arc<App<D>>>) -> Json<Value> {
    let s = app.engine.pool.snapshot();
    Json(json!({
        "segments": s.segments,
        "reserved_bytes": s.reserved_bytes,
        "allocated_bytes": s.allocated_bytes,
        "largest_free_block_bytes": s.largest_free_block_bytes,
        "live_by_tag": s.live_by_tag.iter().map(|t| json!({"tag": t.site, "bytes": t.bytes, "blocks": t.blocks})).collect::<Vec<_>>(),
    }))
}
