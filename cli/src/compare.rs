//! `oomscope compare A B`: two runs of one workload (incident ids or agent
//! names), fetched from the collector and compared.

use oomscope_client::Client;
use oomscope_report::compare;

use super::query::show;
use super::report::{fetch, Which};

pub fn run(url: &str, a: &str, b: &str, json: bool) -> anyhow::Result<i32> {
    let mut c = Client::connect(url)?;
    let ra = fetch(&mut c, Which::IncidentOrAgent(a.to_string()))?;
    let rb = fetch(&mut c, Which::IncidentOrAgent(b.to_string()))?;
    let cmp = compare::compare(&ra, &rb);
    show(json, || compare::to_json(&cmp), || compare::to_text(&cmp))
}
