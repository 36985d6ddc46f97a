//! `oomscope compare A B`: two runs of one workload (incident ids or agent
//! names), fetched from the collector and compared.

use super::query::{block_on, client, show};
use super::report::{fetch, Run, Which};
use crate::compare::{self, Side};

pub fn run(url: &str, a: &str, b: &str, json: bool) -> anyhow::Result<i32> {
    let (ra, rb) = block_on(async {
        let mut c = client(url).await?;
        let ra = fetch(&mut c, Which::IncidentOrAgent(a.to_string())).await?;
        let rb = fetch(&mut c, Which::IncidentOrAgent(b.to_string())).await?;
        Ok((ra, rb))
    })?;
    let cmp = compare::compare(&side(&ra), &side(&rb));
    show(json, || compare::to_json(&cmp), || compare::to_text(&cmp))
}

fn side(r: &Run) -> Side<'_> {
    Side {
        timeline: &r.timeline,
        diagnosis: &r.diagnosis,
        incident: r.incident.as_ref(),
    }
}
