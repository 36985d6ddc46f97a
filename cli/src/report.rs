//! `oomscope report`: fetch one run (an incident, or an agent's timeline)
//! from the collector and write it as a self-contained HTML page or Markdown.
//! Also the fetch that `oomscope compare` shares.

use std::path::Path;

use anyhow::{bail, Context};
use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::Run;

/// Samples fetched for one run: the collector thins longer timelines evenly
/// (events are never dropped), which bounds the page and the memory used;
/// at a 250 ms interval this is over an hour of samples.
pub const MAX_POINTS: u32 = 20_000;

/// What names a run on the command line.
pub enum Which {
    /// The latest incident of all.
    Latest,
    Incident(String),
    Agent(String),
    /// An incident id if one has it, else an agent id or name.
    IncidentOrAgent(String),
}

pub fn fetch(c: &mut Client, which: Which) -> anyhow::Result<Run> {
    let mut all = || -> anyhow::Result<Vec<pb::Incident>> {
        Ok(c.incidents(pb::IncidentsRequest::default())?.incidents)
    };
    let (incident, agent) = match which {
        Which::Latest => match latest(all()?) {
            Some(i) => (Some(i), None),
            None => bail!("no incidents recorded yet; name one, or an agent with --agent"),
        },
        Which::Incident(id) => match all()?.into_iter().find(|i| i.id == id) {
            Some(i) => (Some(i), None),
            None => bail!("no incident {id:?}; `oomscope incidents` lists them"),
        },
        Which::IncidentOrAgent(x) => match all()?.into_iter().find(|i| i.id == x) {
            Some(i) => (Some(i), None),
            None => (None, Some(x)),
        },
        Which::Agent(a) => (None, Some(a)),
    };
    let agent = match (&incident, agent) {
        (Some(i), _) => i.agent_id.clone(),
        (None, Some(a)) => a,
        (None, None) => unreachable!("every branch names an incident or an agent"),
    };
    let timeline = c
        .timeline(pb::TimelineRequest {
            agent: agent.clone(),
            from_ns: 0,
            to_ns: 0,
            max_points: MAX_POINTS,
        })
        .with_context(|| format!("no incident or agent {agent:?}"))?;
    let agent_id = timeline
        .hello
        .as_ref()
        .map(|h| h.agent_id.clone())
        .unwrap_or(agent);
    // An agent named on its own stands for its latest incident, if it had one.
    let incident = match incident {
        Some(i) => Some(i),
        None => latest(
            c.incidents(pb::IncidentsRequest {
                agent: agent_id.clone(),
            })?
            .incidents,
        ),
    };
    let diagnosis = c.diagnose(pb::DiagnoseRequest {
        incident: incident.as_ref().map(|i| i.id.clone()).unwrap_or_default(),
        agent: if incident.is_some() {
            String::new()
        } else {
            agent_id
        },
        from_ns: 0,
        to_ns: 0,
    })?;
    Ok(Run {
        timeline,
        diagnosis,
        incident,
    })
}

fn latest(list: Vec<pb::Incident>) -> Option<pb::Incident> {
    list.into_iter().max_by_key(|i| i.time_ns)
}

pub fn run(
    url: &str,
    incident: Option<String>,
    agent: Option<String>,
    html_out: Option<&Path>,
    markdown: bool,
) -> anyhow::Result<i32> {
    let which = match (incident, agent) {
        (Some(_), Some(_)) => bail!("name an incident or --agent, not both"),
        (Some(i), None) => Which::Incident(i),
        (None, Some(a)) => Which::Agent(a),
        (None, None) => Which::Latest,
    };
    let input = fetch(&mut Client::connect(url)?, which)?;
    match (html_out, markdown) {
        (Some(path), _) => {
            std::fs::write(path, oomscope_report::html(&input))
                .with_context(|| format!("cannot write the report to {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        (None, true) => crate::query::print_out(&oomscope_report::markdown(&input))?,
        (None, false) => bail!("choose a form: --html OUT.html or --md"),
    }
    Ok(0)
}
