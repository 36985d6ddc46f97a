//! `oomscope probe`: a capacity and regression harness against a live
//! OpenAI-compatible completions endpoint. "One request passed" is not
//! capacity: the probe reproduces safely (a tiny known-good request first),
//! ramps one variable at a time, and reports a safe envelope whose figures
//! each name the memory domain that bounds them, with the collector's
//! evidence. Every suite is bounded in requests and time and talks only to
//! the endpoint it was given.

pub mod compare;
pub mod http;
pub mod load;
pub mod report;
pub mod restart;
mod suites;
pub mod watch;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;

use http::Endpoint;
use report::{Envelope, ProbeReport, Status, SuiteReport};
use watch::{EvidenceSource, Watch};

pub use oomscope_proto::v1 as pb;

/// One of the probe's suites, in the order a run takes them. Its name is
/// what `--suite` takes and what the JSON report's `suite` field says, so
/// the names are part of the `oomscope.probe/v1` schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Suite {
    Smoke,
    LongContext,
    Concurrency,
    Repeated,
    Overload,
    Restart,
}

impl Suite {
    pub const ALL: [Suite; 6] = [
        Suite::Smoke,
        Suite::LongContext,
        Suite::Concurrency,
        Suite::Repeated,
        Suite::Overload,
        Suite::Restart,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Suite::Smoke => "smoke",
            Suite::LongContext => "long-context",
            Suite::Concurrency => "concurrency",
            Suite::Repeated => "repeated",
            Suite::Overload => "overload",
            Suite::Restart => "restart",
        }
    }

    /// What the suite does, in one line (the CLI's help lists it).
    pub const fn about(self) -> &'static str {
        match self {
            Suite::Smoke => "one tiny known-good request, always run first: its failure is the environment, never capacity",
            Suite::LongContext => "ramp the prompt at concurrency 1 until a failure or --max-context",
            Suite::Concurrency => "ramp concurrent requests at --typical-context (then at the max context found) until a failure, --latency-bound or --max-concurrency",
            Suite::Repeated => "--repeat identical requests; the collector's leak verdict says whether memory grew per request",
            Suite::Overload => "a burst above capacity: requests must be answered or quickly refused, never queued without bound",
            Suite::Restart => "launch the server (--launch), kill it under load, and check readiness gating, a gradual restore and idempotency",
        }
    }
}

impl std::fmt::Display for Suite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Suite {
    type Err = String;
    fn from_str(s: &str) -> Result<Suite, String> {
        Suite::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| format!("unknown suite `{s}` (the suites: {})", SUITES.join(",")))
    }
}

/// The suites' names, in run order.
pub const SUITES: [&str; 6] = {
    let mut names = [""; 6];
    let mut i = 0;
    while i < names.len() {
        names[i] = Suite::ALL[i].name();
        i += 1;
    }
    names
};

/// Every knob, with the default and why.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    pub endpoint: String,
    pub model: Option<String>,
    pub collector: Option<String>,
    /// The server's agent name at the collector (for memory and verdicts).
    pub agent: Option<String>,
    /// Suite names (see [`Suite`]); by default all but restart, which
    /// launches the server itself and so needs `launch`.
    pub suites: Vec<String>,
    /// Long-context ramp: from 64 words, doubling, up to 8192 (a common
    /// serving limit); raise it for long-context models.
    pub min_context: usize,
    pub max_context: usize,
    /// The "typical" context for the concurrency ramp: 256 words, a chat turn.
    pub typical_context: usize,
    /// Tokens generated per request: 16 keeps each step short while still
    /// exercising decode (KV growth per generated token).
    pub output_tokens: usize,
    /// The concurrency ramp stops at 64 unless a failure or the latency bound comes first.
    pub max_concurrency: usize,
    /// A step whose p99 exceeds this is past capacity even without a failure.
    pub latency_bound: Duration,
    pub request_timeout: Duration,
    /// Repeated suite: 40 requests (enough for the leak analysis's robust slope) at concurrency 1.
    pub repeat: usize,
    pub repeat_concurrency: usize,
    /// Overload burst size; default 4x the concurrency found (16..=256).
    pub burst: Option<usize>,
    pub overload_context: usize,
    /// An overloaded request that neither succeeds nor is refused within this waited in an unbounded queue.
    pub overload_timeout: Duration,
    /// A refusal slower than this is not "quick".
    pub refuse_bound: Duration,
    /// Each suite's wall-clock budget.
    pub suite_budget: Duration,
    /// How long to let the agent's last messages reach the collector before asking it.
    pub settle: Duration,
    /// Restart suite: the server command to launch under `oomscope run --restart`.
    pub launch: Option<Vec<String>>,
    pub ready_path: String,
    pub restart_settings: restart::RestartConfig,
}

impl ProbeConfig {
    pub fn new(endpoint: &str) -> Self {
        ProbeConfig {
            endpoint: endpoint.to_string(),
            model: None,
            collector: None,
            agent: None,
            suites: SUITES[..5].iter().map(|s| s.to_string()).collect(),
            min_context: 64,
            max_context: 8192,
            typical_context: 256,
            output_tokens: 16,
            max_concurrency: 64,
            latency_bound: Duration::from_secs(30),
            request_timeout: Duration::from_secs(60),
            repeat: 40,
            repeat_concurrency: 1,
            burst: None,
            overload_context: 256,
            overload_timeout: Duration::from_secs(10),
            refuse_bound: Duration::from_secs(1),
            suite_budget: Duration::from_secs(300),
            settle: Duration::from_millis(700),
            launch: None,
            ready_path: "/health".into(),
            restart_settings: restart::RestartConfig::default(),
        }
    }
}

/// Labels that name a process rather than configure it.
const IDENTITY_LABELS: [&str; 5] = [
    "supervisor_agent",
    "parent_pid",
    "pid",
    "self_pid",
    "capture_file",
];
/// Flags that say where a server listens or reports, not how it serves.
const ADDRESS_FLAGS: [&str; 7] = [
    "port",
    "port-file",
    "host",
    "listen",
    "collector",
    "name",
    "bind",
];

/// A server command line as settings, one per flag, so that a retest that
/// changes two flags is seen as two changed variables: `--max-active 4` is
/// `server.--max-active = 4`, a bare `--no-idempotency` is `= true`, and the
/// program with its positional arguments is `server.command`.
pub fn command_settings(cmd: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut positional = Vec::new();
    let mut i = 0;
    while i < cmd.len() {
        let a = &cmd[i];
        if let Some(flag) = a.strip_prefix("--").filter(|f| !f.is_empty()) {
            let name = flag.split('=').next().unwrap_or(flag);
            if ADDRESS_FLAGS.contains(&name) {
                // Where the server listens or reports is not a variable of the workload.
                i += if flag.contains('=') || cmd.get(i + 1).is_none_or(|n| n.starts_with("--")) {
                    1
                } else {
                    2
                };
                continue;
            }
            if let Some((k, v)) = flag.split_once('=') {
                out.insert(format!("server.--{k}"), v.to_string());
            } else if cmd.get(i + 1).is_some_and(|n| !n.starts_with("--")) {
                out.insert(format!("server.--{flag}"), cmd[i + 1].clone());
                i += 1;
            } else {
                out.insert(format!("server.--{flag}"), "true".into());
            }
        } else {
            positional.push(a.clone());
        }
        i += 1;
    }
    if !positional.is_empty() {
        out.insert("server.command".into(), positional.join(" "));
    }
    out
}

pub struct Probe {
    pub ep: Endpoint,
    pub cfg: ProbeConfig,
    pub watch: Option<Watch>,
    /// The server this probe started (--launch), stopped when the run ends.
    launched: Option<restart::Launched>,
}

impl Probe {
    /// A probe of `cfg.endpoint`; with `evidence` and `cfg.agent`, each step
    /// also reads the agent's memory from the collector.
    pub fn new(cfg: ProbeConfig, evidence: Option<Box<dyn EvidenceSource>>) -> Result<Probe> {
        for s in &cfg.suites {
            s.parse::<Suite>().map_err(anyhow::Error::msg)?;
        }
        let ep = Endpoint::parse(&cfg.endpoint)?;
        let watch = match (evidence, &cfg.agent) {
            (Some(source), Some(agent)) => Some(Watch::new(source, agent)),
            _ => None,
        };
        Ok(Probe {
            ep,
            cfg,
            watch,
            launched: None,
        })
    }

    fn wants(&self, s: &str) -> bool {
        self.cfg.suites.iter().any(|x| x == s)
    }

    /// What this run (and the server, as its agent said in its Hello) was configured with.
    fn settings(&mut self) -> BTreeMap<String, String> {
        let c = &self.cfg;
        let mut s = BTreeMap::new();
        s.insert("probe.max_context".into(), c.max_context.to_string());
        s.insert(
            "probe.typical_context".into(),
            c.typical_context.to_string(),
        );
        s.insert("probe.output_tokens".into(), c.output_tokens.to_string());
        s.insert(
            "probe.max_concurrency".into(),
            c.max_concurrency.to_string(),
        );
        if let Some(m) = &c.model {
            s.insert("model".into(), m.clone());
        }
        if let Some(h) = self.watch.as_mut().and_then(|w| w.hello()) {
            for (k, v) in h
                .labels
                .into_iter()
                .filter(|(k, _)| !IDENTITY_LABELS.contains(&k.as_str()))
            {
                s.insert(format!("server.{k}"), v);
            }
            if let Some(a) = h.allocator_settings {
                s.insert("server.alloc_conf".into(), a.alloc_conf);
            }
            for m in h.models {
                s.insert(
                    "server.model".into(),
                    format!("{} {} {} {}", m.name, m.revision, m.dtype, m.quantization)
                        .trim()
                        .to_string(),
                );
            }
            s.extend(command_settings(&h.command));
        }
        s
    }

    pub fn run(mut self) -> ProbeReport {
        let started_ns = oomscope_proto::now_ns();
        let t = Instant::now();
        let mut suites: Vec<SuiteReport> = Vec::new();
        let mut warnings = Vec::new();
        if let Some(cmd) = self.cfg.launch.clone() {
            match self.launch(&cmd) {
                Ok(l) => self.launched = Some(l),
                Err(e) => warnings.push(format!("--launch failed: {e:#}")),
            }
        }
        let settings = self.settings();
        if self.watch.is_none() {
            warnings.push("no --collector/--agent: figures are bounded by what the endpoint answered, without memory evidence".into());
        }

        let smoke = self.smoke();
        let smoke_ok = smoke.status == Status::Pass;
        suites.push(smoke);
        let skip = |name: &str| SuiteReport {
            suite: name.into(),
            status: Status::Skipped,
            verdict: "not run: the smoke test failed, so no capacity claim is made".into(),
            reason: None,
            steps: vec![],
            findings: serde_json::json!({}),
            duration_s: 0.0,
        };
        let mut envelope: Option<Envelope> = None;
        let mut max_ctx_fig = None;
        let mut conc_fig = None;
        let wanted: Vec<&str> = SUITES[1..]
            .iter()
            .copied()
            .filter(|s| self.wants(s))
            .collect();
        for name in wanted {
            if !smoke_ok {
                suites.push(skip(name));
                continue;
            }
            match name {
                "long-context" => {
                    let (r, f) = self.long_context();
                    max_ctx_fig = Some(f);
                    suites.push(r);
                }
                "concurrency" => {
                    let typical = self.cfg.typical_context;
                    let (r, f) = self.concurrency_at("concurrency", typical);
                    conc_fig = Some(f);
                    suites.push(r);
                    if let Some(mc) = max_ctx_fig.as_ref().and_then(|f| f.value) {
                        let words = (mc as usize).max(1);
                        let (r2, f2) = self.concurrency_at("concurrency-at-max-context", words);
                        suites.push(r2);
                        envelope
                            .get_or_insert_with(Envelope::default)
                            .max_concurrency_at_max_context = f2;
                    }
                }
                "repeated" => suites.push(self.repeated()),
                "overload" => {
                    let cap = conc_fig.as_ref().and_then(|f| f.value);
                    suites.push(self.overload(cap));
                }
                "restart" => suites.push(self.restart()),
                _ => {}
            }
        }
        if max_ctx_fig.is_some() || conc_fig.is_some() {
            let e = envelope.get_or_insert_with(Envelope::default);
            if let Some(f) = max_ctx_fig {
                e.max_context_at_concurrency_1 = f;
            }
            if let Some(f) = conc_fig {
                e.max_concurrency_at_typical_context = f;
            }
        }
        if let Some(l) = self.launched.take() {
            l.stop();
        }
        let verdict = if !smoke_ok {
            "environment"
        } else if suites.iter().any(|s| {
            matches!(s.suite.as_str(), "overload" | "restart" | "repeated")
                && s.status == Status::Fail
        }) {
            "unsafe"
        } else if suites.iter().any(|s| s.status == Status::Error) {
            "incomplete"
        } else {
            "ok"
        };
        ProbeReport {
            schema: report::SCHEMA.into(),
            endpoint: self.cfg.endpoint.clone(),
            model: self.cfg.model.clone(),
            agent: self.cfg.agent.clone(),
            started_ns,
            duration_s: t.elapsed().as_secs_f64(),
            settings,
            verdict: verdict.into(),
            suites,
            envelope,
            warnings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{command_settings, Suite, SUITES};

    #[test]
    fn suite_names_round_trip_in_run_order() {
        assert_eq!(
            SUITES,
            [
                "smoke",
                "long-context",
                "concurrency",
                "repeated",
                "overload",
                "restart"
            ]
        );
        for s in Suite::ALL {
            assert_eq!(s.name().parse::<Suite>(), Ok(s));
        }
        assert!("bogus"
            .parse::<Suite>()
            .unwrap_err()
            .contains("smoke,long-context"));
    }

    #[test]
    fn a_command_line_becomes_one_setting_per_flag() {
        let cmd: Vec<String> = "python server.py --port 8000 --max-active 4 --no-idempotency --restore-seconds=2 --port-file=/x"
            .split(' ')
            .map(str::to_string)
            .collect();
        let s = command_settings(&cmd);
        assert_eq!(s["server.command"], "python server.py");
        assert_eq!(s["server.--max-active"], "4");
        assert_eq!(s["server.--no-idempotency"], "true");
        assert_eq!(s["server.--restore-seconds"], "2");
        assert_eq!(
            s.len(),
            4,
            "--port and --port-file are addresses, not settings: {s:?}"
        );
    }
}
