//! `oomscope compare A B`: two runs of one workload (incident ids or agent
//! names), fetched from the collector and compared. `--json` is the
//! `Comparison` message in its serde form.

use oomscope_client::Client;
use oomscope_report::comparison;

use super::output::show;
use super::report::{fetch, Which};

pub fn run(url: &str, a: &str, b: &str, json: bool) -> anyhow::Result<i32> {
    // Both runs at once, each on its own connection: the collector answers
    // them on two of its readers, so a comparison takes about one report's
    // time rather than two (BENCHMARKS.md, "a long history").
    let one = |which: &str| -> anyhow::Result<_> {
        let mut c = Client::connect(url)?;
        fetch(&mut c, Which::IncidentOrAgent(which.to_string()))
    };
    let (ra, rb) = std::thread::scope(|s| {
        let second = s.spawn(|| one(b));
        let first = one(a);
        (
            first,
            second.join().expect("the fetch thread does not panic"),
        )
    });
    let (ra, rb) = (ra?, rb?);
    let cmp = comparison::compare(&ra, &rb);
    show(json, &comparison::to_proto(&cmp), || {
        comparison::to_text(&cmp)
    })
}
