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

/// A gradual restore admits at most this share of what the warm server
/// admits of the same herd. A herd counts requests admitted and answered, so
/// a cold server without any ramp already answers fewer than a warm one (12
/// against 16 to 20, seen here), while the reference server's ramp from 10 %
/// admitted 1 to 6 against 15 to 16.
pub const GRADUAL_AT_MOST: f64 = 0.5;
/// Words in the restart suite's prompts: small requests, so that the herd
/// measures admission rather than compute.
const RESTART_WORDS: usize = 16;
/// Warm-up herds go out this far apart, so a ramping server admits visibly
/// more each time...
const WARM_HERD_GAP: Duration = Duration::from_secs(1);
/// ...and its admission is steady once this many herds in a row admit no
/// more than the best so far.
const WARM_FLAT_HERDS: u32 = 3;

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
    /// The longest wait for the server to reach steady admission after a start.
    pub warm_timeout: Duration,
}

impl Default for RestartConfig {
    fn default() -> Self {
        RestartConfig {
            load_concurrency: 4,
            herd: 32,
            keys: 8,
            ready_timeout: Duration::from_secs(120),
            load_before_kill: Duration::from_secs(2),
            warm_timeout: Duration::from_secs(30),
        }
    }
}

/// The launched `oomscope run` and the log of the server's output.
pub struct Launched {
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
    pub fn stop(mut self) {
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

pub fn ready(ep: &Endpoint, path: &str) -> bool {
    matches!(request(&ep.root(), "GET", path, None, &[], Duration::from_secs(2)), Ok(r) if r.status == 200)
}

pub fn wait_ready(ep: &Endpoint, path: &str, timeout: Duration) -> Option<Instant> {
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
    /// Starts `cmd` under `oomscope run --restart` (this probe's own child)
    /// and waits until it reports ready.
    pub fn launch(&self, cmd: &[String]) -> anyhow::Result<Launched> {
        if ready(&self.ep, &self.cfg.ready_path) {
            anyhow::bail!(
                "something already answers {} on {}:{}; --launch needs that port for the server it starts",
                self.cfg.ready_path,
                self.ep.host,
                self.ep.port
            );
        }
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
        let launched = Launched {
            child: c.spawn()?,
            log,
        };
        if wait_ready(
            &self.ep,
            &self.cfg.ready_path,
            self.cfg.restart_settings.ready_timeout,
        )
        .is_none()
        {
            let log = launched.log.clone();
            launched.stop();
            anyhow::bail!(
                "the launched server never reported ready on {} within {:.0} s (its output: {})",
                self.cfg.ready_path,
                self.cfg.restart_settings.ready_timeout.as_secs_f64(),
                log.display()
            );
        }
        Ok(launched)
    }

    pub fn restart(&mut self) -> SuiteReport {
        let t = Instant::now();
        let Some(l) = self.launched.take() else {
            return SuiteReport {
                suite: "restart".into(),
                status: Status::Error,
                verdict: "could not run".into(),
                reason: Some("the restart suite needs the server launched by the probe: pass --launch -- CMD ARGS (it runs under `oomscope run --restart`)".into()),
                steps: vec![],
                findings: json!({}),
                duration_s: 0.0,
                budget_s: None,
            };
        };
        let mut report = self.restart_with(&l, t);
        report.findings["server_log"] = json!(l.log.display().to_string());
        self.launched = Some(l);
        report
    }

    fn restart_with(&self, l: &Launched, t: Instant) -> SuiteReport {
        let rc = self.cfg.restart_settings.clone();
        let ready_path = self.cfg.ready_path.clone();
        let err = |why: String| SuiteReport {
            suite: "restart".into(),
            status: Status::Error,
            verdict: "could not run".into(),
            reason: Some(why),
            steps: vec![],
            findings: json!({}),
            duration_s: t.elapsed().as_secs_f64(),
            budget_s: None,
        };
        // Distinct prompts, except that an idempotent request is resent with
        // its own prompt and key: the retry the suite checks.
        let asker = self.asker();
        // A plain reference, so request threads share it and not the whole probe.
        let ep = &self.ep;
        let ask = |key: Option<String>, timeout: Duration| Ask {
            idempotency_key: key,
            ..asker.ask(RESTART_WORDS, 4, timeout)
        };
        let herd = || {
            burst(
                &self.ep,
                (0..rc.herd)
                    .map(|_| ask(None, self.cfg.request_timeout))
                    .collect(),
            )
        };
        // Idempotent requests that complete before the kill.
        let run_id = format!("{:x}", oomscope_proto::now_ns());
        let keyed: Vec<(Ask, Call)> = (0..rc.keys)
            .map(|i| {
                let a = ask(
                    Some(format!("probe-{run_id}-{i}")),
                    self.cfg.request_timeout,
                );
                let c = complete(&self.ep, &a, Instant::now());
                (a, c)
            })
            .collect();
        // Steady state: the most of a herd the warm server admits. A server
        // that restores gradually is still ramping up after its start, and
        // two herds in a row can be admitted alike while it ramps (3 and 3,
        // seen in CI, then 16 warm), so herds go out a second apart until
        // WARM_FLAT_HERDS in a row add nothing to the best count.
        let warm_deadline = Instant::now() + rc.warm_timeout;
        let mut steady_ok = count(&herd(), Outcome::Ok);
        let mut flat = 0;
        while flat < WARM_FLAT_HERDS && Instant::now() < warm_deadline {
            std::thread::sleep(WARM_HERD_GAP);
            let again = count(&herd(), Outcome::Ok);
            if again > steady_ok {
                steady_ok = again;
                flat = 0;
            } else {
                flat += 1;
            }
        }

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
                        let c = complete(ep, &ask(None, Duration::from_secs(10)), t0);
                        let fast_no = matches!(c.outcome, Outcome::Unreachable | Outcome::Refused);
                        calls
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((started, c));
                        if fast_no {
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
                // Poll readiness while the load keeps knocking, and remember
                // when the server last said it was NOT ready: an answer that
                // came before that moment was given while it claimed not to be.
                let deadline = Instant::now() + rc.ready_timeout;
                let mut said_not_ready = Instant::now();
                while Instant::now() < deadline {
                    if ready(&self.ep, &ready_path) {
                        ready_at = Some(said_not_ready);
                        break;
                    }
                    said_not_ready = Instant::now();
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        let Some(killed_at) = killed_at else {
            return err("could not find the launched server's process to kill".into());
        };
        // `ready_at` is the last moment the server said it was not ready.
        let Some(ready_at) = ready_at else {
            return err(format!(
                "the server did not come back (ready on {ready_path}) within {:.0} s of the kill (its output: {})",
                rc.ready_timeout.as_secs_f64(),
                l.log.display()
            ));
        };
        // The herd at readiness: retried work arriving at once. It leaves
        // when the load's last requests are answered (the scope above joins
        // them), which on a busy machine can be a while after readiness.
        let herd_after_ready_s = ready_at.elapsed().as_secs_f64();
        let herd_ok = count(&herd(), Outcome::Ok);
        // Resend the idempotent requests.
        let mut duplicates = Vec::new();
        let mut resent_ok = 0;
        for (first_ask, first) in &keyed {
            let key = first_ask.idempotency_key.clone().unwrap_or_default();
            asker.record_resend(&first_ask.prompt);
            let again = complete(&self.ep, first_ask, Instant::now());
            if again.outcome != Outcome::Ok {
                continue;
            }
            resent_ok += 1;
            let same = again.replayed || (first.id.is_some() && first.id == again.id);
            if first.outcome == Outcome::Ok && !same {
                duplicates.push(key);
            }
        }
        let keyed_ok = keyed
            .iter()
            .filter(|(_, c)| c.outcome == Outcome::Ok)
            .count();

        // Admitted before ready: taken on (answered 200, or failed with a
        // server error) by a killed server that had not yet said ready.
        let calls = calls.into_inner().unwrap_or_else(|p| p.into_inner());
        let before_ready: Vec<&Call> = calls
            .iter()
            .filter(|(started, c)| {
                *started > killed_at
                    && matches!(c.outcome, Outcome::Ok | Outcome::ServerError)
                    && *started + Duration::from_secs_f64(c.latency_ms / 1e3) < ready_at
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
                "readiness does not gate traffic: {} requests were taken on before {ready_path} said ready ({ok} answered 200, {} failed)",
                before_ready.len(),
                before_ready.len() - ok
            ));
        }
        let gradual = (herd_ok as f64) <= GRADUAL_AT_MOST * steady_ok as f64 || steady_ok == 0;
        if !gradual {
            problems.push(format!(
                "no gradual restore: {herd_after_ready_s:.1} s after readiness the server admitted {herd_ok} of a {}-request herd, about as many as when warm ({steady_ok})",
                rc.herd
            ));
        }
        if !duplicates.is_empty() {
            problems.push(format!(
                "{} of {keyed_ok} idempotent requests were processed again after the restart (a new completion for the same Idempotency-Key)",
                duplicates.len()
            ));
        }
        if keyed_ok == 0 {
            problems.push("no idempotent request completed before the kill, so duplicates could not be checked".into());
        }
        let recovery_s = ready_at.duration_since(killed_at).as_secs_f64();
        let findings = json!({
            "recovery_s": recovery_s,
            "admitted_before_ready": before_ready.len(),
            "load_calls": calls.len(),
            "steady_herd_admitted": steady_ok,
            "restore_herd_admitted": herd_ok,
            "herd_after_ready_s": herd_after_ready_s,
            "herd": rc.herd,
            "idempotent_sent": rc.keys,
            "idempotent_completed_before_kill": keyed_ok,
            "idempotent_resent_ok": resent_ok,
            "duplicates": duplicates.len(),
        });
        let (status, verdict) = if problems.is_empty() {
            (
                Status::Pass,
                format!(
                    "back in {recovery_s:.1} s; nothing taken on before ready; restored gradually ({herd_ok} of {} admitted at first vs {steady_ok} warm); no duplicate processing of {keyed_ok} idempotent requests",
                    rc.herd
                ),
            )
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
            budget_s: None,
        }
    }
}
