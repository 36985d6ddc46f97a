//! Shared harness for the end-to-end tests: a real collector process on a
//! loopback port with a real SQLite file, the real `oomscope` binary, and real
//! memory cgroups (we are root).
#![allow(dead_code)]

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The real H200 captures (shared with agent-core's tests).
#[path = "../../../tests/support/torch_h200.rs"]
pub mod torch_h200;

#[path = "../../../tests/support/collector_log.rs"]
mod collector_log;

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

/// Removes oomscope's variables (`OOMSCOPE_COLLECTOR`, `_SPOOL`, `_DB`,
/// `_NAME`, ...) from what `c` inherits, but the log filter: a launched
/// process reaches the test's own collector, given on its command line, or
/// none; never a collector or spool of the person running the tests.
pub fn isolate(c: &mut Command) -> &mut Command {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("OOMSCOPE_") && key != "OOMSCOPE_LOG" {
            c.env_remove(&key);
        }
    }
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

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Collector {
    pub child: Option<Child>,
    /// The thread copying its log; joined once it exits, so the whole log
    /// is written when a test reads it after [`Collector::kill`].
    log: Option<JoinHandle<()>>,
    pub port: u16,
    pub db: PathBuf,
    pub url: String,
}

/// Tries of [`Collector::start`]: a free port can be taken by another
/// process between [`free_port`] and the collector's bind.
const START_TRIES: usize = 5;

impl Collector {
    /// On a free port: another one if the port was taken before the
    /// collector could bind it.
    pub fn start(db: &Path) -> Collector {
        Self::start_free(db, None)
    }

    /// [`Collector::start`] with its log (stderr) written to `log`.
    pub fn start_free(db: &Path, log: Option<&Path>) -> Collector {
        let mut why = String::new();
        for _ in 0..START_TRIES {
            match Self::try_start(db, free_port(), log) {
                Ok(c) => return c,
                Err(e) => why = e,
            }
        }
        panic!("no collector started in {START_TRIES} tries: {why}");
    }

    /// On `port` (a restart on the port agents know).
    pub fn start_on(db: &Path, port: u16) -> Collector {
        Self::try_start(db, port, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Ready once the collector says it listens (`collector_log`).
    fn try_start(db: &Path, port: u16, log: Option<&Path>) -> Result<Collector, String> {
        let mut child = oomscope()
            .args([
                "collector",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--db",
            ])
            .arg(db)
            .args(["--lost-grace", "1s"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start collector");
        let sink: Box<dyn Write + Send> = match log {
            Some(path) => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .expect("open the collector's log"),
            ),
            None => Box::new(std::io::stderr()),
        };
        let copier = collector_log::wait_listening(&mut child, sink)
            .map_err(|e| format!("port {port}: {e}"))?;
        Ok(Collector {
            child: Some(child),
            log: Some(copier),
            port,
            db: db.to_path_buf(),
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    /// SIGKILL: the collector gets no chance to flush anything.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(copier) = self.log.take() {
            let _ = copier.join();
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

impl Drop for Collector {
    fn drop(&mut self) {
        self.kill();
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
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(url.to_string())
            .unwrap()
            .connect()
            .await
            .unwrap();
        f(ch).await
    })
}

/// Streams `messages` after `hello` to the collector at `url` as an agent
/// would, and waits until the collector has acked every seq.
pub fn stream(
    url: &str,
    hello: oomscope_proto::v1::Hello,
    messages: Vec<oomscope_proto::v1::AgentMessage>,
) {
    use oomscope_proto::v1 as pb;
    use tonic::codegen::tokio_stream::{self as stream, StreamExt};
    let want: std::collections::BTreeSet<u64> = messages.iter().map(|m| m.seq).collect();
    with_channel(url, |ch| async move {
        let mut first = vec![pb::AgentMessage {
            seq: 0,
            body: Some(pb::agent_message::Body::Hello(hello)),
        }];
        first.extend(messages);
        let mut replies = pb::agent_service_client::AgentServiceClient::new(ch)
            // Kept open after the messages: a closed stream may end before its acks.
            .connect(stream::iter(first).chain(stream::pending()))
            .await
            .unwrap()
            .into_inner();
        let mut acked = std::collections::BTreeSet::new();
        while !want.is_subset(&acked) {
            let reply = tokio::time::timeout(Duration::from_secs(10), replies.message())
                .await
                .expect("acks within 10 s")
                .unwrap();
            match reply.and_then(|r| r.body) {
                Some(pb::collector_message::Body::Ack(a)) => acked.extend(a.from_seq..=a.to_seq),
                other => panic!("expected acks, got {other:?}"),
            }
        }
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

/// A memory cgroup made for one test under the test's own memory cgroup, and
/// removed afterwards (after its processes have ended).
pub struct TestCgroup {
    pub dir: PathBuf,
    /// The path as /proc/<pid>/cgroup names it.
    pub path: String,
    pub version: &'static str,
}

impl TestCgroup {
    /// Our own memory cgroup: (directory, path, version), as the agent finds
    /// it. None without a memory controller.
    pub fn own() -> Option<(PathBuf, String, &'static str)> {
        use oomscope_agent_core::readers::{cgroup, HostPaths};
        let cg = cgroup::locate(&HostPaths::system(), std::process::id())?;
        cg.dir
            .exists()
            .then(|| (cg.dir, cg.path, cg.version.as_str()))
    }

    /// A child of `parent` (or of our own cgroup) with an optional limit.
    pub fn create(parent: Option<&TestCgroup>, name: &str, limit: Option<u64>) -> TestCgroup {
        let (pdir, ppath, version) = match parent {
            Some(p) => (p.dir.clone(), p.path.clone(), p.version),
            None => {
                let (d, p, v) = Self::own().expect("this test needs a memory cgroup controller");
                if v == "v2" {
                    delegate_v2(&d);
                    (d, p, v)
                } else {
                    (d, p, v)
                }
            }
        };
        let unique = format!("{name}-{}", std::process::id());
        let dir = pdir.join(&unique);
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let path = format!("{}/{unique}", ppath.trim_end_matches('/'));
        if version == "v2" && parent.is_some() {
            // A v2 parent hands the controller down; a leaf must not enable it
            // for its own children, or it could hold no processes.
            std::fs::write(pdir.join("cgroup.subtree_control"), "+memory").unwrap();
        }
        let cg = TestCgroup { dir, path, version };
        if let Some(l) = limit {
            let (file, swapfile) = if version == "v1" {
                ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
            } else {
                ("memory.max", "memory.swap.max")
            };
            std::fs::write(cg.dir.join(file), l.to_string()).unwrap();
            // No swap escape hatch: the limit must bite (ignored where swap accounting is off).
            let _ = std::fs::write(
                cg.dir.join(swapfile),
                if version == "v1" {
                    l.to_string()
                } else {
                    "0".into()
                },
            );
        }
        cg
    }

    /// [`run`] inside this cgroup: `oomscope run` reporting to `col` as `name`,
    /// without extra args.
    pub fn run(&self, col: &Collector, name: &str, cmd: &[&str]) -> Output {
        let mut argv = vec![bin()];
        argv.extend(run_args(&col.url, name));
        argv.push("--");
        argv.extend_from_slice(cmd);
        self.command(&argv)
            .output()
            .expect("oomscope run in a cgroup")
    }

    /// `sh -c` that moves itself into this cgroup, then execs `argv`.
    pub fn command(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("sh");
        isolate(&mut c);
        c.arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec \"$@\"",
                self.dir.display()
            ))
            .arg("sh")
            .args(argv);
        c
    }
}

/// v2 allows no processes in a cgroup that hands the memory controller to its
/// children: move ours into a leaf, then enable the controller below our own
/// cgroup (creating test cgroups under the root is refused in some containers).
fn delegate_v2(own: &std::path::Path) {
    let enabled = std::fs::read_to_string(own.join("cgroup.subtree_control")).unwrap_or_default();
    if enabled.split_whitespace().any(|c| c == "memory") {
        return;
    }
    let leaf = own.join("oomscope-init");
    let _ = std::fs::create_dir(&leaf);
    for pid in std::fs::read_to_string(own.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
    {
        let _ = std::fs::write(leaf.join("cgroup.procs"), pid);
    }
    std::fs::write(own.join("cgroup.subtree_control"), "+memory")
        .expect("enable the memory controller for test cgroups");
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes may take a moment to leave after they were killed.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "warning: could not remove test cgroup {}",
            self.dir.display()
        );
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
