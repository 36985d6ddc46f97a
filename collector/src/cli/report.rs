//! `oomscope report`: fetch one run (an incident, or an agent's timeline)
//! from the collector and write it as a self-contained HTML page or Markdown.
//! Also the fetch that `oomscope compare` shares.

use std::path::Path;

use anyhow::{bail, Context};
use oomscope_agent_core::pb;
use pb::query_service_client::QueryServiceClient;
use tonic::transport::Channel;

use super::query::{block_on, client, status_err};
use crate::report::{self, ReportInput};

/// Samples fetched for one run: the collector thins longer timelines evenly
/// (events are never dropped), which bounds the page and the memory used;
/// at a 250 ms interval this is over an hour of samples.
pub const MAX_POINTS: u32 = 20_000;

/// One run as the collector knows it.
pub struct Run {
    pub timeline: pb::TimelineResponse,
    pub diagnosis: pb::Diagnosis,
    pub incident: Option<pb::Incident>,
}

/// What names a run on the command line.
pub enum Which {
    /// The latest incident of all.
    Latest,
    Incident(String),
    Agent(String),
    /// An incident id if one has it, else an agent id or name.
    IncidentOrAgent(String),
}

pub async fn fetch(c: &mut QueryServiceClient<Channel>, which: Which) -> anyhow::Result<Run> {
    let all = || async {
        Ok::<_, anyhow::Error>(
            c.clone()
                .incidents(pb::IncidentsRequest::default())
                .await
                .map_err(status_err)?
                .into_inner()
                .incidents,
        )
    };
    let (incident, agent) = match which {
        Which::Latest => match latest(all().await?) {
            Some(i) => (Some(i), None),
            None => bail!("no incidents recorded yet; name one, or an agent with --agent"),
        },
        Which::Incident(id) => match all().await?.into_iter().find(|i| i.id == id) {
            Some(i) => (Some(i), None),
            None => bail!("no incident {id:?}; `oomscope incidents` lists them"),
        },
        Which::IncidentOrAgent(x) => match all().await?.into_iter().find(|i| i.id == x) {
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
        .await
        .map_err(status_err)
        .with_context(|| format!("no incident or agent {agent:?}"))?
        .into_inner();
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
            })
            .await
            .map_err(status_err)?
            .into_inner()
            .incidents,
        ),
    };
    let diagnosis = c
        .diagnose(pb::DiagnoseRequest {
            incident: incident.as_ref().map(|i| i.id.clone()).unwrap_or_default(),
            agent: if incident.is_some() {
                String::new()
            } else {
                agent_id
            },
            from_ns: 0,
            to_ns: 0,
        })
        .await
        .map_err(status_err)?
        .into_inner();
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
    let run = block_on(async { fetch(&mut client(url).await?, which).await })?;
    let input = ReportInput {
        timeline: &run.timeline,
        diagnosis: &run.diagnosis,
        incident: run.incident.as_ref(),
    };
    match (html_out, markdown) {
        (Some(path), _) => {
            std::fs::write(path, report::html(&input))
                .with_context(|| format!("cannot write the report to {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        (None, true) => print!("{}", report::markdown(&input)),
        (None, false) => bail!("choose a form: --html OUT.html or --md"),
    }
    Ok(0)
}
