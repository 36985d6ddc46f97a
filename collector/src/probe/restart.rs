//! The restart suite. After a power cut or a crash, retried work arrives at
//! once; a server that admits it before it is ready, or all at full rate, or
//! processes a retried request twice, fails again or corrupts work. The probe
//! launches the server itself under `oomscope run --restart`, so the process
//! it kills is one it started (a descendant), drives load, kills the server,
//! and checks three things:
//! - readiness gates traffic: nothing is admitted before the readiness
//!   endpoint says ready;
//! - traffic returns gradually: right after readiness the server admits less
//!   of a herd than it does in steady state;
//! - idempotent request ids are not processed twice across the restart.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::json;

use super::http::{request, Endpoint};
use super::load::{burst, complete, count, Ask, Call, Outcome};
use super::report::{Status, SuiteReport};
use super::Probe;

#[derive(Clone, Debug)]
pub struct RestartConfig {
    /// Concurrent clients of the background load: enough to be "under load"
    /// without being an overload test.
    pub load_concurrency: usize,
    /// Requests of the herd sent at readiness, and in steady state to compare.
    pub herd: usize,
    /// Idempotency keys sent (and completed) before the kill, then resent.
    pub keys: usize,
    /// How long the server may take to become ready (model load included).
    pub ready_timeout: Duration,
    /// How long the load runs before the kill.
    pub load_before_kill: Duration,
}

impl Default for RestartConfig {
    fn default() -> Self {
        RestartConfig {
            load_concurrency: 4,
            herd: 32,
            keys: 8,
            ready_timeout: Duration::from_secs(120),
            load_before_kill: Duration::from_secs(2),
        }
    }
}

/// The launched `oomscope run` and the log of the server's output.
struct Launched {
    child: Child,
    log: PathBuf,
}

impl Launched {
    /// The server process: the supervisor's child.
    fn server_pid(&self) -> Option<i32> {
        let pid = self.child.id();
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    /// SIGTERM to the supervisor (it passes it on to the server), then SIGKILL after 10 s.
    fn stop(mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signals a process this probe started.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(server) = self.server_pid() {
            unsafe { libc::kill(server, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ready(ep: &Endpoint, path: &str) -> bool {
    let root = Endpoint {
        prefix: String::new(),
        ..ep.clone()
    };
    matches!(request(&root, "GET", path, None, &[], Duration::from_secs(2)), Ok(r) if r.status == 200)
}

fn wait_ready(ep: &Endpoint, path: &str, timeout: Duration) -> Option<Instant> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if ready(ep, path) {
            return Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

impl Probe {
    fn launch(&self, cmd: &[String]) -> anyhow::Result<Launched> {
        let exe = std::env::current_exe()?;
        let log =
            std::env::temp_dir().join(format!("oomscope-probe-server-{}.log", std::process::id()));
        let out = std::fs::File::create(&log)?;
        let mut c = Command::new(exe);
        c.arg("run").args([
            "--restart",
            "3",
            "--backoff",
            "200ms",
            "--flush-timeout",
            "2s",
        ]);
        if let Some(url) = &self.cfg.collector {
            c.args(["--collector", url]);
        }
        if let Some(a) = &self.cfg.agent {
            c.args(["--name", a]);
        }
        c.arg("--")
            .args(cmd)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        Ok(Launched {
            child: c.spawn()?,
            log,
        })
    }

    pub fn restart(&mut self) -> SuiteReport {
        let t = Instant::now();
        let fail = |why: String, findings: serde_json::Value| SuiteReport {
            suite: "restart".into(),
            status: Status::Error,
            verdict: "could not run".into(),
            reason: Some(why),
            steps: vec![],
            findings,
            duration_s: t.elapsed().as_secs_f64(),
        };
        let Some(cmd) = self.cfg.launch.clone() else {
            return fail("the restart suite launches the server itself: pass --launch \"CMD ARGS\" (it runs under `oomscope run --restart`)".into(), json!({}));
        };
        if ready(&self.ep, &self.cfg.ready_path) {
            return fail(format!("something already answers {} on {}:{}; the restart suite needs that port for the server it launches", self.cfg.ready_path, self.ep.host, self.ep.port), json!({}));
        }
        let launched = match self.launch(&cmd) {
            Ok(l) => l,
            Err(e) => {
                return fail(
                    format!("cannot launch `{}`: {e:#}", cmd.join(" ")),
                    json!({}),
                )
            }
        };
        let report = self.restart_with(&launched, t);
        let log = launched.log.clone();
        launched.stop();
        let mut report = report;
        report.findings["server_log"] = json!(log.display().to_string());
        report
    }

    fn restart_with(&mut self, l: &Launched, t: Instant) -> SuiteReport {
        let rc = self.cfg.restart_settings.clone();
        let ready_path = self.cfg.ready_path.clone();
        let mut findings = json!({});
        let err = |why: String, findings: serde_json::Value| SuiteReport {
            suite: "restart".into(),
            status: Status::Error,
            verdict: "could not run".into(),
            reason: Some(why),
            steps: vec![],
            findings,
            duration_s: t.elapsed().as_secs_f64(),
        };
        if wait_ready(&self.ep, &ready_path, rc.ready_timeout).is_none() {
            return err(format!("the launched server never reported ready on {ready_path} within {:.0} s (log: {})", rc.ready_timeout.as_secs_f64(), l.log.display()), findings);
        }
        let ask = |key: Option<String>, timeout: Duration| Ask {
            model: self.cfg.model.clone(),
            prompt_words: 16,
            max_tokens: 4,
            idempotency_key: key,
            timeout,
        };
        // Idempotent requests that complete before the kill.
        let run_id = format!("{:x}", oomscope_agent_core::now_ns());
        let keyed: Vec<(String, Call)> = (0..rc.keys)
            .map(|i| {
                let key = format!("probe-{run_id}-{i}");
                let c = complete(
                    &self.ep,
                    &ask(Some(key.clone()), self.cfg.request_timeout),
                    Instant::now(),
                );
                (key, c)
            })
            .collect();
        // Steady state: how much of a herd the server admits when warm.
        let steady = burst(
            &self.ep,
            (0..rc.herd)
                .map(|_| ask(None, self.cfg.request_timeout))
                .collect(),
        );
        let steady_ok = count(&steady, Outcome::Ok);

        // Background load, then the kill.
        let stop = AtomicBool::new(false);
        let calls: Mutex<Vec<(Instant, Call)>> = Mutex::new(Vec::new());
        let t0 = Instant::now();
        let mut killed_at = None;
        let mut ready_at = None;
        std::thread::scope(|s| {
            for _ in 0..rc.load_concurrency {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let started = Instant::now();
                        let c = complete(&self.ep, &ask(None, Duration::from_secs(10)), t0);
                        let refused_fast =
                            matches!(c.outcome, Outcome::Unreachable | Outcome::Refused);
                        calls.lock().unwrap().push((started, c));
                        if refused_fast {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                });
            }
            std::thread::sleep(rc.load_before_kill);
            if let Some(pid) = l.server_pid() {
                // SAFETY: the server is a descendant this probe launched.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                killed_at = Some(Instant::now());
                // Poll readiness while the load keeps knocking.
                std::thread::sleep(Duration::from_millis(100));
                ready_at = wait_ready(&self.ep, &ready_path, rc.ready_timeout);
            }
            stop.store(true, Ordering::Relaxed);
        });
        let Some(killed_at) = killed_at else {
            return err(
                "could not find the launched server's process to kill".into(),
                findings,
            );
        };
        let Some(ready_at) = ready_at else {
            return err(format!("the server did not come back (ready on {ready_path}) within {:.0} s of the kill (log: {})", rc.ready_timeout.as_secs_f64(), l.log.display()), findings);
        };
        // The herd at readiness: retried work arriving at once.
        let herd = burst(
            &self.ep,
            (0..rc.herd)
                .map(|_| ask(None, self.cfg.request_timeout))
                .collect(),
        );
        let herd_ok = count(&herd, Outcome::Ok);
        // Resend the idempotent requests.
        let mut duplicates = Vec::new();
        let mut resent_ok = 0;
        for (key, first) in &keyed {
            let again = complete(
                &self.ep,
                &ask(Some(key.clone()), self.cfg.request_timeout),
                Instant::now(),
            );
            if again.outcome != Outcome::Ok {
                continue;
            }
            resent_ok += 1;
            let same = again.replayed || (first.id.is_some() && first.id == again.id);
            if first.outcome == Outcome::Ok && !same {
                duplicates.push(key.clone());
            }
        }
        let keyed_ok = keyed
            .iter()
            .filter(|(_, c)| c.outcome == Outcome::Ok)
            .count();

        // Admitted before ready: answered (200, or a server error: work was taken on)
        // by a server that had been killed and had not yet said ready.
        let calls = calls.into_inner().unwrap();
        let before_ready: Vec<&Call> = calls
            .iter()
            .filter(|(started, c)| {
                *started > killed_at && matches!(c.outcome, Outcome::Ok | Outcome::ServerError)
            })
            .map(|(started, c)| (started, c))
            .filter(|(started, c)| {
                **started + Duration::from_secs_f64(c.latency_ms / 1e3) < ready_at
            })
            .map(|(_, c)| c)
            .collect();
        let mut problems = Vec::new();
        if !before_ready.is_empty() {
            let ok = before_ready
                .iter()
                .filter(|c| c.outcome == Outcome::Ok)
                .count();
            problems.push(format!(
                "readiness does not gate traffic: {} requests were admitted before {ready_path} said ready ({ok} answered 200, {} failed)",
                before_ready.len(),
                before_ready.len() - ok
            ));
        }
        let gradual = herd_ok < steady_ok || (steady_ok == 0 && herd_ok == 0);
        if !gradual {
            problems.push(format!(
                "no gradual restore: right after readiness the server admitted {herd_ok} of a {}-request herd, as many as warm ({steady_ok})",
                rc.herd
            ));
        }
        if !duplicates.is_empty() {
            problems.push(format!(
                "{} of {keyed_ok} idempotent requests were processed again after the restart (new completion ids for the same Idempotency-Key)",
                duplicates.len()
            ));
        }
        if keyed_ok == 0 {
            problems.push("no idempotent request completed before the kill, so duplicates could not be checked".into());
        }
        let recovery_s = ready_at.duration_since(killed_at).as_secs_f64();
        findings = json!({
            "recovery_s": recovery_s,
            "admitted_before_ready": before_ready.len(),
            "load_calls": calls.len(),
            "steady_herd_admitted": steady_ok,
            "restore_herd_admitted": herd_ok,
            "herd": rc.herd,
            "idempotent_sent": rc.keys,
            "idempotent_completed_before_kill": keyed_ok,
            "idempotent_resent_ok": resent_ok,
            "duplicates": duplicates.len(),
        });
        let _ = std::io::stderr().flush();
        let (status, verdict) = if problems.is_empty() {
            (Status::Pass, format!(
                "back in {recovery_s:.1} s; nothing admitted before ready; restored gradually ({herd_ok} of {} admitted at first vs {steady_ok} warm); no duplicate processing of {keyed_ok} idempotent requests",
                rc.herd
            ))
        } else {
            (Status::Fail, problems.join("; "))
        };
        SuiteReport {
            suite: "restart".into(),
            status,
            verdict,
            reason: None,
            steps: vec![],
            findings,
            duration_s: t.elapsed().as_secs_f64(),
        }
    }
}
