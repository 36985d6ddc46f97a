//! `oomscope agents`: every agent the collector knows, with its latest load.
//! `--json` is a bare array of `AgentSummary` in its serde form.

use oomscope_client::Client;
use oomscope_report::format;

use crate::output::show;

pub fn run(url: &str, json: bool) -> anyhow::Result<i32> {
    let resp = Client::connect(url)?.agents()?;
    show(json, &resp.agents, || format::agents(&resp.agents))
}
