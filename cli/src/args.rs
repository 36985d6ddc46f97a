//! The command line: every verb and argument with the help that `--help`
//! prints, apart from the verbs' code. `deny(missing_docs)` makes a flag
//! without help text a build error, since a doc comment is its help.
#![deny(missing_docs)]

use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use clap::builder::PossibleValue;
use clap::{Parser, Subcommand, ValueEnum};
use oomscope_agent_core::agent::check_interval;
use oomscope_probe::calibrate::StreamChoice;
use oomscope_probe::{ApiChoice, ProbeConfig, Suite};

/// The first lines of an investigation; `oomscope --help` ends with them.
const WORKFLOW: &str = "\
Workflow:
  oomscope collector                             # 1. receive the agents' evidence and store it
  oomscope run --name web -- python server.py    # 2. supervise a server (its in-process agent connects by itself)
  oomscope incidents                             # 3. what went wrong, one line each
  oomscope diagnose                              # 4. the latest incident: which memory ran out, why, what to change
  oomscope report --html incident.html           # 5. the same as a self-contained page to share";

/// Which memory ran out, why, and what to change.
#[derive(Parser)]
#[command(
    name = "oomscope",
    version,
    about = "Which memory ran out, why, and what to change: out-of-memory diagnosis for inference servers (agents, a collector, verdicts with ranked fixes, a capacity probe)",
    after_help = WORKFLOW
)]
pub struct Cli {
    /// The verb to run.
    #[command(subcommand)]
    pub verb: Verb,
}

/// Where the CLI and agents find the collector.
#[derive(clap::Args, Clone)]
pub struct CollectorArg {
    /// The collector's URL. Agents (those `run` starts included) also take a
    /// comma-separated list of collectors sharing one PostgreSQL store and
    /// move to the next when a stream breaks; queries ask the first.
    #[arg(long, env = "OOMSCOPE_COLLECTOR", hide_env_values = true, default_value = oomscope_proto::DEFAULT_COLLECTOR_URL)]
    pub collector: String,
    /// The collector's token (a secret of its --token-file), sent with every
    /// call; agents started by `run` get it too.
    #[arg(long, env = "OOMSCOPE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// For an https:// collector: a PEM file of the CA that signed its
    /// certificate (default: the public web roots).
    #[arg(long, env = "OOMSCOPE_CA", value_name = "PEM")]
    pub ca: Option<PathBuf>,
}

impl CollectorArg {
    /// Puts `--token` (and `--ca`) where every client of the collector reads it (the
    /// query client, the reporter, a supervised command's agent): the
    /// OOMSCOPE_TOKEN environment variable. Call before any thread starts.
    pub fn export_token(&self) {
        if let Some(t) = &self.token {
            std::env::set_var(oomscope_proto::bearer::TOKEN_ENV, t);
        }
        if let Some(ca) = &self.ca {
            std::env::set_var(oomscope_proto::tls::CA_ENV, ca);
        }
    }
}

/// The verbs.
#[derive(Subcommand)]
pub enum Verb {
    /// Run the collector: it receives agents' streams, stores them and answers queries.
    Collector {
        /// Address to listen on.
        #[arg(long, default_value = oomscope_proto::DEFAULT_COLLECTOR_ADDR)]
        listen: std::net::SocketAddr,
        /// The store: an embedded SQLite file, or `postgres://user@host/db`
        /// for a PostgreSQL database several collectors share (a Unix socket's
        /// directory as a percent-encoded host: `postgres://user@%2Frun%2Fpostgresql/db`).
        #[arg(
            long,
            env = "OOMSCOPE_DB",
            hide_env_values = true,
            default_value = "oomscope.db"
        )]
        db: PathBuf,
        /// How long a stream that broke without a Goodbye may take to reconnect
        /// before the agent is recorded as lost (an incident).
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        lost_grace: Duration,
        /// What one client may hold of the collector.
        #[command(flatten)]
        limits: ConnectionLimitArgs,
        /// Named tokens, one `name:secret` line each: every call must carry
        /// one (`OOMSCOPE_TOKEN` or `--token` on the client), and each agent
        /// id stays with the token that first used it.
        #[arg(long, value_name = "FILE", env = "OOMSCOPE_TOKEN_FILE")]
        token_file: Option<PathBuf>,
        /// Serve a non-loopback address without --token-file: anyone who can
        /// reach it may then write as any agent and read every agent's data.
        #[arg(long)]
        insecure: bool,
        /// Serve TLS with this certificate chain (PEM); clients then use an
        /// https:// URL (and OOMSCOPE_CA or --ca for a private CA).
        #[arg(long, value_name = "PEM", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The private key of --tls-cert (PEM).
        #[arg(long, value_name = "PEM", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Require client certificates signed by this CA (PEM); clients give
        /// theirs in OOMSCOPE_CLIENT_CERT and OOMSCOPE_CLIENT_KEY.
        #[arg(long, value_name = "PEM", requires = "tls_cert")]
        tls_client_ca: Option<PathBuf>,
        /// Serve Prometheus metrics at http://ADDR/metrics (e.g.
        /// 127.0.0.1:9433): ingest, incidents, store latency, connected
        /// agents, and each agent's latest memory readings.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<std::net::SocketAddr>,
        /// Delete what is older than this (e.g. 14d), by the agents' clocks,
        /// in small batches every few minutes; incidents younger than it
        /// stay (default: keep everything).
        #[arg(long, value_parser = parse_duration)]
        retain: Option<Duration>,
    },
    /// Supervise a command: sample its memory domains from outside, keep its
    /// stderr tail, and record how it ended. Exits with the command's status
    /// (128+N when signal N killed it).
    Run(RunArgs),
    /// Watch every memory cgroup of this host (every container) without
    /// wrapping anything: a timeline per cgroup, and each OOM kill an
    /// incident with the kernel's own record. Starts and signals nothing;
    /// runs until SIGTERM or SIGINT.
    Node(NodeArgs),
    /// Feed a capture file (a JSON capture of allocator readings, .json or
    /// .json.gz) through the agent reporter, as a live agent would have sent it.
    /// Exits 0 once the collector has acked every message.
    Replay {
        /// The capture: a JSON file (or .json.gz) of one scenario's allocator
        /// readings over time (PyTorch's memory_stats and mem_get_info at
        /// each step; the OOM observer's record and the error text if it
        /// failed), described in tests/fixtures/README.md of oomscope's source.
        #[arg(value_name = "FILE.json[.gz]")]
        file: PathBuf,
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// The agent name (default: the capture's scenario).
        #[arg(long)]
        name: Option<String>,
        /// Time scale: 0 = as fast as possible, 1 = real time, 2 = twice as fast.
        #[arg(long, default_value_t = 0.0)]
        speed: f64,
        /// How long to wait for every sequence number to be acked.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        timeout: Duration,
    },
    /// List the agents the collector knows, and whether they are connected,
    /// disconnected or lost.
    Agents {
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// Print JSON: [AgentSummary], each {hello: {agent_id, name, host,
        /// pid, role, runtime, ...}, state, first_seen_ns, last_seen_ns,
        /// samples, events, last_seq, instance, goodbye, context} (context:
        /// the latest load).
        #[arg(long)]
        json: bool,
        /// Only agents seen within this long (e.g. 1h).
        #[arg(long, value_parser = parse_since)]
        since: Option<Duration>,
        /// Only agents on this host.
        #[arg(long)]
        host: Option<String>,
    },
    /// List incidents: OOMs, deaths by signal, OOM text in a failed exit,
    /// lost agents, crash loops.
    Incidents {
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// Only this agent (id or name).
        #[arg(long)]
        agent: Option<String>,
        /// Only incidents within this long (e.g. 1d).
        #[arg(long, value_parser = parse_since)]
        since: Option<Duration>,
        /// Only this memory domain (e.g. gpu_vram, cgroup, host_ram).
        #[arg(long)]
        domain: Option<String>,
        /// Only this cause, the incident's kind (e.g. oom, agent_lost, crash_loop).
        #[arg(long)]
        cause: Option<String>,
        /// Only incidents of agents on this host.
        #[arg(long)]
        host: Option<String>,
        /// Print JSON: [Incident], each {id, agent_id, agent_name, kind,
        /// time_ns, domain, summary, seq, parts}.
        #[arg(long)]
        json: bool,
    },
    /// Show one agent's samples and events.
    Timeline {
        /// The agent (id or name).
        agent: String,
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// Only the last DURATION (e.g. 10m).
        #[arg(long, value_parser = parse_since)]
        since: Option<Duration>,
        /// Thin to at most this many samples, evenly in time, first and last
        /// kept; 0: as many as the collector sends (at most 20,000, and the
        /// newest 4 MiB of events).
        #[arg(long, default_value_t = 200)]
        max_points: u32,
        /// Print JSON: the TimelineResponse, {hello, samples: [{seq, sample,
        /// low, high}], events: [{seq, event, agent_id}], members,
        /// events_cut_ns}.
        #[arg(long)]
        json: bool,
    },
    /// Say which memory ran out, why, and what to change. Without an incident
    /// id: the latest incident (of the agent, when one is named), or the
    /// agent's timeline.
    Diagnose {
        /// An incident id (inc-000042, from `oomscope incidents`), or an agent
        /// (id or name, as `--agent` takes it): a name that is not shaped like
        /// an incident id, and that no incident has, names an agent.
        #[arg(value_name = "INCIDENT|AGENT")]
        incident: Option<String>,
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// This agent's latest incident (id or name), or its timeline if it had none.
        #[arg(long)]
        agent: Option<String>,
        /// With --agent: only the last DURATION of its timeline.
        #[arg(long, value_parser = parse_since)]
        since: Option<Duration>,
        /// Print JSON: the Diagnosis, {incident, agent, domain, trigger,
        /// causes: [{kind, confidence, evidence, metrics, processes}], fixes:
        /// [{action, risk, retest, caveat}], capacity, evidence, exit, cgroup,
        /// failure, victim, kernel_report, device}.
        #[arg(long)]
        json: bool,
    },
    /// Compare two runs of one workload (incident ids or agent names): what
    /// changed in their configuration, and whether the failure vanished,
    /// moved, shrank or stayed the same.
    Compare {
        /// The first run: an incident id, or an agent id or name.
        a: String,
        /// The second run, named the same way.
        b: String,
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// Print JSON: the Comparison, {a, b, changed: [{setting, a, b}],
        /// one_variable, warnings, outcome, outcome_reason, memory_rows}, each
        /// side {agent_id, name, incident, failure, domain, trigger, cause,
        /// memory: [{moment, title, time_ns, bytes}]}.
        #[arg(long)]
        json: bool,
    },
    /// Probe a live OpenAI-compatible endpoint: a tiny known-good request first,
    /// then bounded suites, and a safe envelope with the domain bounding each figure.
    #[command(after_help = exit_codes_help())]
    Probe(Box<ProbeArgs>),
    /// Close the fix loop: launch the server command (after `--`) as it is,
    /// then once per candidate change, each under `oomscope run
    /// --memory-limit`, replay the fixture and a short overload burst, and
    /// choose the least risky change that made the failure vanish.
    Retest(Box<RetestArgs>),
    /// The `oomscope.fixture/v1` of an incident, from its load at the failure
    /// (its sequences at once, each its share of the active tokens; a leak's
    /// requests repeated), or, for a failure while starting, one that
    /// reproduces at launch (`at_start`, with a small default load): request
    /// sizes only, for `probe --fixture` and `retest`.
    Fixture {
        /// The incident id (inc-000042, from `oomscope incidents`).
        incident: String,
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// Write it to this file (default: stdout).
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Write an incident report (the latest incident by default): a
    /// self-contained HTML page with charts, or Markdown on stdout.
    Report {
        /// The incident id (default: the latest incident).
        incident: Option<String>,
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// Report this agent's latest incident, or its timeline if it had none.
        #[arg(long)]
        agent: Option<String>,
        /// Write the HTML page to this file.
        #[arg(long, value_name = "OUT.html", required_unless_present = "md")]
        html: Option<PathBuf>,
        /// Print Markdown to stdout.
        #[arg(long, conflicts_with = "html")]
        md: bool,
        /// Replace an existing --html file. Without it an existing file or a
        /// symlink is refused; with it a symlink itself is replaced, never
        /// the file it points to.
        #[arg(long, requires = "html")]
        force: bool,
    },
    /// Measure a collector: how many agents one collector takes.
    #[command(subcommand)]
    Bench(BenchVerb),
}

impl Verb {
    /// Where this verb finds a collector, for verbs that talk to one.
    pub fn collector_arg(&self) -> Option<&CollectorArg> {
        match self {
            Verb::Run(a) => Some(&a.collector),
            Verb::Replay { collector, .. }
            | Verb::Agents { collector, .. }
            | Verb::Incidents { collector, .. }
            | Verb::Timeline { collector, .. }
            | Verb::Diagnose { collector, .. }
            | Verb::Compare { collector, .. }
            | Verb::Report { collector, .. }
            | Verb::Bench(BenchVerb::Ingest { collector, .. }) => Some(collector),
            _ => None,
        }
    }
}

/// What `oomscope bench` measures.
#[derive(Subcommand)]
pub enum BenchVerb {
    /// Drive a collector with N agent streams of real-size samples (the
    /// allocator counters and host readings of an H200 capture, encoded as
    /// the agent encodes them, before the clock starts), each sent as fast
    /// as acks allow (or paced, with --rate). Prints acked samples/s, p50/p99 ack latency, and the
    /// collector's CPU per sample when it runs on this host. The samples are
    /// really stored, under agents named bench-ingest.
    Ingest {
        /// Where the collector is.
        #[command(flatten)]
        collector: CollectorArg,
        /// Agent streams, each on its own connection.
        #[arg(long, default_value_t = crate::bench_ingest::DEFAULT_AGENTS)]
        agents: usize,
        /// Samples each stream sends.
        #[arg(long, default_value_t = crate::bench_ingest::DEFAULT_SAMPLES)]
        samples: usize,
        /// Unacked samples one stream may have in flight.
        #[arg(long, default_value_t = crate::bench_ingest::DEFAULT_WINDOW)]
        window: usize,
        /// Send every sample's allocator counters complete, as agents without
        /// delta encoding do (by default, as changes against the previous
        /// sample where smaller, as the agents' reporter sends them).
        #[arg(long)]
        complete_counters: bool,
        /// Pace each stream at this many samples per second, as an agent's
        /// sampler sends (4 at the default 250 ms interval), instead of as
        /// fast as acks allow; the ack latency then counts from when each
        /// sample was due.
        #[arg(long)]
        rate: Option<f64>,
        /// Print JSON: {acked_samples_per_s, p50_ack_ms, p99_ack_ms,
        /// collector_cpu_us_per_sample (null when unknown), agents, samples,
        /// wire_bytes_per_sample, p99_send_late_ms (paced: how late this
        /// generator sent, counted in the ack latency; null unpaced),
        /// generator_cpu_us_per_sample}.
        #[arg(long)]
        json: bool,
    },
}

/// The supervisor's flags; `run` turns them into `oomscope_supervisor::RunConfig`.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Where the collector is.
    #[command(flatten)]
    pub collector: CollectorArg,
    /// The agent name (default: the command's file name).
    #[arg(long)]
    pub name: Option<String>,
    /// Restart the command up to N times after a failure (exponential
    /// backoff); then report a crash loop. 0 = never restart.
    #[arg(long, default_value_t = 0)]
    pub restart: u32,
    /// First restart delay; it doubles up to --backoff-max.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub backoff: Duration,
    /// The longest restart delay.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub backoff_max: Duration,
    /// Sampling interval, at least 10 ms (every agent's floor; a directive
    /// from the collector may change it).
    #[arg(long, default_value = "250ms", value_parser = parse_interval)]
    pub interval: Duration,
    /// How long to wait at the end for the collector to ack everything.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub flush_timeout: Duration,
    /// Where unacked evidence is spooled while the collector is unreachable
    /// (default: in memory only).
    #[arg(long, env = "OOMSCOPE_SPOOL", hide_env_values = true)]
    pub spool: Option<PathBuf>,
    /// Run the command in a memory cgroup of SIZE (e.g. 512M, 4GiB; swap
    /// included), made for this run and removed after it (cgroup v1 or v2; root).
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_size)]
    pub memory_limit: Option<u64>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// `oomscope node`'s flags.
#[derive(clap::Args)]
pub struct NodeArgs {
    /// Where the collector is.
    #[command(flatten)]
    pub collector: CollectorArg,
    /// The cgroup filesystem to watch: its mount (v1's memory hierarchy is
    /// found under it), or one cgroup, whose subtree alone is watched.
    #[arg(long, default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// How often each cgroup's memory is sampled (OOM counters are read at
    /// least every second whatever this is).
    #[arg(long, default_value = "1s", value_parser = parse_interval)]
    pub interval: Duration,
    /// Watch at most N cgroups (each is one stream to the collector); past
    /// it the upper levels are kept, and the watcher says so.
    #[arg(long, default_value_t = oomscope_supervisor::node::DEFAULT_MAX_CGROUPS)]
    pub max_cgroups: usize,
    /// The kernel's log, read for its OOM records. Where it cannot be read,
    /// kills are still recorded from the cgroups' counters, without the
    /// kernel's figures.
    #[arg(
        long,
        env = "OOMSCOPE_KMSG",
        hide_env_values = true,
        default_value = "/dev/kmsg"
    )]
    pub kmsg: String,
    /// How long to wait at the end for the collector to ack everything.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub flush_timeout: Duration,
}

/// A memory size: bytes, or with a binary unit (K, M, G, T; "MiB" and "MB" alike).
fn parse_memory_size(s: &str) -> Result<u64, String> {
    oomscope_analysis::kv_pool_figures::parse_size(s)
        .filter(|b| *b >= 1.0)
        .map(|b| b as u64)
        .ok_or_else(|| format!("`{s}` is not a memory size (e.g. 512M, 4GiB)"))
}

/// `oomscope retest`'s flags.
#[derive(clap::Args)]
pub struct RetestArgs {
    /// The failing workload, an `oomscope.fixture/v1` file.
    #[arg(long, value_name = "FIXTURE.json")]
    pub fixture: PathBuf,
    /// A candidate change, SETTING=VALUE (a flag of the command, or an
    /// environment variable); repeat for more. Each is tried alone.
    #[arg(long = "try", value_name = "SETTING=VALUE", allow_hyphen_values = true)]
    pub tries: Vec<String>,
    /// Take candidates from this incident's diagnosis: its fixes' proposed
    /// settings, mapped through the runtime's settings.
    #[arg(long, value_name = "INCIDENT")]
    pub from: Option<String>,
    /// The OpenAI-compatible base URL the launched server listens at.
    #[arg(long)]
    pub endpoint: String,
    /// Run each launch in a memory cgroup of SIZE (`oomscope run --memory-limit`).
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_size)]
    pub memory_limit: Option<u64>,
    /// The readiness path, polled until it answers 200.
    #[arg(long, default_value = "/health")]
    pub ready_path: String,
    /// How long a launch may take to become ready before it is a failed start.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub launch_timeout: Duration,
    /// The most one launch's checks may take (smoke, replay, overload burst).
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    pub check_deadline: Duration,
    /// Requests of the overload burst (default: twice the fixture's concurrency, 8..=64).
    #[arg(long)]
    pub burst: Option<usize>,
    /// Keep each launch's output (the server's and `oomscope run`'s) in
    /// DIR/<launch>.log, the baseline's as baseline.log and each candidate's
    /// as <n>.log in --try/--from order (default: discarded).
    #[arg(long, value_name = "DIR")]
    pub logs: Option<PathBuf>,
    /// Where the collector is (the launches report to it, and --from reads it).
    #[command(flatten)]
    pub collector: CollectorArg,
    /// Print the decision table as JSON (`oomscope.retest/v1`: baseline,
    /// rows: [{setting, value, outcome, domain, answered, requests,
    /// peak_memory, capacity, p50_ms, p99_ms, throughput_rps, overload,
    /// quality_drift, risk, chosen, note}], chosen, why, regression).
    #[arg(long)]
    pub json: bool,
    /// Print the decision table as Markdown.
    #[arg(long, conflicts_with = "json")]
    pub md: bool,
    /// Also write a self-contained HTML page: with --from, the incident's
    /// report (timeline, memory table, verdict) followed by the retests and
    /// the choice, so the incident closes in one document.
    #[arg(long, value_name = "OUT.html")]
    pub html: Option<PathBuf>,
    /// The server command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// The probe's defaults, from their one source, `ProbeConfig::new`.
fn probe_defaults() -> &'static ProbeConfig {
    static DEFAULTS: LazyLock<ProbeConfig> = LazyLock::new(|| ProbeConfig::new(""));
    &DEFAULTS
}

/// What one client may hold of the collector (`oomscope collector`).
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectionLimitArgs {
    /// Streams one connection may have open at once, advertised to clients
    /// (HTTP/2 MAX_CONCURRENT_STREAMS).
    #[arg(long, default_value_t = oomscope_collector::serve::DEFAULT_MAX_STREAMS)]
    pub max_streams: u32,
    /// How long one message may take to arrive once its first byte came; a
    /// message still partial then is dropped and its stream ended.
    #[arg(long, value_parser = parse_duration,
          default_value = shown(format_duration(oomscope_collector::serve::DEFAULT_MESSAGE_DEADLINE)))]
    pub message_deadline: Duration,
    /// MiB of partly arrived messages held across all streams; a stream
    /// whose message would pass it is refused (RESOURCE_EXHAUSTED).
    #[arg(long, value_name = "MIB",
          default_value_t = oomscope_collector::serve::DEFAULT_MAX_BUFFERED_BYTES / (1024 * 1024))]
    pub max_buffered_mib: usize,
    /// A connection that has had no stream open for this long is closed.
    #[arg(long, value_parser = parse_duration,
          default_value = shown(format_duration(oomscope_collector::serve::DEFAULT_IDLE_CONNECTION)))]
    pub idle_connection: Duration,
}

impl ConnectionLimitArgs {
    /// The limits as the collector takes them.
    pub fn limits(&self) -> oomscope_collector::serve::ConnectionLimits {
        oomscope_collector::serve::ConnectionLimits {
            max_streams: self.max_streams,
            message_deadline: self.message_deadline,
            max_buffered_bytes: self.max_buffered_mib.saturating_mul(1024 * 1024),
            idle_connection: self.idle_connection,
        }
    }
}

/// A computed default as clap's `default_value` wants it, `&'static str`:
/// leaked, once per flag each time the command is built (once a run).
fn shown(default: String) -> &'static str {
    Box::leak(default.into_boxed_str())
}

/// The probe's knobs. Their defaults come from `ProbeConfig::new`, where
/// each one's reason is written.
#[derive(clap::Args)]
pub struct ProbeArgs {
    /// The OpenAI-compatible base URL, http:// or https://, e.g.
    /// http://127.0.0.1:8000/v1 or https://[::1]:8443/v1
    #[arg(long)]
    pub endpoint: String,
    /// The model name to request (default: the server's default).
    #[arg(long)]
    pub model: Option<String>,
    /// Which API to drive: auto takes /v1/completions where the server
    /// offers it, else /v1/chat/completions.
    #[arg(long, value_enum, default_value = "auto")]
    pub api: ApiArg,
    /// Stream requests (to time the first token): auto streams where the
    /// server streams and counts tokens without a non-streamed answer (a
    /// tokenize endpoint, usage in its streams); chosen once, after the
    /// token calibration, the same way every run.
    #[arg(long, value_enum, default_value = "auto")]
    pub stream: StreamArg,
    /// Sent as `Authorization: Bearer KEY` to --endpoint and nowhere else
    /// (no other key is ever sent).
    #[arg(long, env = "OOMSCOPE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Trust the certificates in this PEM file (a private CA, a self-signed
    /// server) instead of the built-in roots.
    #[arg(long, value_name = "PEM")]
    pub ca_cert: Option<PathBuf>,
    /// The collector that the server's agent reports to; with --agent, each
    /// step reads the agent's memory and the verdicts from it (default: none,
    /// so no memory evidence).
    #[arg(long, env = "OOMSCOPE_COLLECTOR", hide_env_values = true)]
    pub collector: Option<String>,
    /// The server's agent name at the collector.
    #[arg(long)]
    pub agent: Option<String>,
    /// The suites to run, comma-separated; smoke always runs first. restart
    /// is not in the default set: it needs --launch.
    #[arg(long, value_enum, value_delimiter = ',', default_value = shown(probe_defaults().suites.join(",")))]
    pub suite: Vec<SuiteArg>,
    /// Long-context suite: the largest prompt, in tokens as the server counts
    /// them (its max_model_len lowers it where it says one).
    #[arg(long, value_name = "TOKENS", default_value_t = probe_defaults().max_context)]
    pub max_context: usize,
    /// Long-context suite: the first prompt, in tokens (it doubles from there).
    #[arg(long, value_name = "TOKENS", default_value_t = probe_defaults().min_context)]
    pub min_context: usize,
    /// Concurrency suite: each request's prompt, in tokens.
    #[arg(long, value_name = "TOKENS", default_value_t = probe_defaults().typical_context)]
    pub typical_context: usize,
    /// Every prompt starts with the same this-many tokens: measures the
    /// prefix-cached case on purpose, reported as such (default: every
    /// prompt distinct, so no prefix cache answers for free).
    #[arg(long, value_name = "TOKENS")]
    pub shared_prefix: Option<usize>,
    /// Tokens generated per request.
    #[arg(long, value_name = "TOKENS", default_value_t = probe_defaults().output_tokens)]
    pub output_tokens: usize,
    /// Concurrency suite: where the ramp stops if nothing failed first.
    #[arg(long, default_value_t = probe_defaults().max_concurrency)]
    pub max_concurrency: usize,
    /// A step whose p99 latency exceeds this is past capacity even without
    /// a failure; the figure is the last step within it.
    #[arg(long, value_parser = parse_duration, default_value = shown(format_duration(probe_defaults().latency_bound)))]
    pub latency_bound: Duration,
    /// One request's timeout at least: longer where the server's measured
    /// pace says a request of the rung's size needs more (cut shorter where
    /// its suite's budget or the deadline ends first).
    #[arg(long, value_parser = parse_duration, default_value = shown(format_duration(probe_defaults().request_timeout)))]
    pub request_timeout: Duration,
    /// Repeated suite: how many requests (each with its own prompt).
    #[arg(long, default_value_t = probe_defaults().repeat)]
    pub repeat: usize,
    /// Overload suite: the burst size (default: 4x the concurrency found,
    /// within 16..=256).
    #[arg(long)]
    pub burst: Option<usize>,
    /// Overload suite: each request's prompt, in tokens.
    #[arg(long, value_name = "TOKENS", default_value_t = probe_defaults().overload_context)]
    pub overload_context: usize,
    /// Overload suite: a request neither answered nor refused within this
    /// waited in an unbounded queue.
    #[arg(long, value_parser = parse_duration, default_value = shown(format_duration(probe_defaults().overload_timeout)))]
    pub overload_timeout: Duration,
    /// A cap on every suite's budget; a suite whose budget runs out is
    /// incomplete (exit 4). Default: each suite's own, longer where the
    /// server's measured pace says its requests need it.
    #[arg(long, value_parser = parse_duration, long_help = suite_budget_help())]
    pub suite_budget: Option<Duration>,
    /// The whole run ends within this: the suites share what is left of it,
    /// and a figure it cut is reported as a lower bound, with where it was
    /// cut (exit 4); a request it cut is not measured, never a failure.
    #[arg(long, value_parser = parse_duration, default_value = shown(format_duration(probe_defaults().deadline)))]
    pub deadline: Duration,
    /// Launch the server given after `--` under `oomscope run --restart`
    /// (the restart suite needs it): `--launch -- python server.py --port 8000`.
    #[arg(long, requires = "command")]
    pub launch: bool,
    /// With --launch: the server command and its arguments, after `--`.
    #[arg(last = true, value_name = "CMD", requires = "launch")]
    pub command: Vec<String>,
    /// The readiness path on the server's host (200 = ready).
    #[arg(long, default_value = probe_defaults().ready_path.as_str())]
    pub ready_path: String,
    /// Restart suite: requests in the herd sent at readiness (and in steady
    /// state, to compare).
    #[arg(long, default_value_t = probe_defaults().restart_settings.herd)]
    pub restart_herd: usize,
    /// The prompts' random seed (default: the clock, so runs differ).
    #[arg(long)]
    pub seed: Option<u64>,
    /// No progress lines on stderr (by default one per rung: a spinner on a
    /// terminal, plain lines otherwise).
    #[arg(long, short)]
    pub quiet: bool,
    /// Compare with an earlier `probe --json` report: what moved, and whether
    /// more than one setting differs.
    #[arg(long, value_name = "BASELINE.json")]
    pub compare: Option<PathBuf>,
    /// Replay this `oomscope.fixture/v1` file after the smoke instead of the
    /// suites: exits non-zero when the failure it holds comes back (a
    /// regression test for CI).
    #[arg(long, value_name = "FIXTURE.json")]
    pub fixture: Option<PathBuf>,
    /// Write the `oomscope.fixture/v1` of the first step a suite failed at
    /// (request sizes only, no prompt text) to this file.
    #[arg(long, value_name = "FILE")]
    pub fixture_out: Option<PathBuf>,
    /// Print the report as JSON, the versioned oomscope.probe/v1 schema:
    /// {schema, endpoint, model, agent, started_ns, duration_s, settings,
    /// verdict, suites: [{suite, status, verdict, reason, steps, findings,
    /// duration_s, budget_s}], envelope, server, prompts, deaths, warnings},
    /// and with --compare a comparison.
    #[arg(long)]
    pub json: bool,
}

/// `--suite-budget`'s long help: each suite's default budget.
fn suite_budget_help() -> &'static str {
    let each: Vec<String> = Suite::ALL
        .iter()
        .filter(|s| s.budgeted())
        .map(|s| format!("{} {}", s.name(), format_duration(s.default_budget())))
        .collect();
    shown(format!(
        "One time budget for every suite but the smoke (its own {}) and restart (bounded by its own timeouts), within --deadline; a suite whose budget runs out is incomplete (exit 4) and a request it cut is not measured, never a failure. Default: each suite's own ({}; the concurrency budget is for each of its two ramps; together under the default --deadline {}), longer where the server's pace, measured after the smoke, says its requests need it",
        format_duration(Suite::Smoke.default_budget()),
        each.join(", "),
        format_duration(oomscope_probe::DEFAULT_RUN_BUDGET)
    ))
}

/// `--api`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ApiArg {
    /// /v1/completions where offered, else /v1/chat/completions.
    Auto,
    /// /v1/completions.
    Completions,
    /// /v1/chat/completions.
    Chat,
}

/// `--stream`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StreamArg {
    /// Where the server streams and its tokens are counted without JSON answers.
    Auto,
    /// Wherever the server streams, counted or not.
    On,
    /// Never.
    Off,
}

impl From<StreamArg> for StreamChoice {
    fn from(a: StreamArg) -> StreamChoice {
        match a {
            StreamArg::Auto => StreamChoice::Auto,
            StreamArg::On => StreamChoice::On,
            StreamArg::Off => StreamChoice::Off,
        }
    }
}

impl From<ApiArg> for ApiChoice {
    fn from(a: ApiArg) -> ApiChoice {
        match a {
            ApiArg::Auto => ApiChoice::Auto,
            ApiArg::Completions => ApiChoice::Completions,
            ApiArg::Chat => ApiChoice::Chat,
        }
    }
}

/// A probe suite as `--suite` takes it; the names and their help come from
/// [`Suite`], the probe crate's one list of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SuiteArg(pub Suite);

impl ValueEnum for SuiteArg {
    fn value_variants<'a>() -> &'a [Self] {
        static ALL: LazyLock<Vec<SuiteArg>> =
            LazyLock::new(|| Suite::ALL.into_iter().map(SuiteArg).collect());
        &ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let help = shown(match self.0 {
            Suite::Restart => format!("{} (bounded by its own timeouts)", self.0.about()),
            s => format!(
                "{} (budget {})",
                s.about(),
                format_duration(s.default_budget())
            ),
        });
        Some(PossibleValue::new(self.0.name()).help(help))
    }
}

/// Parses a sampling interval: a duration that agent-core's one interval
/// rule (at least `MIN_SAMPLE_INTERVAL`, 10 ms) allows, so that a too-short
/// `--interval` is a usage error that says the floor.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    check_interval(parse_duration(s)?).map_err(|e| e.to_string())
}

/// Parses `--since`: a duration that a nanosecond clock can go back by
/// (about 292 years), so that "now minus it" is never a wrap into the future.
pub fn parse_since(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    match oomscope_proto::duration_ns(d) {
        Some(_) => Ok(d),
        None => Err(format!(
            "`{s}` reaches further back than a nanosecond clock holds (about 292 years)"
        )),
    }
}

/// Parses "250ms", "5s", "10m", "1h" or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (try 250ms, 5s, 10m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit `{unit}` (use ms, s, m, h or d)"
            ))
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}` is not a duration"));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("`{s}` is too long a duration"))
}

/// Writes a duration the way [`parse_duration`] reads it, in the largest
/// whole unit ("5m", "30s", "700ms"), for the defaults that help shows.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (per, unit) in [(3_600_000, "h"), (60_000, "m"), (1000, "s")] {
        if ms > 0 && ms / per * per == ms {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

/// The exit codes as `oomscope probe --help` lists them, from `oomscope_probe::report::VERDICT_EXITS`.
pub(crate) fn exit_codes_help() -> String {
    let mut rows: Vec<(i32, &str, &str)> = oomscope_probe::report::VERDICT_EXITS
        .iter()
        .map(|&(v, c, why)| (c, v, why))
        .collect();
    rows.push((
        crate::ERROR_EXIT,
        "error",
        "oomscope itself failed: bad arguments (an unparsable --endpoint, --suite restart without --launch) or an unreadable --compare file",
    ));
    rows.sort();
    let mut s = String::from("Exit codes:");
    for (code, verdict, why) in rows {
        s.push_str(&format!("\n  {code}  {verdict}: {why}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert!(parse_duration("5x").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration(&"9".repeat(30))
            .unwrap_err()
            .contains("too long"));
    }

    #[test]
    fn since_stays_within_the_clock() {
        assert_eq!(parse_since("10m").unwrap(), Duration::from_secs(600));
        // 290 years fit in i64 nanoseconds; 475 years do not.
        assert!(parse_since(&format!("{}s", 290u64 * 365 * 86_400)).is_ok());
        let err = parse_since("15000000000s").unwrap_err();
        assert!(
            err.contains("15000000000s") && err.contains("292 years"),
            "{err}"
        );
    }

    #[test]
    fn shown_durations_parse_back() {
        for ms in [
            0, 10, 700, 1000, 30_000, 60_000, 300_000, 3_600_000, 5_400_000,
        ] {
            let d = Duration::from_millis(ms);
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d, "{ms} ms");
        }
        assert_eq!(format_duration(Duration::from_secs(300)), "5m");
    }

    fn probe(args: &[&str]) -> ProbeArgs {
        let argv = ["oomscope", "probe", "--endpoint", "http://h/v1"];
        match Cli::try_parse_from(argv.iter().chain(args)).unwrap().verb {
            Verb::Probe(p) => *p,
            _ => unreachable!(),
        }
    }

    #[test]
    fn probe_defaults_are_probe_configs() {
        let (a, d) = (probe(&[]), ProbeConfig::new(""));
        let names: Vec<&str> = a.suite.iter().map(|s| s.0.name()).collect();
        assert_eq!(names, d.suites);
        assert_eq!(
            (
                a.max_context,
                a.latency_bound,
                a.suite_budget,
                a.deadline,
                a.restart_herd
            ),
            (
                d.max_context,
                d.latency_bound,
                d.suite_budget,
                d.deadline,
                d.restart_settings.herd
            )
        );
        assert_eq!(
            (a.api, a.launch, a.shared_prefix),
            (ApiArg::Auto, false, None)
        );
        assert_eq!(a.ready_path, d.ready_path);
        let a = probe(&["--suite", "restart,long-context"]);
        assert_eq!(
            a.suite,
            [SuiteArg(Suite::Restart), SuiteArg(Suite::LongContext)]
        );
        assert!(
            Cli::try_parse_from(["oomscope", "probe", "--endpoint", "x", "--suite", "warm"])
                .is_err()
        );
    }

    #[test]
    fn launch_is_a_switch_with_the_command_after_the_double_dash() {
        let a = probe(&[
            "--suite",
            "restart",
            "--launch",
            "--",
            "python",
            "server.py",
            "--port",
            "8000",
        ]);
        assert!(a.launch);
        assert_eq!(a.command, ["python", "server.py", "--port", "8000"]);
        let bad = |args: &[&str]| {
            let argv = ["oomscope", "probe", "--endpoint", "http://h/v1"];
            Cli::try_parse_from(argv.iter().chain(args)).is_err()
        };
        assert!(bad(&["--launch"]), "--launch without a command");
        assert!(
            bad(&["--", "python", "server.py"]),
            "a command without --launch"
        );
        assert!(
            bad(&["--launch", "python server.py"]),
            "the old one-string form"
        );
        let a = probe(&[
            "--api",
            "chat",
            "--api-key",
            "sk-1",
            "--shared-prefix",
            "128",
            "--suite-budget",
            "1s",
            "--deadline",
            "90s",
            "-q",
        ]);
        assert_eq!(
            (a.api, a.api_key.as_deref(), a.shared_prefix),
            (ApiArg::Chat, Some("sk-1"), Some(128))
        );
        assert_eq!(
            (a.suite_budget, a.deadline, a.quiet),
            (Some(Duration::from_secs(1)), Duration::from_secs(90), true)
        );
    }

    #[test]
    fn intervals_have_a_floor() {
        assert_eq!(parse_interval("10ms").unwrap(), Duration::from_millis(10));
        assert!(parse_interval("9ms").unwrap_err().contains("10 ms"));
        assert!(parse_interval("0").is_err());
    }
}
