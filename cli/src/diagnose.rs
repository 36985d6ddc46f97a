//! `oomscope diagnose`: the verdict on an incident, or on an agent's
//! history. `--json` is the `Diagnosis` in its serde form.

use std::time::Duration;

use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::format;

use crate::output::show;
use crate::since::since_ns;

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

pub fn run(
    url: &str,
    named: Option<String>,
    agent: Option<String>,
    since: Option<Duration>,
    json: bool,
) -> anyhow::Result<i32> {
    let mut client = Client::connect(url)?;
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
    show(json, &d, || format::diagnosis(&d))
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
