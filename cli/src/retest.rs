//! `oomscope retest`: the launches. The baseline command first (it must
//! reproduce the fixture's failure, else the run stops and says so), then
//! each candidate change alone: launched under `oomscope run` (in a memory
//! cgroup with `--memory-limit`), ready within `--launch-timeout`, then the
//! smoke, the fixture's replay and a short overload burst (one probe run,
//! bounded by `--check-deadline`), then stopped. One server at a time, and
//! only servers it launched: an endpoint that answers before the baseline
//! starts stops the run. A launch that never becomes ready is one failed
//! row, never restarted. The table and the choice are
//! `oomscope_probe::retest`'s.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use oomscope_analysis::settings;
use oomscope_client::Client;
use oomscope_probe::fixture::Fixture;
use oomscope_probe::http::Endpoint;
use oomscope_probe::quality;
use oomscope_probe::report::ProbeReport;
use oomscope_probe::restart::ready;
use oomscope_probe::retest::{self, Retest, Row};
use oomscope_probe::watch::EvidenceSource;
use oomscope_probe::{progress, Probe, ProbeConfig};
use oomscope_proto::v1 as pb;

use crate::args::RetestArgs;
use crate::output::print_out;

/// How long a stopped server has after SIGTERM before its process group is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How often readiness is polled while a launch starts.
const READY_POLL: Duration = Duration::from_millis(200);
/// The overload burst's bounds: a short burst, enough to pass any admission
/// cap a fix might set, never a load test.
const MIN_BURST: usize = 8;
const MAX_BURST: usize = 64;
/// How long an overloaded request may wait before it counts as stuck in an
/// unbounded queue: a fix that caps sequences queues the rest, and a CPU
/// server behind a cap takes tens of seconds to serve a queue of short
/// requests; what retest checks is that the queue ends (served or refused).
const OVERLOAD_TIMEOUT: Duration = Duration::from_secs(60);

/// One launched server: `oomscope run` in a process group of its own.
struct Launch {
    child: Child,
}

impl Launch {
    fn start(
        a: &RetestArgs,
        name: &str,
        log: &str,
        command: &[String],
        env: &[(String, String)],
        unset: &[&str],
    ) -> anyhow::Result<Launch> {
        let exe = std::env::current_exe().context("finding oomscope itself")?;
        let mut c = Command::new(exe);
        c.args(["run", "--collector", &a.collector.collector, "--name", name]);
        if let Some(bytes) = a.memory_limit {
            c.args(["--memory-limit", &bytes.to_string()]);
        }
        c.arg("--").args(command);
        c.envs(env.iter().map(|(k, v)| (k, v)));
        for k in unset {
            c.env_remove(k);
        }
        match &a.logs {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("making {}", dir.display()))?;
                let path = dir.join(format!("{log}.log"));
                let f = std::fs::File::create(&path)
                    .with_context(|| format!("creating {}", path.display()))?;
                c.stdout(f.try_clone()?).stderr(f);
            }
            None => {
                c.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        c.process_group(0);
        Ok(Launch {
            child: c.spawn().context("launching oomscope run")?,
        })
    }

    /// Ready within `timeout`, or why not (it exited, or the time ran out).
    fn await_ready(&mut self, ep: &Endpoint, path: &str, timeout: Duration) -> Result<(), String> {
        let until = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!("the server exited before it was ready ({st})"));
            }
            if ready(ep, path) {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(format!(
                    "the server was not ready on {path} within {:.0} s",
                    timeout.as_secs_f64()
                ));
            }
            std::thread::sleep(READY_POLL);
        }
    }

    /// SIGTERM to the supervisor (it passes it on), then its whole group after the grace.
    fn stop(mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signals to the process (group) this run started.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let until = Instant::now() + STOP_GRACE;
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A launch's probe report and its quality answers (or why there are none).
type Checked = (ProbeReport, Result<Vec<quality::Answer>, String>);

/// How long a launch that died while starting waits for its incident at
/// the collector: `oomscope run` reports the death before it exits, so
/// this only covers the collector's filing of it.
const START_INCIDENT_WAIT: Duration = Duration::from_secs(5);

/// A launch that never became ready: why, and its incident's memory domain
/// and summary where the collector recorded one (a start-up OOM).
struct Unready {
    why: String,
    memory: Option<(String, String)>,
}

/// The memory incident of launch `name`, once the collector has filed one.
fn start_incident(a: &RetestArgs, name: &str) -> Option<(String, String)> {
    let mut client = Client::connect(&a.collector.collector).ok()?;
    let until = Instant::now() + START_INCIDENT_WAIT;
    loop {
        let found = client
            .incidents(pb::IncidentsRequest {
                agent: name.into(),
                ..Default::default()
            })
            .map(|r| r.incidents)
            .unwrap_or_default();
        if let Some(i) = found.iter().find(|i| retest::memory_domain(&i.domain)) {
            return Some((i.domain.clone(), format!("{}: {}", i.id, i.summary)));
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(READY_POLL);
    }
}

/// One launch with `command` (and `env`) checked: its probe report, or why it did not start.
fn check(
    a: &RetestArgs,
    fx: &Fixture,
    name: &str,
    command: &[String],
    env: &[(String, String)],
    unset: &[&str],
) -> anyhow::Result<Result<Checked, Unready>> {
    let ep = Endpoint::parse(&a.endpoint)?;
    let log = name.rsplit('-').next().unwrap_or(name);
    let mut launch = Launch::start(a, name, log, command, env, unset)?;
    if let Err(why) = launch.await_ready(&ep, &a.ready_path, a.launch_timeout) {
        launch.stop();
        let memory = start_incident(a, name);
        return Ok(Err(Unready { why, memory }));
    }
    // Before the fixture, which may kill it: the answers at a size that does not fail.
    let answers = quality::answers(&ep, None, a.launch_timeout);
    let mut cfg = ProbeConfig::new(&a.endpoint);
    cfg.fixture = Some(fx.clone());
    cfg.after_fixture = vec!["overload".into()];
    cfg.burst = Some(
        a.burst
            .unwrap_or((fx.concurrency * 2).clamp(MIN_BURST, MAX_BURST)),
    );
    cfg.overload_timeout = OVERLOAD_TIMEOUT.min(a.check_deadline);
    cfg.deadline = a.check_deadline;
    cfg.request_timeout = a.check_deadline.min(cfg.request_timeout * 2);
    cfg.collector = Some(a.collector.collector.clone());
    cfg.agent = Some(name.to_string());
    cfg.progress = progress::Mode::Quiet;
    cfg.ready_path = a.ready_path.clone();
    // The collector's evidence names the domain that bounded a failure (a cgroup's kill).
    let evidence = Client::connect(&a.collector.collector)
        .ok()
        .map(|c| Box::new(crate::probe::Collector(c)) as Box<dyn EvidenceSource>);
    let report = Probe::new(cfg, evidence).map(Probe::run);
    launch.stop();
    Ok(Ok((report?, answers)))
}

/// `SETTING=VALUE`.
fn parse_try(t: &str) -> anyhow::Result<(String, String)> {
    t.split_once('=')
        .filter(|(s, v)| !s.is_empty() && !v.is_empty())
        .map(|(s, v)| (s.to_string(), v.to_string()))
        .ok_or_else(|| anyhow::anyhow!("--try {t:?}: expected SETTING=VALUE"))
}

pub fn run(a: RetestArgs) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(&a.fixture)
        .with_context(|| format!("reading {}", a.fixture.display()))?;
    let fx = Fixture::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", a.fixture.display()))?;
    let runtime = settings::detect(&a.command);
    let mut candidates: Vec<(String, String)> = Vec::new();
    if let Some(inc) = &a.from {
        let mut client = Client::connect(&a.collector.collector)?;
        let d = client.diagnose(pb::DiagnoseRequest {
            incident: inc.clone(),
            ..Default::default()
        })?;
        candidates.extend(retest::candidates_from_fixes(
            d.fixes.iter().map(|f| f.action.as_str()),
            runtime,
            &fx,
        ));
    }
    for t in &a.tries {
        let c = parse_try(t)?;
        if !candidates.contains(&c) {
            candidates.push(c);
        }
    }
    if candidates.is_empty() {
        anyhow::bail!("no candidate change: give --try SETTING=VALUE or --from INCIDENT");
    }
    // Never a server it did not launch.
    let ep = Endpoint::parse(&a.endpoint)?;
    if ready(&ep, &a.ready_path) {
        anyhow::bail!(
            "something already answers at {}{}: retest launches its own server and touches no other",
            a.endpoint,
            a.ready_path
        );
    }
    let fixture_name = a.fixture.display().to_string();
    let mut t = Retest {
        schema: retest::SCHEMA.into(),
        fixture: format!("{fixture_name} ({})", fx.source),
        command: a.command.clone(),
        memory_limit: a.memory_limit.map(oomscope_analysis::units::bytes),
        baseline: Row::default(),
        rows: Vec::new(),
        chosen: None,
        why: None,
        regression: format!(
            "oomscope probe --endpoint {} --fixture {fixture_name}",
            a.endpoint
        ),
    };
    let tag = std::process::id();
    let requests = fx.requests.len() * fx.repeats;
    let (base, base_answers) = match check(
        &a,
        &fx,
        &format!("retest-{tag}-baseline"),
        &a.command,
        &[],
        &[],
    )? {
        Ok((r, answers)) => (Some(r), answers),
        // Died in memory while starting: the failure, reproduced at start.
        Err(Unready {
            why,
            memory: Some((domain, incident)),
        }) => {
            t.baseline = retest::died_at_start(
                "",
                "",
                runtime,
                requests,
                &domain,
                format!("{why}: {incident}"),
            );
            (None, Err("the baseline died while starting".to_string()))
        }
        Err(Unready { why, memory: None }) => {
            t.why = Some(format!("the baseline did not start: {why}"));
            return finish(&a, &t, 2);
        }
    };
    if let Some(base) = &base {
        t.baseline = retest::measured("", "", runtime, base);
    }
    if let (Some(why), Some(_)) = (&fx.at_start, &base) {
        // Its failure is at launch, and the unchanged command started.
        t.why = Some(format!(
            "the fixture does not reproduce: its failure is at launch ({why}), and the unchanged command started"
        ));
        return finish(&a, &t, 2);
    }
    if let Err(why) = &base_answers {
        t.baseline.quality_note = Some(why.clone());
    }
    if base.as_ref().is_some_and(|b| !retest::reproduced(b)) {
        t.why = Some(format!(
            "the fixture does not reproduce: the unchanged command answered {}/{} of its requests without a failure",
            t.baseline.answered, t.baseline.requests
        ));
        return finish(&a, &t, 2);
    }
    for (i, (setting, value)) in candidates.iter().enumerate() {
        let (command, env) = if setting.starts_with('-') {
            (retest::with_setting(&a.command, setting, value), vec![])
        } else {
            (a.command.clone(), vec![(setting.clone(), value.clone())])
        };
        // A flag for the knob a variable also sets: the variable would win.
        let unset: Vec<&str> = retest::displaced(setting, runtime)
            .into_iter()
            .filter(|v| std::env::var_os(v).is_some())
            .collect();
        let name = format!("retest-{tag}-{}", i + 1);
        let row = match check(&a, &fx, &name, &command, &env, &unset)? {
            Ok((r, answers)) => {
                let mut row = retest::measured(setting, value, runtime, &r);
                row.outcome = Some(retest::outcome(&t.baseline, &row, &r));
                match (&base_answers, answers) {
                    (Ok(b), Ok(c)) => {
                        let d = quality::compare(b, &c);
                        row.quality_note = d.note();
                        row.quality_drift = Some(d);
                    }
                    (Err(why), _) => row.quality_note = Some(format!("baseline: {why}")),
                    (_, Err(why)) => row.quality_note = Some(why),
                }
                row
            }
            // Died in memory while starting, as the baseline may have.
            Err(Unready {
                why,
                memory: Some((domain, incident)),
            }) => {
                let mut row = retest::died_at_start(
                    setting,
                    value,
                    runtime,
                    requests,
                    &domain,
                    format!("{why}: {incident}"),
                );
                row.outcome = Some(retest::start_outcome(&t.baseline, &row));
                row
            }
            Err(Unready { why, memory: None }) => {
                retest::failed_start(setting, value, runtime, why)
            }
        };
        t.rows.push(row);
    }
    match retest::choose(&mut t.rows) {
        Ok(i) => t.chosen = Some(format!("{}={}", t.rows[i].setting, t.rows[i].value)),
        Err(why) => t.why = Some(format!("no change qualifies: {why}")),
    }
    let code = if t.chosen.is_some() { 0 } else { 1 };
    finish(&a, &t, code)
}

/// The retests as an HTML section: the table, the choice, the regression test.
fn html_section(t: &Retest) -> String {
    use oomscope_report::escape::html as esc;
    let mut s = String::from("<section id=\"retest\"><h2>Retests</h2>\n");
    s += &format!(
        "<p>Fixture: {}<br>Command: <code>{}</code>{}</p>\n<table>\n<tr>",
        esc(&t.fixture),
        esc(&t.command.join(" ")),
        t.memory_limit
            .as_ref()
            .map(|m| format!("<br>Memory limit: {}", esc(m)))
            .unwrap_or_default()
    );
    for h in retest::HEADER {
        s += &format!("<th>{}</th>", esc(h));
    }
    s += "</tr>\n";
    for row in retest::table(t) {
        s += "<tr>";
        for c in row {
            s += &format!("<td>{}</td>", esc(&c));
        }
        s += "</tr>\n";
    }
    s += "</table>\n";
    for line in retest::closing(t).lines().filter(|l| !l.is_empty()) {
        s += &format!("<p>{}</p>\n", esc(line));
    }
    s + "</section>\n"
}

/// The page: the incident's report with the retests before its footer, or
/// the retests alone.
fn page(a: &RetestArgs, t: &Retest) -> anyhow::Result<String> {
    let section = html_section(t);
    if let Some(inc) = &a.from {
        let mut client = Client::connect(&a.collector.collector)?;
        let run = crate::report::fetch(&mut client, crate::report::Which::Incident(inc.clone()))?;
        let mut page = oomscope_report::html(&run);
        let at = page.rfind("<footer>").unwrap_or(page.len());
        page.insert_str(at, &section);
        return Ok(page);
    }
    Ok(format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>oomscope retest</title></head>\n<body>\n{section}</body>\n</html>\n"
    ))
}

fn finish(a: &RetestArgs, t: &Retest, code: i32) -> anyhow::Result<i32> {
    if let Some(path) = &a.html {
        std::fs::write(path, page(a, t)?).with_context(|| format!("writing {}", path.display()))?;
    }
    let out = if a.json {
        serde_json::to_string_pretty(t)? + "\n"
    } else if a.md {
        retest::markdown(t)
    } else {
        retest::text(t)
    };
    print_out(&out)?;
    Ok(code)
}
