//! `oomscope agents`: every agent the collector knows, with its latest load.
//! `--json` is a bare array of `AgentSummary` in its serde form.

use std::time::Duration;

use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::format;

use crate::output::show;
use crate::since::since_ns;

pub fn run(
    url: &str,
    json: bool,
    since: Option<Duration>,
    host: Option<String>,
) -> anyhow::Result<i32> {
    // The collector filters: a fleet's answer carries only what matched.
    let resp = Client::connect(url)?.agents_where(pb::ListAgentsRequest {
        since_ns: since_ns(since),
        host: host.unwrap_or_default(),
    })?;
    show(json, &resp.agents, || format::agents(&resp.agents))
}
