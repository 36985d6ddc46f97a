//! The query verbs: thin clients of the collector's QueryService.

use std::time::Duration;

use anyhow::Context;
use oomscope_agent_core::{now_ns, pb};
use pb::query_service_client::QueryServiceClient;
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

use super::format;

/// A QueryService client connected to the collector at `url`.
pub(crate) async fn client(url: &str) -> anyhow::Result<QueryServiceClient<Channel>> {
    let channel = Endpoint::from_shared(url.to_string())
        .with_context(|| {
            format!("`{url}` is not a collector URL (expected e.g. http://127.0.0.1:7433)")
        })?
        .connect_timeout(Duration::from_secs(3))
        .connect()
        .await
        .with_context(|| {
            format!("cannot reach the collector at {url}: is `oomscope collector` running?")
        })?;
    Ok(QueryServiceClient::new(channel)
        .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES))
}

/// The runtime a query runs on: one thread, IO and timers. A client's
/// connection lives on the runtime that made it, so a caller with several
/// queries keeps one.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

pub(super) fn block_on<T>(
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    runtime()?.block_on(f)
}

pub(super) fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{} ({:?})", s.message(), s.code())
}

pub fn agents(url: &str, json: bool) -> anyhow::Result<i32> {
    let resp = block_on(async {
        client(url)
            .await?
            .list_agents(pb::ListAgentsRequest {})
            .await
            .map_err(status_err)
    })?
    .into_inner();
    if json {
        let v: Vec<_> = resp
            .agents
            .iter()
            .map(|a| {
                let h = a.hello.clone().unwrap_or_default();
                json!({"id": h.agent_id, "name": h.name, "host": h.host, "pid": h.pid, "role": h.role,
                       "runtime": h.runtime, "state": a.state, "first_seen_ns": a.first_seen_ns,
                       "last_seen_ns": a.last_seen_ns, "samples": a.samples, "events": a.events, "last_seq": a.last_seq})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", format::agents(&resp.agents));
    }
    Ok(0)
}

pub fn incidents(url: &str, agent: Option<String>, json: bool) -> anyhow::Result<i32> {
    let resp = block_on(async {
        client(url)
            .await?
            .incidents(pb::IncidentsRequest {
                agent: agent.unwrap_or_default(),
            })
            .await
            .map_err(status_err)
    })?
    .into_inner();
    if json {
        let v: Vec<_> = resp
            .incidents
            .iter()
            .map(|i| json!({"id": i.id, "agent": i.agent_name, "agent_id": i.agent_id, "kind": i.kind,
                            "time_ns": i.time_ns, "domain": if i.domain.is_empty() { None } else { Some(&i.domain) },
                            "summary": i.summary}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", format::incidents(&resp.incidents));
    }
    Ok(0)
}

pub fn timeline(
    url: &str,
    agent: &str,
    since: Option<Duration>,
    max_points: u32,
    json: bool,
) -> anyhow::Result<i32> {
    let from_ns = since.map(|d| now_ns() - d.as_nanos() as i64).unwrap_or(0);
    let resp = block_on(async {
        client(url)
            .await?
            .timeline(pb::TimelineRequest {
                agent: agent.to_string(),
                from_ns,
                to_ns: 0,
                max_points,
            })
            .await
            .map_err(status_err)
    })?
    .into_inner();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&format::timeline_json(&resp))?
        );
    } else {
        print!("{}", format::timeline(&resp));
    }
    Ok(0)
}

pub fn diagnose(
    url: &str,
    incident: Option<String>,
    agent: Option<String>,
    since: Option<Duration>,
    json: bool,
) -> anyhow::Result<i32> {
    let from_ns = since.map(|d| now_ns() - d.as_nanos() as i64).unwrap_or(0);
    let d = block_on(async {
        client(url)
            .await?
            .diagnose(pb::DiagnoseRequest {
                incident: incident.unwrap_or_default(),
                agent: agent.unwrap_or_default(),
                from_ns,
                to_ns: 0,
            })
            .await
            .map_err(status_err)
    })?
    .into_inner();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&oomscope_analysis::to_json(&d))?
        );
    } else {
        print!("{}", format::diagnosis(&d));
    }
    Ok(0)
}
