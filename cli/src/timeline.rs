//! `oomscope timeline`: an agent's samples and events. `--json` is the
//! `TimelineResponse` in its serde form.

use std::time::Duration;

use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::format;

use crate::output::show;
use crate::since::since_ns;

pub fn run(
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
    let resp = Client::connect(url)?.timeline(req)?;
    show(json, &resp, || format::timeline(&resp))
}
