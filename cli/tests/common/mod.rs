//! Shared harness for the end-to-end tests: a real collector process on a
//! loopback port with a real SQLite file, the real `oomscope` binary, and real
//! memory cgroups (we are root).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use oomscope_testkit::agent_stream::{self, AgentStream};
use oomscope_testkit::CollectorProcess;
/// The real H200 captures (shared with agent-core's tests), free ports, the
/// tests' own cgroups and the isolation of launched processes (each test
/// uses some of them).
#[allow(unused_imports)]
pub use oomscope_testkit::{free_port, isolate, torch_h200, TestCgroup};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_oomscope")
}

/// The `oomscope` binary, isolated from the environment of whoever runs the
/// tests: see [`isolate`]. Every test launches it through this.
pub fn oomscope() -> Command {
    let mut c = Command::new(bin());
    isolate(&mut c);
    c
}

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python with torch that scripts/setup-python builds (`.venv`), or
/// `OOMSCOPE_PYTHON`: the reference server's and the torch tests'.
pub fn python() -> String {
    let p = std::env::var("OOMSCOPE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo().join(".venv/bin/python"));
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup-python (these tests run real PyTorch)",
        p.display()
    );
    p.display().to_string()
}

/// The reference servers are CPU-bound torch processes on a 2-core machine:
/// one test at a time, so that timing checks (latency, a herd's admission)
/// measure the server and not its neighbour.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits until the server on `port` answers `GET /health` (at most 60 s).
pub fn await_health(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Command::new("curl")
        .args(["-sf", &format!("http://127.0.0.1:{port}/health")])
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        assert!(
            Instant::now() < deadline,
            "the reference server never became ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The test's collector process (`oomscope collector`, isolated) over `db`;
/// its child, port and url are the process's ([`CollectorProcess`]).
pub struct Collector {
    process: CollectorProcess,
    pub db: PathBuf,
}

impl std::ops::Deref for Collector {
    type Target = CollectorProcess;
    fn deref(&self) -> &CollectorProcess {
        &self.process
    }
}

impl std::ops::DerefMut for Collector {
    fn deref_mut(&mut self) -> &mut CollectorProcess {
        &mut self.process
    }
}

impl Collector {
    /// On a free port: another one if the port was taken before the
    /// collector could bind it.
    pub fn start(db: &Path) -> Collector {
        Self::start_free(db, None)
    }

    /// [`Collector::start`] with its log (stderr) written to `log`.
    pub fn start_free(db: &Path, log: Option<&Path>) -> Collector {
        Collector {
            process: CollectorProcess::start(oomscope, db, log),
            db: db.to_path_buf(),
        }
    }

    /// On `port` (a restart on the port agents know).
    pub fn start_on(db: &Path, port: u16) -> Collector {
        let process = CollectorProcess::start_on(oomscope(), db, port, None)
            .unwrap_or_else(|e| panic!("{e}"));
        Collector {
            process,
            db: db.to_path_buf(),
        }
    }

    /// Runs an `oomscope` query verb against this collector and parses its --json output.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = oomscope()
            .args(args)
            .args(["--collector", &self.url, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "oomscope {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "oomscope {args:?} printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    pub fn text(&self, args: &[&str]) -> String {
        let out = oomscope()
            .args(args)
            .args(["--collector", &self.url])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "oomscope {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Incidents of one agent name, waiting up to `wait` for at least `min` of them.
    pub fn incidents_of(&self, name: &str, min: usize, wait: Duration) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + wait;
        loop {
            let all = self.json(&["incidents"]);
            let mine: Vec<_> = all
                .as_array()
                .unwrap()
                .iter()
                .filter(|i| i["agent_name"] == name)
                .cloned()
                .collect();
            if mine.len() >= min || Instant::now() > deadline {
                return mine;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `oomscope run`'s arguments before its own extra ones: report to `url` as
/// `name`, sampling every 50 ms.
pub fn run_args<'a>(url: &'a str, name: &'a str) -> [&'a str; 7] {
    [
        "run",
        "--collector",
        url,
        "--name",
        name,
        "--interval",
        "50ms",
    ]
}

/// `oomscope run` with the given args before `--` and the command after it.
pub fn run(url: &str, name: &str, extra: &[&str], cmd: &[&str]) -> Output {
    oomscope()
        .args(run_args(url, name))
        .args(extra)
        .arg("--")
        .args(cmd)
        .output()
        .expect("oomscope run")
}

/// `oomscope collector --listen LISTEN --db DB` that is expected to refuse:
/// its output once it exits.
pub fn collector_refusing(listen: &str, db: &Path) -> Output {
    oomscope()
        .args(["collector", "--listen", listen, "--db"])
        .arg(db)
        .output()
        .unwrap()
}

/// A capture of tests/fixtures/torch-h200 by its file name.
pub fn fixture(name: &str) -> PathBuf {
    torch_h200::file(name)
}

/// `oomscope replay` of a capture file into `col` as `name`; fails the test
/// if the replay fails.
pub fn replay(col: &Collector, file: &Path, name: &str) {
    let out = oomscope()
        .arg("replay")
        .arg(file)
        .args(["--collector", &col.url, "--name", name])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "replay {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` with a gRPC channel to `url`, on a runtime of its own.
pub fn with_channel<T, F: std::future::Future<Output = T>>(
    url: &str,
    f: impl FnOnce(tonic::transport::Channel) -> F,
) -> T {
    agent_stream::block_on(async { f(agent_stream::channel(url).await).await })
}

/// Streams `messages` after `hello` to the collector at `url` as an agent
/// would, and waits until the collector has acked every seq.
pub fn stream(
    url: &str,
    hello: oomscope_proto::v1::Hello,
    messages: Vec<oomscope_proto::v1::AgentMessage>,
) {
    let want: std::collections::BTreeSet<u64> = messages.iter().map(|m| m.seq).collect();
    agent_stream::block_on(async {
        let mut agent = AgentStream::connect(url, hello, messages).await;
        agent.acks_covering(&want, |_| {}).await;
    })
}

/// One agent's whole timeline (every sample, every event) over the real gRPC QueryService.
pub fn timeline(url: &str, agent: &str) -> oomscope_proto::v1::TimelineResponse {
    use oomscope_proto::v1 as pb;
    with_channel(url, |ch| async move {
        pb::query_service_client::QueryServiceClient::new(ch)
            .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
            .timeline(pb::TimelineRequest {
                agent: agent.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
    })
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// `oomscope run` in one of the tests' own cgroups.
pub trait RunInCgroup {
    /// [`run`] inside this cgroup: `oomscope run` reporting to `col` as `name`,
    /// without extra args.
    fn run(&self, col: &Collector, name: &str, cmd: &[&str]) -> Output;
}

impl RunInCgroup for TestCgroup {
    fn run(&self, col: &Collector, name: &str, cmd: &[&str]) -> Output {
        let mut argv = vec![bin()];
        argv.extend(run_args(&col.url, name));
        argv.push("--");
        argv.extend_from_slice(cmd);
        self.command(&argv)
            .output()
            .expect("oomscope run in a cgroup")
    }
}

/// `oomscope probe --json ARGS...` and its report. `--json` goes first: a
/// `--launch` command after `--` takes every later word.
pub fn probe(args: &[&str]) -> (i32, serde_json::Value) {
    let out = oomscope()
        .args(["probe", "--json"])
        .args(args)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "probe printed no JSON ({e}): {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

/// The report of suite `name` in a probe report.
pub fn suite<'a>(r: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    r["suites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["suite"] == name)
        .unwrap_or_else(|| panic!("no {name} suite in {r:#}"))
}

/// A diagnosis's evidence lines and its causes', one per line, to search.
pub fn evidence_text(d: &serde_json::Value) -> String {
    let mut all: Vec<String> = d["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .collect();
    for c in d["causes"].as_array().unwrap() {
        all.extend(
            c["evidence"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e.as_str().unwrap().to_string()),
        );
    }
    all.join("\n")
}

/// Whether this process may lower an oom_score_adj below the floor
/// (CAP_SYS_RESOURCE, capability 24, in CapEff).
pub fn has_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 24) != 0)
}
