//! `oomscope probe`: parse the knobs, run the suites, print the envelope.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;

use oomscope_agent_core::agent::Identity;
use oomscope_agent_core::readers::{HostPaths, HostReader};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_client::Client;
use oomscope_probe::fixture::{self, Fixture};
use oomscope_probe::watch::EvidenceSource;
use oomscope_probe::workload::WorkloadSink;
use oomscope_probe::{baseline, progress, report, Probe, ProbeConfig, Suite};
use oomscope_proto::v1 as pb;

use crate::args::{ProbeArgs, SuiteArg};
use crate::output::print_out;

/// The probe's evidence, asked of the collector over its QueryService.
/// A failed query is no evidence: the probe says "not measured".
pub(crate) struct Collector(pub(crate) Client);

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

/// How long the probe's workload stream may take to deliver what it holds
/// at the end (its Goodbye included).
pub const WORKLOAD_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the context of requests still in flight is sent again: the
/// collector joins a context to a server's samples for a few seconds only,
/// and a long prompt can take longer than that.
pub const WORKLOAD_HEARTBEAT: Duration = Duration::from_secs(1);

/// The probe's requests on an agent stream of their own, a member (role
/// `probe`) of the probed server's instance: the workload context of a
/// server with no in-process agent. `Reporter` queues without blocking, so
/// request threads never wait on the network.
struct WorkloadStream {
    reporter: Arc<Reporter>,
    /// The latest context, for the heartbeat.
    last: Arc<Mutex<pb::RequestContext>>,
}

impl WorkloadSink for WorkloadStream {
    fn context(&self, time_ns: i64, context: pb::RequestContext) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = context.clone();
        send_context(&self.reporter, time_ns, context);
    }

    fn boundary(&self, time_ns: i64, boundary: pb::RequestBoundary) {
        self.reporter.send_event(pb::Event {
            time_ns,
            kind: Some(pb::event::Kind::Request(boundary)),
        });
    }
}

fn send_context(reporter: &Reporter, time_ns: i64, context: pb::RequestContext) {
    reporter.send_sample(pb::Sample {
        time_ns,
        context: Some(context),
        ..Default::default()
    });
}

/// Resends the context every [`WORKLOAD_HEARTBEAT`] while requests are in
/// flight, until `stop`. None when no thread could be started: the context
/// then goes only at each change.
fn heartbeat(
    reporter: Arc<Reporter>,
    last: Arc<Mutex<pb::RequestContext>>,
    stop: Arc<AtomicBool>,
) -> Option<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("oomscope-probe-heartbeat".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::park_timeout(WORKLOAD_HEARTBEAT);
                let c = last.lock().unwrap_or_else(|p| p.into_inner()).clone();
                if c.active_sequences > 0 && !stop.load(Ordering::Relaxed) {
                    send_context(&reporter, oomscope_proto::now_ns(), c);
                }
            }
        })
        .map_err(|e| eprintln!("oomscope probe: no heartbeat for the workload stream: {e}"))
        .ok()
}

/// The instance that `agent` (an agent id or a name: its newest instance)
/// belongs to at the collector, and the name it goes by.
fn instance_of(client: &mut Client, agent: &str) -> Option<(String, String)> {
    let agents = client.agents().ok()?.agents;
    agents
        .iter()
        .filter(|a| {
            a.hello.as_ref().is_some_and(|h| {
                (h.agent_id == agent || h.name == agent || a.instance == agent)
                    && h.role != oomscope_proto::Role::Probe
            })
        })
        .max_by_key(|a| a.first_seen_ns)
        .map(|a| {
            let name = a
                .hello
                .as_ref()
                .map_or_else(String::new, |h| h.name.clone());
            (a.instance.clone(), name)
        })
}

/// Opens the probe's workload stream into `agent`'s instance; None (with a
/// line on stderr) when the collector does not know the agent.
fn workload_stream(url: &str, agent: &str) -> anyhow::Result<Option<Arc<Reporter>>> {
    let mut client = Client::connect(url)?;
    let Some((instance, name)) = instance_of(&mut client, agent) else {
        eprintln!(
            "oomscope probe: the collector knows no agent {agent:?} yet; the probe's requests are not recorded as its workload"
        );
        return Ok(None);
    };
    let me = HostReader::new(HostPaths::system(), std::process::id());
    let mut hello = Identity {
        name: format!("{name}{}", oomscope_proto::PROBE_NAME_SUFFIX),
        role: oomscope_proto::Role::Probe.into(),
        rank: 0,
        runtime: oomscope_proto::PROBE_ROLE.into(),
    }
    .hello(&me);
    hello.instance = instance;
    let reporter = Reporter::start(
        ReporterConfig {
            collector_url: url.to_string(),
            ..ReporterConfig::default()
        },
        hello,
    );
    Ok(Some(Arc::new(reporter)))
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
    cfg.stream = a.stream.into();
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
    cfg.deadline = a.deadline;
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
    if let Some(p) = &a.fixture {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        cfg.fixture =
            Some(Fixture::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?);
    }
    let output_tokens = cfg.output_tokens as u64;
    let evidence: Option<Box<dyn EvidenceSource>> = match (&cfg.collector, &cfg.agent) {
        (Some(url), Some(_)) => Some(Box::new(Collector(Client::connect(url)?))),
        _ => None,
    };
    let stream = match (&cfg.collector, &cfg.agent) {
        (Some(url), Some(agent)) => workload_stream(url, agent)?,
        _ => None,
    };
    let mut probe = Probe::new(cfg, evidence)?;
    let stop = Arc::new(AtomicBool::new(false));
    let beat = stream.as_ref().and_then(|reporter| {
        let last = Arc::new(Mutex::new(pb::RequestContext::default()));
        probe.report_workload(Box::new(WorkloadStream {
            reporter: reporter.clone(),
            last: last.clone(),
        }));
        heartbeat(reporter.clone(), last, stop.clone())
    });
    let r = probe.run();
    if let Some(beat) = beat {
        stop.store(true, Ordering::Relaxed);
        beat.thread().unpark();
        let _ = beat.join();
    }
    // The probe, its sink and the heartbeat are gone: the stream is ours to end.
    if let Some(reporter) = stream.and_then(|s| Arc::try_unwrap(s).ok()) {
        let bye = pb::Goodbye {
            reason: "probe finished".into(),
            exit_code: 0,
        };
        if !reporter.shutdown(bye, WORKLOAD_FLUSH_TIMEOUT) {
            eprintln!(
                "oomscope probe: the collector did not take all of the probe's workload in time"
            );
        }
    }
    if let Some(p) = &a.fixture_out {
        match fixture::from_report(&r, output_tokens) {
            Some(f) => {
                std::fs::write(p, serde_json::to_string_pretty(&f)? + "\n")
                    .with_context(|| format!("writing {}", p.display()))?;
                eprintln!("oomscope probe: wrote the fixture of {} to {}", f.source, p.display());
            }
            None => eprintln!(
                "oomscope probe: no suite step failed on the server's side: no fixture written to {}",
                p.display()
            ),
        }
    }
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        if let Some(b) = &baseline {
            v["comparison"] = serde_json::to_value(baseline::compare(b, &r))?;
        }
        print_out(&format!("{}\n", serde_json::to_string_pretty(&v)?))?;
    } else {
        let mut text = report::text(&r);
        if let Some(b) = &baseline {
            text += &format!("Compared with {}:\n", a.compare.as_ref().unwrap().display());
            text += &baseline::text(&baseline::compare(b, &r));
        }
        print_out(&text)?;
    }
    Ok(report::exit_code(&r.verdict))
}
