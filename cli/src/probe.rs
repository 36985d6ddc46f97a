//! `oomscope probe`: parse the knobs, run the suites, print the envelope.

use std::io::IsTerminal;

use anyhow::Context;

use oomscope_client::Client;
use oomscope_probe::watch::EvidenceSource;
use oomscope_probe::{compare, progress, report, Probe, ProbeConfig, Suite};
use oomscope_proto::v1 as pb;

use crate::args::{ProbeArgs, SuiteArg};

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

    fn diagnose_incident(&mut self, incident: &str) -> Option<pb::Diagnosis> {
        let req = pb::DiagnoseRequest {
            incident: incident.to_string(),
            ..Default::default()
        };
        self.0.diagnose(req).ok()
    }

    fn agents(&mut self) -> Vec<pb::AgentSummary> {
        self.0.agents().map(|r| r.agents).unwrap_or_default()
    }
}

pub fn run(a: ProbeArgs) -> anyhow::Result<i32> {
    let mut cfg = ProbeConfig::new(&a.endpoint);
    cfg.model = a.model;
    cfg.collector = a.collector;
    cfg.agent = a.agent;
    cfg.suites = a.suite.iter().map(|s| s.0.name().to_string()).collect();
    if !a.suite.iter().any(|s| s.0 == Suite::Smoke) {
        // The tiny known-good request always runs first: without it a failure is not a capacity claim.
        cfg.suites.insert(0, Suite::Smoke.name().into());
    }
    // The knobs' defaults are clap's, taken from ProbeConfig::new (see args.rs).
    cfg.api = a.api.into();
    cfg.api_key = a.api_key;
    cfg.ca_cert = a.ca_cert;
    cfg.max_context = a.max_context;
    cfg.min_context = a.min_context;
    cfg.typical_context = a.typical_context;
    cfg.shared_prefix = a.shared_prefix;
    cfg.output_tokens = a.output_tokens;
    cfg.max_concurrency = a.max_concurrency;
    cfg.latency_bound = a.latency_bound;
    cfg.request_timeout = a.request_timeout;
    cfg.repeat = a.repeat;
    cfg.burst = a.burst;
    cfg.overload_context = a.overload_context;
    cfg.overload_timeout = a.overload_timeout;
    cfg.suite_budget = a.suite_budget;
    cfg.seed = a.seed;
    // The command after `--`, word for word, as `oomscope run` takes it.
    cfg.launch = a.launch.then_some(a.command);
    cfg.ready_path = a.ready_path;
    cfg.restart_settings.herd = a.restart_herd;
    cfg.progress = if a.quiet {
        progress::Mode::Quiet
    } else if std::io::stderr().is_terminal() {
        progress::Mode::Terminal
    } else {
        progress::Mode::Plain
    };
    if a.suite.contains(&SuiteArg(Suite::Restart)) && cfg.launch.is_none() {
        anyhow::bail!("the restart suite launches the server itself: add --launch -- CMD ARGS");
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
    Ok(report::exit_code(&r.verdict))
}
