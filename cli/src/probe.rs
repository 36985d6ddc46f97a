//! `oomscope probe`: parse the knobs, run the suites, print the envelope.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use oomscope_client::Client;
use oomscope_probe::watch::EvidenceSource;
use oomscope_probe::{compare, report, Probe, ProbeConfig};
use oomscope_proto::v1 as pb;

/// The probe's evidence, asked of the collector over its QueryService.
/// A failed query is no evidence: the probe says "not measured".
struct Collector(Client);

impl EvidenceSource for Collector {
    fn timeline(&mut self, agent: &str, from_ns: i64) -> Option<pb::TimelineResponse> {
        let req = pb::TimelineRequest {
            agent: agent.to_string(),
            from_ns,
            to_ns: 0,
            max_points: 0,
        };
        self.0.timeline(req).ok()
    }

    fn incidents(&mut self) -> Vec<pb::Incident> {
        self.0
            .incidents(pb::IncidentsRequest::default())
            .map(|r| r.incidents)
            .unwrap_or_default()
    }

    fn diagnose(&mut self, agent: &str, from_ns: i64) -> Option<pb::Diagnosis> {
        let req = pb::DiagnoseRequest {
            incident: String::new(),
            agent: agent.to_string(),
            from_ns,
            to_ns: 0,
        };
        self.0.diagnose(req).ok()
    }

    fn agents(&mut self) -> Vec<pb::AgentSummary> {
        self.0.agents().map(|r| r.agents).unwrap_or_default()
    }
}

/// The probe's command-line knobs (defaults and their reasons live in `ProbeConfig::new`).
#[derive(clap::Args)]
pub struct ProbeArgs {
    /// The OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    #[arg(long)]
    endpoint: String,
    /// The model name to request (default: the server's default).
    #[arg(long)]
    model: Option<String>,
    /// The collector that the server's agent reports to (memory per step, verdicts).
    #[arg(long, env = "OOMSCOPE_COLLECTOR")]
    collector: Option<String>,
    /// The server's agent name at the collector.
    #[arg(long)]
    agent: Option<String>,
    /// Comma-separated suites: smoke,long-context,concurrency,repeated,overload,restart
    /// (default: all but restart, which needs --launch).
    #[arg(long, value_delimiter = ',')]
    suite: Vec<String>,
    #[arg(long)]
    max_context: Option<usize>,
    #[arg(long)]
    min_context: Option<usize>,
    #[arg(long)]
    typical_context: Option<usize>,
    #[arg(long)]
    output_tokens: Option<usize>,
    #[arg(long)]
    max_concurrency: Option<usize>,
    #[arg(long, value_parser = super::parse_duration)]
    latency_bound: Option<Duration>,
    #[arg(long, value_parser = super::parse_duration)]
    request_timeout: Option<Duration>,
    #[arg(long)]
    repeat: Option<usize>,
    #[arg(long)]
    burst: Option<usize>,
    #[arg(long)]
    overload_context: Option<usize>,
    #[arg(long, value_parser = super::parse_duration)]
    overload_timeout: Option<Duration>,
    /// Each suite's time budget.
    #[arg(long, value_parser = super::parse_duration)]
    suite_budget: Option<Duration>,
    /// Restart suite: the server command, launched under `oomscope run --restart`
    /// (one string, split on spaces).
    #[arg(long)]
    launch: Option<String>,
    /// The readiness path on the server's host (200 = ready).
    #[arg(long, default_value = "/health")]
    ready_path: String,
    #[arg(long)]
    restart_herd: Option<usize>,
    /// Compare with an earlier `probe --json` report: what moved, and whether
    /// more than one setting differs.
    #[arg(long)]
    compare: Option<PathBuf>,
    /// Print the report as JSON (schema oomscope.probe/v1).
    #[arg(long)]
    json: bool,
}

pub fn run(a: ProbeArgs) -> anyhow::Result<i32> {
    let mut cfg = ProbeConfig::new(&a.endpoint);
    cfg.model = a.model;
    cfg.collector = a.collector;
    cfg.agent = a.agent;
    if !a.suite.is_empty() {
        cfg.suites = a.suite;
        if !cfg.suites.iter().any(|s| s == "smoke") {
            // The tiny known-good request always runs first: without it a failure is not a capacity claim.
            cfg.suites.insert(0, "smoke".into());
        }
    }
    macro_rules! set {
        ($($f:ident),*) => { $( if let Some(v) = a.$f { cfg.$f = v; } )* };
    }
    set!(
        max_context,
        min_context,
        typical_context,
        output_tokens,
        max_concurrency,
        latency_bound,
        request_timeout,
        repeat,
        overload_context,
        overload_timeout,
        suite_budget
    );
    cfg.burst = a.burst;
    cfg.launch = a
        .launch
        .map(|l| l.split_whitespace().map(str::to_string).collect());
    cfg.ready_path = a.ready_path;
    if let Some(h) = a.restart_herd {
        cfg.restart_settings.herd = h;
    }
    if cfg.suites.iter().any(|s| s == "restart") && cfg.launch.is_none() {
        anyhow::bail!("the restart suite launches the server itself: add --launch \"CMD ARGS\"");
    }
    let baseline: Option<report::ProbeReport> = match &a.compare {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let r: report::ProbeReport = serde_json::from_str(&text).with_context(|| {
                format!("{} is not a `oomscope probe --json` report", p.display())
            })?;
            if r.schema != report::SCHEMA {
                anyhow::bail!(
                    "{} has schema {:?}; this oomscope reads {:?}",
                    p.display(),
                    r.schema,
                    report::SCHEMA
                );
            }
            Some(r)
        }
        None => None,
    };
    let evidence: Option<Box<dyn EvidenceSource>> = match (&cfg.collector, &cfg.agent) {
        (Some(url), Some(_)) => Some(Box::new(Collector(Client::connect(url)?))),
        _ => None,
    };
    let r = Probe::new(cfg, evidence)?.run();
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        if let Some(b) = &baseline {
            v["comparison"] = serde_json::to_value(compare::compare(b, &r))?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", report::text(&r));
        if let Some(b) = &baseline {
            println!("Compared with {}:", a.compare.as_ref().unwrap().display());
            print!("{}", compare::text(&compare::compare(b, &r)));
        }
    }
    // CI gates: 0 = ok, 1 = a suite failed (unsafe), 3 = environment (smoke failed), 4 = incomplete.
    Ok(match r.verdict.as_str() {
        "ok" => 0,
        "environment" => 3,
        "incomplete" => 4,
        _ => 1,
    })
}
