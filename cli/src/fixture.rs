//! `oomscope fixture INCIDENT`: the incident's diagnosis, its load at the
//! failure, becomes an `oomscope.fixture/v1` (see `oomscope_probe::fixture`);
//! a failure while starting, a fixture that reproduces at launch.

use std::path::Path;

use anyhow::Context;
use oomscope_client::Client;
use oomscope_probe::fixture;
use oomscope_proto::v1 as pb;

use crate::output::print_out;

pub fn run(url: &str, incident: &str, out: Option<&Path>) -> anyhow::Result<i32> {
    let mut client = Client::connect(url)?;
    let d = client.diagnose(pb::DiagnoseRequest {
        incident: incident.to_string(),
        ..Default::default()
    })?;
    // A failure while starting reproduces at launch: no load to derive.
    let fx = match fixture::startup_reason(&d) {
        Some(why) => fixture::startup_load(incident, &why),
        None => fixture::from_failure(
            incident,
            d.trigger
                .as_deref()
                .unwrap_or(oomscope_proto::TriggerKind::Unknown.as_str()),
            &d.failure.unwrap_or_default(),
        )
        .map_err(anyhow::Error::msg)?,
    };
    let text = serde_json::to_string_pretty(&fx)? + "\n";
    match out {
        Some(p) => std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?,
        None => print_out(&text)?,
    }
    Ok(0)
}
