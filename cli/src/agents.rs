//! `oomscope agents`: every agent the collector knows, with its latest load.
//! `--json` is a bare array of `AgentSummary` in its serde form.

use std::time::Duration;

use oomscope_client::Client;
use oomscope_report::format;

use crate::output::show;
use crate::since::since_ns;

pub fn run(
    url: &str,
    json: bool,
    since: Option<Duration>,
    host: Option<String>,
) -> anyhow::Result<i32> {
    let mut resp = Client::connect(url)?.agents()?;
    let from = since_ns(since);
    resp.agents.retain(|a| {
        a.last_seen_ns >= from
            && host
                .as_deref()
                .is_none_or(|h| a.hello.as_ref().is_some_and(|hello| hello.host == h))
    });
    show(json, &resp.agents, || format::agents(&resp.agents))
}
