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

/// What `diagnose NAME` names.
#[derive(Debug, PartialEq)]
enum Named {
    Incident(String),
    Agent(String),
}

/// Incident ids are the collector's `inc-` and a number (`inc-000042`).
fn is_incident_id(name: &str) -> bool {
    name.strip_prefix("inc-")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A name shaped like an incident id is an incident (an unknown one stays
/// an error, never an agent's timeline); any other name is an incident only
/// where one has it as its id, else an agent id or name.
fn incident_or_agent(client: &mut Client, name: &str) -> anyhow::Result<Named> {
    if is_incident_id(name) {
        return Ok(Named::Incident(name.to_string()));
    }
    let incidents = client.incidents(pb::IncidentsRequest::default())?.incidents;
    Ok(match incidents.iter().any(|i| i.id == name) {
        true => Named::Incident(name.to_string()),
        false => Named::Agent(name.to_string()),
    })
}

pub fn diagnose(
    url: &str,
    named: Option<String>,
    agent: Option<String>,
    since: Option<Duration>,
    json: bool,
) -> anyhow::Result<i32> {
    let mut client = connect(url)?;
    let named = match named {
        Some(name) => Some(incident_or_agent(&mut client, &name)?),
        None => None,
    };
    // A name that was no incident and is no agent either: say both.
    let unknown_name = match &named {
        Some(Named::Agent(a)) => Some(a.clone()),
        _ => None,
    };
    let (incident, agent) = match (named, agent) {
        (None, agent) => (None, agent),
        (Some(Named::Incident(id)), agent) => (Some(id), agent),
        (Some(Named::Agent(a)), None) => (None, Some(a)),
        (Some(Named::Agent(a)), Some(b)) if a == b => (None, Some(a)),
        (Some(Named::Agent(a)), Some(b)) => anyhow::bail!(
            "{a:?} is no incident, so it names an agent, and --agent {b:?} names another: give one of them"
        ),
    };
    let req = pb::DiagnoseRequest {
        incident: incident.unwrap_or_default(),
        agent: agent.unwrap_or_default(),
        from_ns: since_ns(since),
        to_ns: 0,
    };
    let d = client
        .diagnose(req)
        .map_err(|e| match (&unknown_name, e.is_not_found()) {
            (Some(a), true) => anyhow::anyhow!(
                "no incident or agent {a:?}; `oomscope incidents` and `oomscope agents` list them"
            ),
            _ => e.into(),
        })?;
    show(
        json,
        || oomscope_analysis::to_json(&d),
        || format::diagnosis(&d),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incident_ids_are_told_from_agent_names_by_their_shape() {
        for id in ["inc-000001", "inc-000099", "inc-1234567"] {
            assert!(is_incident_id(id), "{id}");
        }
        for name in [
            "web",
            "inc-",
            "inc-12a",
            "inc-web",
            "agent-7f3a",
            "INC-000001",
        ] {
            assert!(!is_incident_id(name), "{name}");
        }
    }
}
