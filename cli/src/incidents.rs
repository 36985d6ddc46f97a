//! `oomscope incidents`: the incidents, each with the parts joined to it.
//! `--json` is a bare array of `Incident` in its serde form.

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
    // The collector filters: a fleet's answer carries only what matched.
    let req = pb::IncidentsRequest {
        agent: agent.unwrap_or_default(),
        since_ns: since_ns(filter.since),
        domain: filter.domain.unwrap_or_default(),
        cause: filter.cause.unwrap_or_default(),
        host: filter.host.unwrap_or_default(),
    };
    let resp = Client::connect(url)?.incidents(req)?;
    show(json, &resp.incidents, || format::incidents(&resp.incidents))
}
