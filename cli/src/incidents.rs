//! `oomscope incidents`: the incidents, each with the parts joined to it.
//! `--json` is a bare array of `Incident` in its serde form.

use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::format;

use crate::output::show;

pub fn run(url: &str, agent: Option<String>, json: bool) -> anyhow::Result<i32> {
    let req = pb::IncidentsRequest {
        agent: agent.unwrap_or_default(),
    };
    let resp = Client::connect(url)?.incidents(req)?;
    show(json, &resp.incidents, || format::incidents(&resp.incidents))
}
