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

/// One call to the collector at `url`: connect, `call`, and its answer.
fn ask<T, Fut>(
    url: &str,
    call: impl FnOnce(QueryServiceClient<Channel>) -> Fut,
) -> anyhow::Result<T>
where
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    block_on(async {
        let c = client(url).await?;
        call(c)
            .await
            .map(tonic::Response::into_inner)
            .map_err(status_err)
    })
}

/// `--since`: that long before now, in epoch nanoseconds; 0 (everything) without it.
fn since_ns(since: Option<Duration>) -> i64 {
    since.map(|d| now_ns() - d.as_nanos() as i64).unwrap_or(0)
}

/// Prints the `--json` rendering or the text one.
pub(super) fn show(
    json: bool,
    as_json: impl FnOnce() -> serde_json::Value,
    as_text: impl FnOnce() -> String,
) -> anyhow::Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(&as_json())?);
    } else {
        print!("{}", as_text());
    }
    Ok(0)
}

pub fn agents(url: &str, json: bool) -> anyhow::Result<i32> {
    let resp = ask(url, |mut c| async move {
        c.list_agents(pb::ListAgentsRequest {}).await
    })?;
    show(
        json,
        || {
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
            json!(v)
        },
        || format::agents(&resp.agents),
    )
}

pub fn incidents(url: &str, agent: Option<String>, json: bool) -> anyhow::Result<i32> {
    let req = pb::IncidentsRequest {
        agent: agent.unwrap_or_default(),
    };
    let resp = ask(url, |mut c| async move { c.incidents(req).await })?;
    show(
        json,
        || {
            let v: Vec<_> = resp
                .incidents
                .iter()
                .map(|i| json!({"id": i.id, "agent": i.agent_name, "agent_id": i.agent_id, "kind": i.kind,
                                "time_ns": i.time_ns, "domain": if i.domain.is_empty() { None } else { Some(&i.domain) },
                                "summary": i.summary}))
                .collect();
            json!(v)
        },
        || format::incidents(&resp.incidents),
    )
}

pub fn timeline(
    url: &str,
    agent: &str,
    since: Option<Duration>,
    max_points: u32,
    json: bool,
) -> anyhow::Result<i32> {
    let req = pb::TimelineRequest {
        agent: agent.to_string(),
        from_ns: since_ns(since),
        to_ns: 0,
        max_points,
    };
    let resp = ask(url, |mut c| async move { c.timeline(req).await })?;
    show(
        json,
        || format::timeline_json(&resp),
        || format::timeline(&resp),
    )
}

pub fn diagnose(
    url: &str,
    incident: Option<String>,
    agent: Option<String>,
    since: Option<Duration>,
    json: bool,
) -> anyhow::Result<i32> {
    let req = pb::DiagnoseRequest {
        incident: incident.unwrap_or_default(),
        agent: agent.unwrap_or_default(),
        from_ns: since_ns(since),
        to_ns: 0,
    };
    let d = ask(url, |mut c| async move { c.diagnose(req).await })?;
    show(
        json,
        || oomscope_analysis::to_json(&d),
        || format::diagnosis(&d),
    )
}
