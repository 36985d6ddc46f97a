//! An `oomscope collector` process for a test: on a free loopback port over
//! the test's SQLite file, its log copied, ready once it says it listens.
//!
//! Ready is the collector's own "listening" line, printed only once the
//! port is its own. A connect can reach whatever else holds the port: once
//! a collector that failed to bind (the port, free a moment before, taken
//! by another test) was taken for ready, and its agents were refused for
//! the rest of the test.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How the collector's stderr line begins once it listens (`cli/src/collector.rs`).
pub const LISTENING: &str = "oomscope collector listening on";

/// How long a collector may take to listen.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Copies the stderr of `child` (spawned with it piped) to `sink`, line by
/// line, to its end, and waits for the collector to listen. Ok: the thread
/// copying (it ends with the child). Err: why it is not listening; the
/// child has been reaped.
pub fn wait_listening(
    child: &mut Child,
    mut sink: Box<dyn Write + Send>,
) -> Result<JoinHandle<()>, String> {
    let stderr = child.stderr.take().expect("the collector's stderr, piped");
    let (tx, rx) = mpsc::channel();
    let copier = std::thread::spawn(move || {
        let mut ready = Some(tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(sink, "{line}");
            if line.starts_with(LISTENING) {
                if let Some(tx) = ready.take() {
                    let _ = tx.send(());
                }
            }
        }
    });
    match rx.recv_timeout(READY_TIMEOUT) {
        Ok(()) => Ok(copier),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            let status = child.wait().expect("wait for the collector");
            let _ = copier.join();
            Err(format!(
                "the collector exited ({status}) before listening: its log says why"
            ))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            let _ = child.kill();
            let _ = child.wait();
            let _ = copier.join();
            Err(format!(
                "the collector did not listen within {READY_TIMEOUT:?}"
            ))
        }
    }
}

/// Tries of [`CollectorProcess::start`]: a free port can be taken by another
/// process between [`crate::free_port`] and the collector's bind.
const START_TRIES: usize = 5;

/// A running `oomscope collector` (killed when dropped), with a lost grace
/// of 1 s so that tests see lost agents quickly.
pub struct CollectorProcess {
    pub child: Option<Child>,
    /// The thread copying its log; joined once it exits, so the whole log
    /// is written when a test reads it after [`CollectorProcess::kill`].
    log: Option<JoinHandle<()>>,
    pub port: u16,
    pub url: String,
}

impl CollectorProcess {
    /// On a free port: another one if the port was taken before the
    /// collector could bind it. `oomscope` makes the binary's command (as
    /// the caller isolates it); the log (stderr) goes to `log`, or to the
    /// test's stderr.
    pub fn start(oomscope: impl Fn() -> Command, db: &Path, log: Option<&Path>) -> Self {
        Self::start_with(oomscope, db, &[], log)
    }

    /// [`CollectorProcess::start`] with `extra` arguments after the
    /// collector's own (`--token-file F`, `--tls-cert F`, `--metrics A`).
    pub fn start_with(
        oomscope: impl Fn() -> Command,
        db: &Path,
        extra: &[&std::ffi::OsStr],
        log: Option<&Path>,
    ) -> Self {
        let mut why = String::new();
        for _ in 0..START_TRIES {
            match Self::start_on_with(oomscope(), db, crate::free_port(), extra, log) {
                Ok(c) => return c,
                Err(e) => why = e,
            }
        }
        panic!("no collector started in {START_TRIES} tries: {why}");
    }

    /// On `port` (a restart on the port agents know). Ready once the
    /// collector says it listens; Err: why not (the child is reaped).
    pub fn start_on(
        oomscope: Command,
        db: &Path,
        port: u16,
        log: Option<&Path>,
    ) -> Result<Self, String> {
        Self::start_on_with(oomscope, db, port, &[], log)
    }

    fn start_on_with(
        mut oomscope: Command,
        db: &Path,
        port: u16,
        extra: &[&std::ffi::OsStr],
        log: Option<&Path>,
    ) -> Result<Self, String> {
        let mut child = oomscope
            .args([
                "collector",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--db",
            ])
            .arg(db)
            .args(["--lost-grace", "1s"])
            .args(extra)
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
        let copier = wait_listening(&mut child, sink).map_err(|e| format!("port {port}: {e}"))?;
        Ok(CollectorProcess {
            child: Some(child),
            log: Some(copier),
            port,
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
}

impl Drop for CollectorProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
