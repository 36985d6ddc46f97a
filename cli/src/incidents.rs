//! `oomscope incidents`: the incidents, each with the parts joined to it.
//! `--json` is a bare array of `Incident` in its serde form.

use std::collections::HashMap;
use std::time::Duration;

use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::format;

use crate::output::show;
use crate::since::since_ns;

/// Which incidents to show, besides `--agent`.
pub struct Filter {
    pub since: Option<Duration>,
    pub domain: Option<String>,
    pub cause: Option<String>,
    pub host: Option<String>,
}

pub fn run(url: &str, agent: Option<String>, filter: Filter, json: bool) -> anyhow::Result<i32> {
    let req = pb::IncidentsRequest {
        agent: agent.unwrap_or_default(),
    };
    let mut client = Client::connect(url)?;
    let mut resp = client.incidents(req)?;
    // Hosts are the agents': asked only when filtered by one.
    let hosts: HashMap<String, String> = match &filter.host {
        None => HashMap::new(),
        Some(_) => client
            .agents()?
            .agents
            .into_iter()
            .filter_map(|a| a.hello.map(|h| (h.agent_id, h.host)))
            .collect(),
    };
    let from = since_ns(filter.since);
    let is = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
    resp.incidents.retain(|i| {
        i.time_ns >= from
            && is(&filter.domain, &i.domain)
            && is(&filter.cause, &i.kind)
            && is(
                &filter.host,
                hosts.get(&i.agent_id).map(String::as_str).unwrap_or(""),
            )
    });
    show(json, &resp.incidents, || format::incidents(&resp.incidents))
}
