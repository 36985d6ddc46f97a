//! Reads a collector back over its QueryService (gRPC), for tools and tests
//! in Python: `oomscope.query.timeline(url, agent)` gets every field, where
//! `oomscope timeline --json` prints a digest.

use std::time::Duration;

use oomscope_agent_core::pb;
use pb::query_service_client::QueryServiceClient;
use serde_json::Value;

use crate::pbjson;

fn block_on<T>(
    timeout: Duration,
    f: impl std::future::Future<Output = Result<T, String>>,
) -> Result<T, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    rt.block_on(async move {
        tokio::time::timeout(timeout, f).await.map_err(|_| {
            format!(
                "the collector did not answer within {} s",
                timeout.as_secs_f64()
            )
        })?
    })
}

async fn client(url: &str) -> Result<QueryServiceClient<tonic::transport::Channel>, String> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| {
            format!("{url:?} is not a collector URL (expected e.g. http://127.0.0.1:7433): {e}")
        })?
        .connect_timeout(Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| format!("cannot reach the collector at {url}: {e}"))?;
    Ok(QueryServiceClient::new(channel)
        .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES))
}

/// The agent's whole timeline (by id or name), every sample and event.
pub fn timeline(url: &str, agent: &str, timeout: Duration) -> Result<Value, String> {
    block_on(timeout, async {
        let mut c = client(url).await?;
        let req = pb::TimelineRequest {
            agent: agent.to_string(),
            ..Default::default()
        };
        let t = c
            .timeline(req)
            .await
            .map_err(|s| format!("timeline {agent}: {}", s.message()))?;
        Ok(pbjson::timeline(&t.into_inner()))
    })
}

pub fn agents(url: &str, timeout: Duration) -> Result<Value, String> {
    block_on(timeout, async {
        let mut c = client(url).await?;
        let r = c
            .list_agents(pb::ListAgentsRequest {})
            .await
            .map_err(|s| s.message().to_string())?;
        Ok(pbjson::agents(&r.into_inner()))
    })
}
