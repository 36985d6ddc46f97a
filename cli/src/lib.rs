//! The `oomscope` command, one module per verb: `collector`, `run` (the
//! supervisor), `node` (the per-host watcher), `replay`, the queries (`agents`, `incidents`, `timeline`,
//! `diagnose`), `compare`, `probe`, `report` and `bench ingest`. Each verb is a
//! thin shell: the work lives in the collector, supervisor, agent-core,
//! analysis, report, probe and replay crates. The command line itself (every
//! flag and its help) is in [`args`].

mod agents;
pub mod args;
mod bench_ingest;
mod collector;
use oomscope_collector::serve::TlsFiles;
mod compare;
mod diagnose;
mod fixture;
mod incidents;
mod node;
mod output;
mod probe;
mod replay;
mod report;
mod retest;
mod run;
mod since;
mod timeline;

use clap::{CommandFactory, Parser};

use args::{BenchVerb, Cli, Verb};

/// The exit status of oomscope's own errors, for every verb; clap exits with
/// the same status on a usage error, so 2 always means "oomscope failed".
pub const ERROR_EXIT: i32 = 2;

/// The whole command line, with every verb, for tests and tools that read
/// the help (the docs of `oomscope --help` live in [`args`]).
pub fn command() -> clap::Command {
    Cli::command()
}

/// The log filter without `OOMSCOPE_LOG`: oomscope's own crates at info
/// (a target matches by prefix, so `oomscope` covers every `oomscope_*`),
/// dependencies at warn. Tonic's server logs every failed accept at debug:
/// out of descriptors that was millions of lines; `OOMSCOPE_LOG=info,tonic=debug`
/// shows why a connection dropped.
const DEFAULT_LOG: &str = "warn,oomscope=info";

fn init_tracing() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("OOMSCOPE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only where a person reads them: not in a log file.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Entry point; returns the process exit status.
pub fn main() -> i32 {
    let cli = Cli::parse();
    // Still one thread: the environment may change safely.
    if let Some(c) = cli.verb.collector_arg() {
        c.export_token();
    }
    init_tracing();
    let result = match cli.verb {
        Verb::Collector {
            listen,
            db,
            lost_grace,
            limits,
            token_file,
            insecure,
            tls_cert,
            tls_key,
            tls_client_ca,
            metrics,
            retain,
        } => collector::run(collector::Options {
            metrics,
            retain,
            tls: tls_cert.zip(tls_key).map(|(cert, key)| TlsFiles {
                cert,
                key,
                client_ca: tls_client_ca,
            }),
            listen,
            db,
            lost_grace,
            limits: limits.limits(),
            token_file,
            insecure,
        }),
        Verb::Run(args) => run::run(args),
        Verb::Node(args) => node::run(args),
        Verb::Replay {
            file,
            collector,
            name,
            speed,
            timeout,
        } => replay::run(&file, &collector.collector, name, speed, timeout),
        Verb::Agents {
            collector,
            json,
            since,
            host,
        } => agents::run(&collector.collector, json, since, host),
        Verb::Incidents {
            collector,
            agent,
            json,
            since,
            domain,
            cause,
            host,
        } => incidents::run(
            &collector.collector,
            agent,
            incidents::Filter {
                since,
                domain,
                cause,
                host,
            },
            json,
        ),
        Verb::Timeline {
            agent,
            collector,
            since,
            max_points,
            json,
        } => timeline::run(&collector.collector, &agent, since, max_points, json),
        Verb::Diagnose {
            incident,
            collector,
            agent,
            since,
            json,
        } => diagnose::run(&collector.collector, incident, agent, since, json),
        Verb::Compare {
            a,
            b,
            collector,
            json,
        } => compare::run(&collector.collector, &a, &b, json),
        Verb::Probe(args) => probe::run(*args),
        Verb::Retest(args) => retest::run(*args),
        Verb::Fixture {
            incident,
            collector,
            out,
        } => fixture::run(&collector.collector, &incident, out.as_deref()),
        Verb::Report {
            incident,
            collector,
            agent,
            html,
            md,
            force,
        } => report::run(
            &collector.collector,
            incident,
            agent,
            html.as_deref(),
            md,
            force,
        ),
        Verb::Bench(BenchVerb::Ingest {
            collector,
            agents,
            samples,
            window,
            complete_counters,
            rate,
            json,
        }) => bench_ingest::run(
            &collector.collector,
            bench_ingest::Load {
                agents,
                samples,
                window,
                complete_counters,
                rate,
            },
            json,
        ),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("oomscope: error: {e:#}");
            ERROR_EXIT
        }
    }
}
