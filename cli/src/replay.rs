//! `oomscope replay`: the verb over `oomscope_replay::driver`, which feeds a
//! capture through the same reporter a live agent uses.

use std::path::Path;
use std::time::Duration;

use oomscope_replay::driver;

pub fn run(
    file: &Path,
    collector_url: &str,
    name: Option<String>,
    speed: f64,
    timeout: Duration,
) -> anyhow::Result<i32> {
    let r = driver::replay(file, collector_url, name, speed, timeout)?;
    if !r.acked {
        eprintln!(
            "oomscope replay: {} was not fully acked by {collector_url} within {:.0} s",
            file.display(),
            timeout.as_secs_f64()
        );
        return Ok(1);
    }
    crate::output::print_out(&format!(
        "replayed {} ({}): {} samples, {} events as agent {}\n",
        file.display(),
        r.scenario,
        r.samples,
        r.events,
        r.agent_id
    ))?;
    Ok(0)
}
