//! `oomscope probe`: a capacity and regression harness against a live
//! OpenAI-compatible endpoint. "One request passed" is not capacity: the
//! probe reproduces safely (a tiny known-good request first), ramps one
//! variable at a time in tokens as the server counts them, with a distinct
//! prompt for every request (no prefix cache answers for free), and reports
//! a safe envelope whose figures each name what bounds them, with the
//! collector's evidence. A claim needs its evidence; a suite whose budget
//! ran out is incomplete; a server that died during the probe makes the
//! verdict unsafe. Every suite is bounded in requests and time and talks
//! only to the endpoint it was given.

pub mod answer;
pub mod baseline;
pub mod calibrate;
mod clock;
pub mod concurrency;
pub mod fixture;
pub mod http;
pub mod idle;
pub mod load;
pub mod metrics;
pub mod pace;
pub mod progress;
pub mod quality;
pub mod report;
pub mod restart;
pub mod retest;
pub mod server;
mod suites;
pub mod tokens;
pub mod watch;
pub mod workload;

use std::collections::{BTreeMap, HashSet};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;

use http::Endpoint;
use load::Ask;
use progress::Progress;
use report::{Death, Envelope, Figure, ProbeReport, PromptStats, ServerFacts, Status, SuiteReport};
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

/// The default `--deadline`: the whole run ends within it (each rung's
/// requests are cut at it). The default suites' budgets add up to less, so
/// that a fast server's default run is never cut; a slow server's budgets
/// grow with its measured pace and share what the deadline leaves.
pub const DEFAULT_RUN_BUDGET: Duration = Duration::from_secs(600);

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
            Suite::LongContext => "ramp the prompt in tokens at concurrency 1 until a failure or --max-context, then bisect to within 5 % of the bound",
            Suite::Concurrency => "ramp concurrent requests at --typical-context tokens (then at the max context found) until a failure, --latency-bound or --max-concurrency; reports how many the server really had in service at once",
            Suite::Repeated => "--repeat distinct requests; the collector's leak verdict says whether memory grew per request",
            Suite::Overload => "a burst above capacity: requests must be answered or quickly refused, never queued without bound",
            Suite::Restart => "launch the server (--launch -- CMD), kill it under load, and check readiness gating, a gradual restore and idempotency",
        }
    }

    /// The suite's wall-clock budget unless `--suite-budget` sets one for
    /// all. The default suites' add up to under [`DEFAULT_RUN_BUDGET`]; the
    /// concurrency suite's applies to each of its two ramps. The smoke's is
    /// its own whatever `--suite-budget` says (its failure is the
    /// environment); the restart suite is bounded by its own timeouts
    /// (readiness, warm-up) instead, so [`Suite::budgeted`] is false for it.
    pub const fn default_budget(self) -> Duration {
        Duration::from_secs(match self {
            Suite::Smoke => 30,
            Suite::LongContext => 120,
            Suite::Concurrency => 90,
            Suite::Repeated => 90,
            Suite::Overload => 60,
            Suite::Restart => 180,
        })
    }
}

impl Suite {
    /// Whether `--suite-budget` (or the default budget) bounds the suite.
    pub const fn budgeted(self) -> bool {
        !matches!(self, Suite::Smoke | Suite::Restart)
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

/// Which API `--api` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiChoice {
    /// /v1/completions where the server offers it, else /v1/chat/completions.
    Auto,
    Completions,
    Chat,
}

/// How long the probe waits for the collector to record a death it saw as
/// a refused connection: the supervisor reads the kernel's record and the
/// exit before it reports them.
pub const DEATH_EVIDENCE_WAIT: Duration = Duration::from_secs(5);

/// The concurrency ramp at the max context sends prompts this share below
/// the max context found: distinct prompts sized alike vary by a few tokens,
/// and at the bound itself some would go over it (seen on vLLM: 2049 of a
/// 2048-token model).
pub const MAX_CONTEXT_MARGIN: f64 = 0.02;

/// The long-context figure is bisected until it is within this share of
/// the true bound.
pub const DEFAULT_CONTEXT_TOLERANCE: f64 = 0.05;

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
    /// Completions, chat, or whichever the server offers (completions first).
    pub api: ApiChoice,
    /// Sent as `Authorization: Bearer` to the endpoint, and nowhere else.
    pub api_key: Option<String>,
    /// Trust this PEM file's certificates instead of the built-in roots.
    pub ca_cert: Option<PathBuf>,
    /// Long-context ramp, in tokens: from 64, doubling, up to 8192 (a common
    /// serving limit, and the server's own max_model_len where it is lower);
    /// raise it for long-context models.
    pub min_context: usize,
    pub max_context: usize,
    pub context_tolerance: f64,
    /// The "typical" context for the concurrency ramp: 256 tokens, a chat turn.
    pub typical_context: usize,
    /// Every prompt starts with the same this-many tokens: the prefix-cached
    /// case, measured on purpose (by default every prompt is distinct).
    pub shared_prefix: Option<usize>,
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
    /// Overload prompts, in tokens.
    pub overload_context: usize,
    /// An overloaded request that neither succeeds nor is refused within this waited in an unbounded queue.
    pub overload_timeout: Duration,
    /// A refusal slower than this is not "quick".
    pub refuse_bound: Duration,
    /// A cap on every suite's budget; None: each suite's
    /// [`Suite::default_budget`], longer where the server's measured pace
    /// says its requests need more (see [`pace`]).
    pub suite_budget: Option<Duration>,
    /// The whole run ends within this: suites share what is left of it, and
    /// a figure it cut is a lower bound that says so.
    pub deadline: Duration,
    /// How long to let the agent's last messages reach the collector before asking it.
    pub settle: Duration,
    /// Restart suite: the server command to launch under `oomscope run --restart`.
    pub launch: Option<Vec<String>>,
    pub ready_path: String,
    pub restart_settings: restart::RestartConfig,
    /// Progress on stderr.
    pub progress: progress::Mode,
    /// The prompts' seed (default: the clock, so two runs send different prompts).
    pub seed: Option<u64>,
    /// How often the server's metrics are read during a step.
    pub metrics_poll: Duration,
    /// Stream requests: auto (where the server streams and counts tokens
    /// without a non-streamed answer), on or off; chosen once per run.
    pub stream: calibrate::StreamChoice,
    /// Replay this fixture after the smoke instead of the suites: the
    /// regression check that a failure does not come back.
    pub fixture: Option<fixture::Fixture>,
    /// With a fixture: the suites that run after it (retest's overload
    /// burst); none for the regression check.
    pub after_fixture: Vec<String>,
}

impl ProbeConfig {
    pub fn new(endpoint: &str) -> Self {
        ProbeConfig {
            endpoint: endpoint.to_string(),
            model: None,
            collector: None,
            agent: None,
            suites: SUITES[..5].iter().map(|s| s.to_string()).collect(),
            api: ApiChoice::Auto,
            api_key: None,
            ca_cert: None,
            min_context: 64,
            max_context: 8192,
            context_tolerance: DEFAULT_CONTEXT_TOLERANCE,
            typical_context: 256,
            shared_prefix: None,
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
            suite_budget: None,
            deadline: DEFAULT_RUN_BUDGET,
            settle: Duration::from_millis(700),
            launch: None,
            ready_path: "/health".into(),
            restart_settings: restart::RestartConfig::default(),
            progress: progress::Mode::Quiet,
            seed: None,
            metrics_poll: metrics::DEFAULT_POLL,
            stream: calibrate::StreamChoice::Auto,
            fixture: None,
            after_fixture: Vec::new(),
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

/// Splits a shell script's words (single and double quotes, backslashes),
/// enough for `sh -c "python server.py --max-active 4"`.
fn shell_words(script: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = script.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') => cur.extend(chars.next()),
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, '\\') => {
                cur.extend(chars.next());
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

/// A command as the words the server runs: `sh -c SCRIPT` (or `bash -c`)
/// read from its script, with `exec`, `env` and `VAR=value` before the
/// program taken off (the variables come back as the environment).
fn unwrap_command(cmd: &[String]) -> (Vec<String>, BTreeMap<String, String>) {
    let shell = cmd
        .first()
        .and_then(|p| p.rsplit('/').next())
        .is_some_and(|p| matches!(p, "sh" | "bash" | "dash" | "zsh"));
    let words: Vec<String> = match (shell, cmd.get(1).map(String::as_str), cmd.get(2)) {
        (true, Some("-c"), Some(script)) => shell_words(script),
        _ => cmd.to_vec(),
    };
    let mut env = BTreeMap::new();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        if w == "exec" || w == "env" {
            i += 1;
        } else if let Some((k, v)) = w.split_once('=').filter(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        }) {
            env.insert(k.to_string(), v.to_string());
            i += 1;
        } else {
            break;
        }
    }
    (words[i..].to_vec(), env)
}

/// A server command line as settings, one per flag, so that a retest that
/// changes one flag is seen as one changed variable (and two as two). The
/// flags are read by the analysis crate's per-runtime settings map
/// (`settings::parse`: long names, a runtime's short aliases resolved, its
/// memory variables from `env`, ports and hosts left out): `--max-active 4`
/// is `server.--max-active = 4`, a switch is `= true`, the program with its
/// positional arguments is `server.command`. Where the server reports (the
/// reference server's `--collector`, `--name`, `--port-file`) is no setting
/// either, and a command run through `sh -c` is read from its script.
pub fn command_settings(
    cmd: &[String],
    env: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let (words, mut vars) = unwrap_command(cmd);
    vars.extend(env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let parsed = oomscope_analysis::settings::parse(&words, &vars);
    let mut out = BTreeMap::new();
    for (k, v) in parsed.values {
        let bare = k.trim_start_matches('-');
        if k.starts_with('-') && ADDRESS_FLAGS.contains(&bare) {
            continue;
        }
        let v = if v.is_empty() { "true".to_string() } else { v };
        out.insert(format!("server.{k}"), v);
    }
    if !parsed.positional.is_empty() {
        out.insert("server.command".into(), parsed.positional.join(" "));
    }
    out
}

/// A figure whose ramp ended in the server's death (bounded by
/// "server_died", or by a timeout or error as it went) is bounded by the
/// death's domain where the collector named one, with its incident as evidence.
fn died_bound(fig: &mut Figure, d: &Death) {
    if !matches!(
        fig.bounded_by.as_str(),
        "server_died" | "timeout" | "server_error"
    ) {
        return;
    }
    if let Some(dom) = &d.domain {
        fig.bounded_by = dom.clone();
    } else {
        fig.bounded_by = "server_died".into();
    }
    fig.evidence
        .push(format!("the server died: {}", report::death_line(d)));
}

/// A pace rate in words: "120 tokens/s", or too fast to tell.
fn pace_rate(r: Option<f64>) -> String {
    r.map_or("too fast to tell".into(), |r| format!("{r:.0} tokens/s"))
}

/// The prompts made for sending, and how many of them were distinct.
struct Book {
    prompts: tokens::Prompts,
    sent: u64,
    distinct: HashSet<u64>,
}

impl Book {
    fn record(&mut self, prompt: &str) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        prompt.hash(&mut h);
        self.sent += 1;
        self.distinct.insert(h.finish());
    }
}

/// Makes requests with distinct prompts and counts them; `Copy` and `Sync`,
/// so the restart suite's load threads share it.
#[derive(Clone, Copy)]
pub(crate) struct Asker<'a> {
    book: &'a Mutex<Book>,
    model: Option<&'a str>,
    api: load::Api,
    stream: bool,
    /// Words to tokens, for each request's expected tokens.
    cal: &'a tokens::Calibration,
    workload: Option<&'a Arc<workload::Workload>>,
    lean: &'a load::Lean,
}

impl Asker<'_> {
    /// A request with a new, distinct prompt of `words` words.
    pub(crate) fn ask(&self, words: usize, max_tokens: usize, timeout: Duration) -> Ask {
        let mut b = self.book.lock().unwrap_or_else(|p| p.into_inner());
        let prompt = b.prompts.next(words);
        b.record(&prompt);
        drop(b);
        Ask {
            model: self.model.map(str::to_string),
            prompt,
            max_tokens,
            idempotency_key: None,
            timeout,
            api: self.api,
            stream: self.stream,
            prompt_tokens: self.cal.tokens_for(words),
            workload: self.workload.cloned(),
            lean: self.lean.clone(),
        }
    }

    /// Counts a prompt sent again on purpose (an idempotent retry).
    pub(crate) fn record_resend(&self, prompt: &str) {
        self.book
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(prompt);
    }
}

pub struct Probe {
    pub ep: Endpoint,
    pub cfg: ProbeConfig,
    pub watch: Option<Watch>,
    /// The server this probe started (--launch), stopped when the run ends.
    launched: Option<restart::Launched>,
    server: server::Server,
    /// The server's command read as its runtime's settings (from its
    /// supervisor's Hello, or `--launch`), to name the setting that bounds a figure.
    server_settings: Option<oomscope_analysis::settings::Settings>,
    cal: tokens::Calibration,
    book: Mutex<Book>,
    progress: Progress,
    started_ns: i64,
    /// The server answered at least once: a refused connection after that is a death.
    answered: bool,
    /// It refused connections after answering, and has not answered since.
    down: bool,
    deaths: Vec<Death>,
    /// Each suite's name and time window, to say which one a death hit.
    windows: Vec<(String, i64, i64)>,
    /// The restart suite's window: it kills the server on purpose.
    deliberate: Option<(i64, i64)>,
    /// The suite running now.
    current: String,
    /// Where each request goes as the server's workload (the collector).
    workload: Option<Arc<workload::Workload>>,
    /// The server rejects the optional request fields (learned once).
    lean: load::Lean,
    /// When the whole run must end: `--deadline` after it began.
    deadline_at: Instant,
    /// The server's pace, measured after the smoke (None: not measured,
    /// so the budgets are the defaults).
    pace: Option<pace::Pace>,
    /// A tiny request's latency on the idle server (the pace's, else the smoke's).
    tiny_ms: Option<f64>,
    /// Some of the probe's requests were abandoned (timed out or cut) and
    /// may still run on the server: the next rung waits for them.
    abandoned: bool,
    /// The budgeted suites still to run, with their prompt sizes, for
    /// each suite's share of the deadline.
    ahead: Vec<(Suite, u64)>,
}

impl Probe {
    /// A probe of `cfg.endpoint`; with `evidence` and `cfg.agent`, each step
    /// also reads the agent's memory from the collector.
    pub fn new(cfg: ProbeConfig, evidence: Option<Box<dyn EvidenceSource>>) -> Result<Probe> {
        for s in &cfg.suites {
            s.parse::<Suite>().map_err(anyhow::Error::msg)?;
        }
        let mut ep = Endpoint::parse(&cfg.endpoint)?.with_api_key(cfg.api_key.clone());
        if let Some(ca) = &cfg.ca_cert {
            ep = ep.with_ca_file(ca)?;
        }
        let watch = match (evidence, &cfg.agent) {
            (Some(source), Some(agent)) => Some(Watch::new(source, agent)),
            _ => None,
        };
        let seed = cfg.seed.unwrap_or_else(|| {
            oomscope_proto::now_ns() as u64 ^ u64::from(std::process::id()) << 32
        });
        let cfg_deadline = cfg.deadline;
        let mut prompts = tokens::Prompts::new(seed);
        if let Some(n) = cfg.shared_prefix {
            // Sized in words until the calibration knows better; re-sized after the smoke.
            prompts.set_shared_prefix(n);
        }
        Ok(Probe {
            ep,
            progress: Progress::new(cfg.progress),
            cfg,
            watch,
            launched: None,
            server: server::Server::default(),
            server_settings: None,
            cal: tokens::Calibration::default(),
            book: Mutex::new(Book {
                prompts,
                sent: 0,
                distinct: HashSet::new(),
            }),
            started_ns: oomscope_proto::now_ns(),
            answered: false,
            down: false,
            deaths: Vec::new(),
            windows: Vec::new(),
            deliberate: None,
            current: String::new(),
            workload: None,
            lean: load::Lean::default(),
            deadline_at: Instant::now() + cfg_deadline,
            pace: None,
            tiny_ms: None,
            abandoned: false,
            ahead: Vec::new(),
        })
    }

    /// Reports every request the probe sends to `sink`, as the server's
    /// workload: its tokens, start, end and the requests in flight.
    pub fn report_workload(&mut self, sink: Box<dyn workload::WorkloadSink>) {
        self.workload = Some(Arc::new(workload::Workload::new(sink)));
    }

    fn wants(&self, s: &str) -> bool {
        self.cfg.suites.iter().any(|x| x == s)
    }

    /// What makes requests, shareable with request threads.
    pub(crate) fn asker(&self) -> Asker<'_> {
        Asker {
            book: &self.book,
            model: self.cfg.model.as_deref(),
            api: self.server.api,
            stream: self.server.stream,
            cal: &self.cal,
            workload: self.workload.as_ref(),
            lean: &self.lean,
        }
    }

    /// A request with a new, distinct prompt of `words` words.
    pub(crate) fn ask(&self, words: usize, max_tokens: usize, timeout: Duration) -> Ask {
        self.asker().ask(words, max_tokens, timeout)
    }

    /// A sample prompt (for the tokenizer), never sent.
    fn sample(&self, words: usize) -> String {
        self.book
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .prompts
            .next(words)
    }

    /// What this run (and the server, as its agents said in their Hellos)
    /// was configured with; the server's flags come from its supervised
    /// command (the instance's `oomscope run` argv), else `--launch`'s.
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
        if let Some(n) = c.shared_prefix {
            s.insert("probe.shared_prefix".into(), n.to_string());
        }
        if let Some(m) = &c.model {
            s.insert("model".into(), m.clone());
        }
        let launch = c.launch.clone();
        let hellos = self.watch.as_mut().map(|w| w.hellos()).unwrap_or_default();
        // Oldest first, so the newest process's labels win.
        for h in hellos.iter().rev() {
            for (k, v) in h
                .labels
                .iter()
                .filter(|(k, _)| !IDENTITY_LABELS.contains(&k.as_str()))
            {
                s.insert(format!("server.{k}"), v.clone());
            }
            if let Some(a) = &h.allocator_settings {
                s.insert("server.alloc_conf".into(), a.alloc_conf.clone());
            }
            for m in &h.models {
                s.insert(
                    "server.model".into(),
                    format!("{} {} {} {}", m.name, m.revision, m.dtype, m.quantization)
                        .trim()
                        .to_string(),
                );
            }
        }
        // The supervised command (`oomscope run`'s), not a worker's own argv.
        let command = hellos
            .iter()
            .filter(|h| !h.command.is_empty())
            .min_by_key(|h| h.role != oomscope_proto::Role::Supervisor)
            .map(|h| h.command.clone())
            .or(launch);
        if let Some(cmd) = command {
            let env: BTreeMap<String, String> = hellos
                .iter()
                .flat_map(|h| h.labels.iter())
                .filter_map(|(k, v)| {
                    k.strip_prefix(oomscope_analysis::settings::ENV_LABEL_PREFIX)
                        .map(|n| (n.to_string(), v.clone()))
                })
                .collect();
            let (words, vars) = unwrap_command(&cmd);
            let mut all = vars;
            all.extend(env.clone());
            self.server_settings = Some(oomscope_analysis::settings::parse(&words, &all));
            s.extend(command_settings(&cmd, &env));
        }
        s
    }

    /// Takes in what a step's calls say: the server answered (so a later
    /// refusal is a death), what it counted (the calibration), and whether
    /// it went away (a refused or dropped connection after it had answered,
    /// confirmed by a second knock).
    fn after_calls(&mut self, calls: &[load::Call]) {
        if calls.iter().any(|c| {
            matches!(
                c.outcome,
                load::Outcome::Timeout | load::Outcome::NotMeasured
            )
        }) {
            self.abandoned = true;
        }
        if calls.iter().any(|c| c.outcome == load::Outcome::Ok) {
            self.answered = true;
            self.down = false;
        }
        // A refusal for length that stated the prompt's count counted it too.
        for c in calls
            .iter()
            .filter(|c| matches!(c.outcome, load::Outcome::Ok | load::Outcome::Rejected))
        {
            if let Some(pt) = c.prompt_tokens {
                self.cal.observe(c.prompt_words, pt);
            }
        }
        let gone = calls.iter().any(|c| {
            matches!(
                c.failure,
                Some(http::Failure::Refused | http::Failure::Dropped)
            )
        });
        if self.answered && gone && !self.down && !self.alive() {
            self.down = true;
            let suite = self.current.clone();
            self.deaths.push(Death {
                suite,
                time_ns: oomscope_proto::now_ns(),
                source: "connection_refused".into(),
                summary:
                    "the server refused connections after it had answered: it died or was killed"
                        .into(),
                ..Default::default()
            });
        }
    }

    /// Whether anything answers at the endpoint now (any HTTP status).
    fn alive(&self) -> bool {
        match http::request(
            &self.ep,
            "GET",
            "/models",
            None,
            &[],
            Duration::from_secs(3),
        ) {
            Ok(_) => true,
            Err(e) => e.kind == http::Failure::Timeout,
        }
    }

    /// Deaths the collector recorded for the server since the probe began,
    /// outside the restart suite's deliberate kill: each names its domain
    /// and cause, and fills in a death first seen as a refused connection.
    fn collector_deaths(&mut self) {
        let Some(w) = self.watch.as_mut() else {
            return;
        };
        std::thread::sleep(self.cfg.settle);
        let mut incidents = w.incidents_since(self.started_ns);
        // A death seen as a refused connection: give its supervisor time to
        // record how it died (the kernel's record, the signal).
        let deadline = Instant::now() + DEATH_EVIDENCE_WAIT;
        while self.deaths.iter().any(|d| d.incident.is_none())
            && incidents.is_empty()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(250));
            incidents = w.incidents_since(self.started_ns);
        }
        for inc in incidents {
            if self
                .deliberate
                .is_some_and(|(a, b)| inc.time_ns >= a && inc.time_ns <= b)
            {
                continue;
            }
            if self
                .deaths
                .iter()
                .any(|d| d.incident.as_deref() == Some(inc.id.as_str()))
            {
                continue;
            }
            let cause = self.watch.as_mut().and_then(|w| w.cause_of(&inc.id));
            let suite = self
                .windows
                .iter()
                .find(|(_, a, b)| inc.time_ns >= *a && inc.time_ns <= *b)
                .map(|(n, ..)| n.clone())
                .unwrap_or_else(|| self.current.clone());
            let domain = Some(inc.domain.clone())
                .filter(|d| !d.is_empty() && d != oomscope_analysis::Domain::Unknown.as_str());
            let filled = Death {
                suite: suite.clone(),
                time_ns: inc.time_ns,
                source: "collector".into(),
                incident: Some(inc.id.clone()),
                kind: Some(inc.kind.clone()),
                domain,
                cause,
                summary: inc.summary.clone(),
            };
            match self
                .deaths
                .iter_mut()
                .find(|d| d.incident.is_none() && d.suite == suite)
            {
                Some(d) => *d = filled,
                None => self.deaths.push(filled),
            }
        }
    }

    pub fn run(mut self) -> ProbeReport {
        let started_ns = self.started_ns;
        let t = Instant::now();
        self.deadline_at = t + self.cfg.deadline;
        let mut suites: Vec<SuiteReport> = Vec::new();
        let mut warnings = Vec::new();
        if let Some(cmd) = self.cfg.launch.clone() {
            self.progress.doing("launching the server");
            match self.launch(&cmd) {
                Ok(l) => self.launched = Some(l),
                Err(e) => warnings.push(format!("--launch failed: {e:#}")),
            }
        }
        if self.watch.is_none() {
            warnings.push("no --collector/--agent: figures are bounded by what the endpoint answered, without memory evidence".into());
        }

        self.current = "smoke".into();
        let smoke = self.smoke();
        let smoke_ok = smoke.status == Status::Pass;
        self.progress.line(&format!(
            "smoke: {} ({})",
            smoke.verdict,
            smoke.reason.as_deref().unwrap_or("ok")
        ));
        suites.push(smoke);
        // A fixture replaces the suites: the run is the regression check.
        let wanted: Vec<&str> = SUITES[1..]
            .iter()
            .copied()
            .filter(|s| match self.cfg.fixture {
                None => self.wants(s),
                Some(_) => self.cfg.after_fixture.iter().any(|x| x == s),
            })
            .collect();
        // The pace sizes the budgeted suites' time: none, no pace.
        let budgeted = wanted
            .iter()
            .any(|w| w.parse::<Suite>().is_ok_and(Suite::budgeted));
        if smoke_ok && budgeted {
            self.progress
                .doing("pace: timing a few requests of known sizes");
            match self.measure_pace() {
                Ok(p) => {
                    self.progress.line(&format!(
                        "pace: prefill {}, decode {}, overhead {:.0} ms",
                        pace_rate(p.prefill_tokens_per_s),
                        pace_rate(p.decode_tokens_per_s),
                        p.overhead_ms
                    ));
                    self.tiny_ms = Some(p.tiny_ms);
                    self.pace = Some(p);
                }
                Err(e) => warnings.push(format!(
                    "the server's pace was not measured ({e}): each suite has its default budget and each request --request-timeout"
                )),
            }
        }
        let settings = self.settings();
        let skip = |name: &str, why: String| SuiteReport {
            suite: name.into(),
            status: Status::Skipped,
            verdict: why,
            reason: None,
            steps: vec![],
            findings: serde_json::json!({}),
            duration_s: 0.0,
            budget_s: None,
        };
        let not_run = |what: &str| format!("the {what} suite did not run");
        let mut envelope = smoke_ok.then(|| Envelope {
            max_context_at_concurrency_1: Figure::not_measured("tokens", not_run("long-context")),
            max_concurrency_at_typical_context: Figure::not_measured(
                "sequences",
                not_run("concurrency"),
            ),
            max_concurrency_at_max_context: Figure::not_measured(
                "sequences",
                "it needs both the long-context and the concurrency suites",
            ),
            shared_prefix_tokens: self.cfg.shared_prefix.map(|n| n as u64),
            server_death: None,
        });
        let mut max_ctx: Option<u64> = None;
        let mut conc_cap: Option<u64> = None;
        self.ahead = self.plan(&wanted);
        if let Some(f) = self.cfg.fixture.clone() {
            if smoke_ok && !self.down {
                self.current = "fixture".into();
                let from = oomscope_proto::now_ns();
                suites.push(self.replay_fixture(&f));
                self.windows
                    .push(("fixture".into(), from, oomscope_proto::now_ns()));
            } else {
                suites.push(skip(
                    "fixture",
                    "not run: the smoke test failed, so the fixture proves nothing".into(),
                ));
            }
        }
        for name in wanted {
            if !smoke_ok {
                suites.push(skip(
                    name,
                    "not run: the smoke test failed, so no capacity claim is made".into(),
                ));
                continue;
            }
            if self.down && !self.alive() {
                let died = self
                    .deaths
                    .first()
                    .map(|d| d.suite.clone())
                    .unwrap_or_default();
                suites.push(skip(
                    name,
                    format!("not run: the server died during {died} and does not answer"),
                ));
                continue;
            }
            if self.deadline_left().is_zero() {
                let why = format!(
                    "the run's {:.0} s deadline was reached before the {name} suite ran",
                    self.cfg.deadline.as_secs_f64()
                );
                if let Some(e) = envelope.as_mut() {
                    let fig = Figure::not_measured("", why.clone());
                    match name {
                        "long-context" => {
                            e.max_context_at_concurrency_1 = Figure {
                                unit: "tokens".into(),
                                ..fig
                            }
                        }
                        "concurrency" => {
                            e.max_concurrency_at_typical_context = Figure {
                                unit: "sequences".into(),
                                ..fig
                            }
                        }
                        _ => {}
                    }
                }
                suites.push(SuiteReport {
                    status: Status::Error,
                    reason: Some(why.clone()),
                    ..skip(name, format!("not run: {why}"))
                });
                continue;
            }
            self.current = name.into();
            let from = oomscope_proto::now_ns();
            match name {
                "long-context" => {
                    let (r, f) = self.long_context();
                    max_ctx = f.value;
                    if let Some(e) = envelope.as_mut() {
                        e.max_context_at_concurrency_1 = f;
                    }
                    suites.push(r);
                }
                "concurrency" => {
                    let typical = self.cfg.typical_context as u64;
                    let (r, f) = self.concurrency_at("concurrency", typical);
                    conc_cap = f.value;
                    if let Some(e) = envelope.as_mut() {
                        e.max_concurrency_at_typical_context = f;
                    }
                    suites.push(r);
                    if max_ctx.is_none() || self.down {
                        // Its second ramp will not run: its time goes to the suites after it.
                        self.ahead.retain(|(s, _)| *s != Suite::Concurrency);
                    }
                    if let Some(mc) = max_ctx.filter(|_| !self.down) {
                        self.current = "concurrency-at-max-context".into();
                        // A little below the bound: distinct prompts of one size vary a little in tokens.
                        let at = (mc as f64 * (1.0 - MAX_CONTEXT_MARGIN)).floor().max(1.0) as u64;
                        let (r2, f2) = self.concurrency_at("concurrency-at-max-context", at);
                        suites.push(r2);
                        if let Some(e) = envelope.as_mut() {
                            e.max_concurrency_at_max_context = f2;
                        }
                    }
                }
                "repeated" => suites.push(self.repeated()),
                "overload" => suites.push(self.overload(conc_cap)),
                "restart" => {
                    suites.push(self.restart());
                    self.deliberate = Some((from, oomscope_proto::now_ns()));
                }
                _ => {}
            }
            self.windows
                .push((name.to_string(), from, oomscope_proto::now_ns()));
        }
        if let Some(l) = self.launched.take() {
            l.stop();
        }
        if smoke_ok {
            self.collector_deaths();
        }
        self.progress.finish();
        if let Some(e) = envelope.as_mut() {
            e.server_death = self.deaths.first().cloned();
            // A figure whose ramp ended when the server died is bounded by how it died.
            for (suite, fig) in [
                ("long-context", &mut e.max_context_at_concurrency_1),
                ("concurrency", &mut e.max_concurrency_at_typical_context),
                (
                    "concurrency-at-max-context",
                    &mut e.max_concurrency_at_max_context,
                ),
            ] {
                if let Some(d) = self.deaths.iter().find(|d| d.suite == suite) {
                    died_bound(fig, d);
                    if let Some(r) = suites.iter_mut().find(|r| r.suite == suite) {
                        r.findings["figure"] = serde_json::json!(fig);
                    }
                }
            }
        }
        let verdict = if !smoke_ok {
            "environment"
        } else if !self.deaths.is_empty()
            || suites.iter().any(|s| {
                matches!(
                    s.suite.as_str(),
                    "overload" | "restart" | "repeated" | "fixture"
                ) && s.status == Status::Fail
            })
        {
            "unsafe"
        } else if suites.iter().any(|s| s.status == Status::Error) {
            "incomplete"
        } else {
            "ok"
        };
        let book = self.book.lock().unwrap_or_else(|p| p.into_inner());
        let prompts = PromptStats {
            sent: book.sent,
            distinct: book.distinct.len() as u64,
            shared_prefix_tokens: self.cfg.shared_prefix.map(|n| n as u64),
        };
        drop(book);
        let server = ServerFacts {
            api: self.server.api.name().into(),
            streaming: self.server.stream,
            tokenizer: self.server.tokenizer,
            token_count: self.server.token_count.name().into(),
            tokenize_path: self.server.tokenize.map(|r| r.shown(&self.ep)),
            strict_fields: self.lean.load(std::sync::atomic::Ordering::Relaxed),
            load_source: self.server.load.as_ref().map(metrics::Source::label),
            runtime: self
                .server
                .load
                .as_ref()
                .map(|l| l.runtime().name().to_string()),
            max_model_len: self.server.max_model_len,
            pace: self.pace.clone(),
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
            server,
            prompts,
            deaths: self.deaths,
            warnings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{command_settings, shell_words, Suite, DEFAULT_RUN_BUDGET, SUITES};
    use std::collections::BTreeMap;
    use std::time::Duration;

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
    fn the_default_run_fits_its_budget() {
        // Smoke, long-context, the two concurrency ramps, repeated, overload.
        let total: Duration = [
            Suite::Smoke,
            Suite::LongContext,
            Suite::Concurrency,
            Suite::Concurrency,
            Suite::Repeated,
            Suite::Overload,
        ]
        .iter()
        .map(|s| s.default_budget())
        .sum();
        assert!(total < DEFAULT_RUN_BUDGET, "{total:?}");
    }

    fn argv(s: &str) -> Vec<String> {
        s.split(' ').map(str::to_string).collect()
    }

    #[test]
    fn a_command_line_becomes_one_setting_per_flag() {
        let none = BTreeMap::new();
        let s = command_settings(
            &argv("python runtimes/pytorch-server/server.py --port 8000 --max-active 4 --no-idempotency --restore-seconds=2 --port-file=/x --collector http://c --name ref"),
            &none,
        );
        assert_eq!(
            s["server.command"],
            "python runtimes/pytorch-server/server.py"
        );
        assert_eq!(s["server.--max-active"], "4");
        assert_eq!(s["server.--no-idempotency"], "true");
        assert_eq!(s["server.--restore-seconds"], "2");
        assert_eq!(
            s.len(),
            4,
            "where it listens and reports is no setting: {s:?}"
        );
        // A runtime's short aliases, negative numbers, switches, memory variables.
        let env = BTreeMap::from([("VLLM_CPU_KVCACHE_SPACE".to_string(), "4".to_string())]);
        let s = command_settings(
            &argv("llama-server -m m.gguf -np 4 -c 8192 --offset -1 --flash-attn"),
            &env,
        );
        assert_eq!(
            (
                s["server.--parallel"].as_str(),
                s["server.--ctx-size"].as_str()
            ),
            ("4", "8192")
        );
        assert_eq!(
            (
                s["server.--offset"].as_str(),
                s["server.--flash-attn"].as_str()
            ),
            ("-1", "true")
        );
        let s = command_settings(&argv("vllm serve m --max-num-seqs 5 --port 8000"), &env);
        assert_eq!(s["server.VLLM_CPU_KVCACHE_SPACE"], "4");
        assert_eq!(s["server.command"], "vllm serve m");
    }

    #[test]
    fn a_shell_wrapped_command_is_read_flag_by_flag() {
        let cmd = vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True exec python server.py --port 8001 --max-active 4 --model-name 'tiny model'".to_string(),
        ];
        let s = command_settings(&cmd, &BTreeMap::new());
        assert_eq!(s["server.--max-active"], "4");
        assert_eq!(s["server.--model-name"], "tiny model");
        assert_eq!(
            s["server.PYTORCH_CUDA_ALLOC_CONF"],
            "expandable_segments:True"
        );
        assert_eq!(s["server.command"], "python server.py");
        assert!(!s.contains_key("server.--port"));
        assert_eq!(
            shell_words(r#"a "b c" d\ e 'f"g'"#),
            ["a", "b c", "d e", "f\"g"]
        );
    }

    #[test]
    fn one_changed_flag_is_one_changed_setting() {
        let none = BTreeMap::new();
        let a = command_settings(
            &argv("python server.py --port 8000 --max-active 4 --max-queue 8"),
            &none,
        );
        let b = command_settings(
            &argv("python server.py --port 9000 --max-active 8 --max-queue 8"),
            &none,
        );
        let changed: Vec<&String> = a
            .keys()
            .chain(b.keys())
            .filter(|k| a.get(*k) != b.get(*k))
            .collect();
        assert_eq!(changed, ["server.--max-active", "server.--max-active"]);
    }
}
