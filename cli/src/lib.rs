//! The `oomscope` command, one module per verb: `collector`, `run` (the
//! supervisor), `replay`, the queries (`agents`, `incidents`, `timeline`,
//! `diagnose`), `compare`, `probe` and `report`. Each verb is a thin shell:
//! the work lives in the collector, agent-core, analysis, report and probe
//! crates.

mod collector;
mod compare;
mod probe;
mod query;
mod replay;
mod report;
pub mod supervise;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};


#[derive(Parser)]
#[command(
    name = "oomscope",
    version,
    about = "Which memory ran out, why, and what to change: a memory flight recorder and diagnostician for inference servers"
)]
struct Cli {
    #[command(subcommand)]
    verb: Verb,
}

/// Where the CLI and agents find the collector.
#[derive(clap::Args, Clone)]
pub struct CollectorArg {
    /// The collector's URL.
    #[arg(long, env = "OOMSCOPE_COLLECTOR", default_value = oomscope_proto::DEFAULT_COLLECTOR_URL)]
    pub collector: String,
}

#[derive(Subcommand)]
enum Verb {
    /// Run the collector: it receives agents' streams, stores them and answers queries.
    Collector {
        /// Address to listen on.
        #[arg(long, default_value = oomscope_proto::DEFAULT_COLLECTOR_ADDR)]
        listen: std::net::SocketAddr,
        /// The embedded SQLite store.
        #[arg(long, env = "OOMSCOPE_DB", default_value = "oomscope.db")]
        db: PathBuf,
        /// How long a stream that broke without a Goodbye may take to reconnect
        /// before the agent is recorded as lost (an incident).
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        lost_grace: Duration,
    },
    /// Supervise a command: sample its memory domains from outside, keep its
    /// stderr tail, and record how it ended. Exits with the command's status.
    Run {
        #[command(flatten)]
        collector: CollectorArg,
        /// The agent name (default: the command's file name).
        #[arg(long)]
        name: Option<String>,
        /// Restart the command up to N times after a failure (exponential
        /// backoff); then report a crash loop. 0 = never restart.
        #[arg(long, default_value_t = 0)]
        restart: u32,
        /// First restart delay; it doubles up to --backoff-max.
        #[arg(long, default_value = "500ms", value_parser = parse_duration)]
        backoff: Duration,
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        backoff_max: Duration,
        /// Sampling interval.
        #[arg(long, default_value = "250ms", value_parser = parse_duration)]
        interval: Duration,
        /// How long to wait at the end for the collector to ack everything.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        flush_timeout: Duration,
        /// Where unacked evidence is spooled while the collector is unreachable.
        #[arg(long, env = "OOMSCOPE_SPOOL")]
        spool: Option<PathBuf>,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Feed a capture file (the torch-h200 fixture format, .json or .json.gz)
    /// through the agent reporter, as a live agent would have sent it.
    Replay {
        file: PathBuf,
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
    /// List the agents the collector knows.
    Agents {
        #[command(flatten)]
        collector: CollectorArg,
        #[arg(long)]
        json: bool,
    },
    /// List incidents: OOMs, deaths by signal, OOM text in a failed exit, lost agents.
    Incidents {
        #[command(flatten)]
        collector: CollectorArg,
        /// Only this agent (id or name).
        #[arg(long)]
        agent: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Show one agent's timeline (id or name).
    Timeline {
        agent: String,
        #[command(flatten)]
        collector: CollectorArg,
        /// Only the last DURATION (e.g. 10m).
        #[arg(long, value_parser = parse_duration)]
        since: Option<Duration>,
        /// Downsample to at most this many samples (events are all kept).
        #[arg(long, default_value_t = 200)]
        max_points: u32,
        #[arg(long)]
        json: bool,
    },
    /// Say which memory ran out, why, and what to change. Without an incident
    /// id: the latest incident (of --agent, when given), or the agent's timeline.
    Diagnose {
        incident: Option<String>,
        #[command(flatten)]
        collector: CollectorArg,
        #[arg(long)]
        agent: Option<String>,
        /// With --agent: only the last DURATION of its timeline.
        #[arg(long, value_parser = parse_duration)]
        since: Option<Duration>,
        #[arg(long)]
        json: bool,
    },
    /// Compare two runs of one workload (incident ids or agent names): what
    /// changed in their configuration, and whether the failure vanished,
    /// moved, shrank or stayed the same.
    Compare {
        a: String,
        b: String,
        #[command(flatten)]
        collector: CollectorArg,
        #[arg(long)]
        json: bool,
    },
    /// Probe a live OpenAI-compatible endpoint: a tiny known-good request first,
    /// then bounded suites, and a safe envelope with the domain bounding each figure.
    Probe(Box<probe::ProbeArgs>),
    /// Write an incident report (the latest incident by default): a
    /// self-contained HTML page with charts, or Markdown on stdout.
    Report {
        incident: Option<String>,
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
    },
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
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (use ms, s, m or h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}` is not a duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OOMSCOPE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,oomscope=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Entry point; returns the process exit status.
pub fn main() -> i32 {
    let cli = Cli::parse();
    init_tracing();
    let result = match cli.verb {
        Verb::Collector {
            listen,
            db,
            lost_grace,
        } => collector::run(listen, db, lost_grace),
        Verb::Run {
            collector,
            name,
            restart,
            backoff,
            backoff_max,
            interval,
            flush_timeout,
            spool,
            command,
        } => {
            let name = name.unwrap_or_else(|| {
                std::path::Path::new(&command[0])
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned())
                    .unwrap_or_else(|| command[0].clone())
            });
            supervise::run(supervise::RunConfig {
                command,
                name,
                collector_url: collector.collector,
                restart,
                backoff_initial: backoff,
                backoff_max,
                interval,
                stderr_tail_bytes: supervise::DEFAULT_STDERR_TAIL_BYTES,
                flush_timeout,
                spool_dir: spool,
            })
        }
        Verb::Replay {
            file,
            collector,
            name,
            speed,
            timeout,
        } => replay::run(&file, &collector.collector, name, speed, timeout),
        Verb::Agents { collector, json } => query::agents(&collector.collector, json),
        Verb::Incidents {
            collector,
            agent,
            json,
        } => query::incidents(&collector.collector, agent, json),
        Verb::Timeline {
            agent,
            collector,
            since,
            max_points,
            json,
        } => query::timeline(&collector.collector, &agent, since, max_points, json),
        Verb::Diagnose {
            incident,
            collector,
            agent,
            since,
            json,
        } => query::diagnose(&collector.collector, incident, agent, since, json),
        Verb::Compare {
            a,
            b,
            collector,
            json,
        } => compare::run(&collector.collector, &a, &b, json),
        Verb::Probe(args) => probe::run(*args),
        Verb::Report {
            incident,
            collector,
            agent,
            html,
            md,
        } => report::run(&collector.collector, incident, agent, html.as_deref(), md),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("oomscope: error: {e:#}");
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert!(parse_duration("5x").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("abc").is_err());
    }
}
