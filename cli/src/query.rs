//! The query verbs: thin clients of the collector's QueryService.

use std::time::Duration;

use oomscope_client::Client;
use oomscope_proto::{now_ns, v1 as pb};
use oomscope_report::format;
use serde_json::json;

use crate::output::print_out;

/// A client of the collector at `url`, for one verb's queries.
pub(crate) fn connect(url: &str) -> anyhow::Result<Client> {
    Ok(Client::connect(url)?)
}

/// `--since`: that long before now, in epoch nanoseconds; 0 (everything)
/// without it. `args::parse_since` keeps it within i64; saturating all the
/// same, so that no input wraps into the future.
fn since_ns(since: Option<Duration>) -> i64 {
    since
        .map(|d| now_ns().saturating_sub(oomscope_proto::duration_ns(d).unwrap_or(i64::MAX)))
        .unwrap_or(0)
}

/// Prints the `--json` rendering or the text one.
pub(crate) fn show(
    json: bool,
    as_json: impl FnOnce() -> serde_json::Value,
    as_text: impl FnOnce() -> String,
) -> anyhow::Result<i32> {
    match json {
        true => print_out(&format!("{}\n", serde_json::to_string_pretty(&as_json())?))?,
        false => print_out(&as_text())?,
    }
    Ok(0)
}

pub fn agents(url: &str, json: bool) -> anyhow::Result<i32> {
    let resp = connect(url)?.agents()?;
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
                           "last_seen_ns": a.last_seen_ns, "samples": a.samples, "events": a.events, "last_seq": a.last_seq,
                           "instance": a.instance, "parent_pid": h.parent_pid, "title": h.title})
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
    let resp = connect(url)?.incidents(req)?;
    show(
        json,
        || {
            let one = |i: &pb::Incident| {
                json!({"id": i.id, "agent": i.agent_name, "agent_id": i.agent_id, "kind": i.kind,
                       "time_ns": i.time_ns, "domain": if i.domain.is_empty() { None } else { Some(&i.domain) },
                       "summary": i.summary})
            };
            let v: Vec<_> = resp
                .incidents
                .iter()
                .map(|i| {
                    let mut root = one(i);
                    root["parts"] = json!(i.parts.iter().map(one).collect::<Vec<_>>());
                    root
                })
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
    let resp = connect(url)?.timeline(req)?;
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
    let d = connect(url)?.diagnose(req)?;
    show(
        json,
        || oomscope_analysis::to_json(&d),
        || format::diagnosis(&d),
    )
}
