//! A test collector's readiness and log, for the test harnesses that start
//! `oomscope collector` (each includes this file with `#[path]`).
//!
//! Ready is the collector's own "listening" line, printed only once the
//! port is its own. A connect can reach whatever else holds the port: once
//! a collector that failed to bind (the port, free a moment before, taken
//! by another test) was taken for ready, and its agents were refused for
//! the rest of the test.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::Child;
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
