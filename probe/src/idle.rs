//! Before a rung: the probe's own abandoned requests (timed out or cut by
//! a budget) may still run on the server; a server that serves one at a
//! time would make the next rung wait behind them, and its latency bound
//! would fire on the probe's own leftovers. So the probe waits until the
//! server is idle: its running count where it reports one, else a tiny
//! request answered within twice its calibrated latency; at most
//! [`MAX_IDLE_WAIT`], after which the rung says the server was still busy.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::load::{complete, Outcome};
use crate::Probe;

/// The longest wait for the server to finish the probe's abandoned requests.
pub const MAX_IDLE_WAIT: Duration = Duration::from_secs(120);

/// A tiny request answered within this many times its calibrated latency
/// found the server idle.
pub const IDLE_FACTOR: f64 = 2.0;

/// A calibrated latency below this is held to this (a loopback request's
/// jitter is a few ms).
const IDLE_FLOOR_MS: f64 = 20.0;

/// Between two readings of the server's running count.
const POLL: Duration = Duration::from_millis(250);

/// Words in the tiny request (as the smoke's).
const TINY_WORDS: usize = 4;

/// How a rung waited for the server to finish the probe's earlier requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IdleWait {
    pub waited_ms: f64,
    /// "server_metrics" (its running count) or "tiny_request".
    pub method: String,
    /// It was still busy when the wait ended (at most 2 minutes, or the deadline).
    pub still_busy: bool,
    pub detail: String,
}

impl Probe {
    /// Waits, where an earlier request was abandoned, until the server has
    /// finished or cancelled it. None when nothing was abandoned.
    pub(crate) fn await_idle(&mut self) -> Option<IdleWait> {
        if !self.abandoned {
            return None;
        }
        let t = Instant::now();
        let limit = MAX_IDLE_WAIT.min(self.deadline_left());
        let counted = self.server.load.clone().and_then(|src| loop {
            let r = src.read(&self.ep, Duration::from_secs(2))?;
            let busy = r.running? + r.waiting.unwrap_or(0.0);
            if busy < 0.5 {
                return Some((false, format!("{} said none running", src.label())));
            }
            if t.elapsed() >= limit {
                return Some((
                    true,
                    format!("{} still said {busy:.0} running or waiting", src.label()),
                ));
            }
            std::thread::sleep(POLL);
        });
        let (method, (still_busy, detail)) = match counted {
            Some(c) => ("server_metrics", c),
            None => ("tiny_request", self.tiny_until_quick(t, limit)),
        };
        self.abandoned = still_busy;
        let w = IdleWait {
            waited_ms: t.elapsed().as_secs_f64() * 1e3,
            method: method.into(),
            still_busy,
            detail,
        };
        self.progress.line(&format!(
            "waited {:.1} s for the server to finish the probe's abandoned requests ({})",
            w.waited_ms / 1e3,
            w.detail
        ));
        Some(w)
    }

    /// Tiny requests, one after another, until one is answered within
    /// [`IDLE_FACTOR`] times the calibrated latency. Each waits as long as
    /// the wait has left, so none is abandoned in turn: a slow answer means
    /// it queued behind the leftovers, which have finished by then.
    fn tiny_until_quick(&mut self, t: Instant, limit: Duration) -> (bool, String) {
        let quick = (IDLE_FACTOR * self.tiny_ms.unwrap_or(IDLE_FLOOR_MS)).max(IDLE_FLOOR_MS);
        let mut last = String::from("no tiny request was answered");
        while t.elapsed() < limit {
            let left = limit
                .saturating_sub(t.elapsed())
                .max(Duration::from_millis(50));
            let ask = self.ask(TINY_WORDS, 4, left);
            let call = complete(&self.ep, &ask, Instant::now());
            self.after_calls(std::slice::from_ref(&call));
            match call.outcome {
                Outcome::Ok if call.latency_ms <= quick => {
                    return (
                        false,
                        format!(
                            "a tiny request was answered in {:.0} ms, within {IDLE_FACTOR}x its calibrated {:.0} ms",
                            call.latency_ms,
                            quick / IDLE_FACTOR
                        ),
                    );
                }
                Outcome::Ok => {
                    last = format!(
                        "a tiny request took {:.0} ms (idle: within {quick:.0} ms)",
                        call.latency_ms
                    )
                }
                _ => {
                    last = format!(
                        "a tiny request ended {:?}: {}",
                        call.outcome,
                        call.error.as_deref().unwrap_or("")
                    );
                    std::thread::sleep(POLL);
                }
            }
        }
        (
            true,
            format!("still busy after {:.0} s: {last}", limit.as_secs_f64()),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    use crate::http::{request, Endpoint, Failure};

    #[test]
    fn an_abandoned_request_closes_its_connection_so_the_server_can_notice() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // A server that reads the request and never answers, then waits to
        // see the client go: a read of 0 bytes is the connection closed.
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = [0u8; 4096];
            let mut got = 0;
            while !String::from_utf8_lossy(&buf[..got]).contains("\r\n\r\n") {
                got += s.read(&mut buf[got..]).unwrap();
            }
            let t = Instant::now();
            let closed = loop {
                match s.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(_) => continue,
                    Err(_) => break false,
                }
            };
            (closed, t.elapsed())
        });
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}/v1")).unwrap();
        let e = request(&ep, "GET", "/models", None, &[], Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind, Failure::Timeout, "{e}");
        let (closed, after) = server.join().unwrap();
        assert!(closed, "the probe kept the abandoned connection open");
        assert!(after < Duration::from_secs(5), "{after:?}");
    }
}
