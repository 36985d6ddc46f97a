//! The capacity and overload suites. Each is bounded in requests and time,
//! stops by itself, and talks only to the given endpoint.

use std::time::{Duration, Instant};

use serde_json::json;

use super::http::request;
use super::load::{burst, complete, count, percentile, Ask, Call, Outcome};
use super::report::{Figure, Status, Step, SuiteReport};
use super::Probe;

fn step(label: String, words: usize, concurrency: usize, calls: &[Call]) -> Step {
    Step {
        label,
        prompt_words: words,
        prompt_tokens: calls.iter().filter_map(|c| c.prompt_tokens).max(),
        concurrency,
        calls: calls.len(),
        ok: count(calls, Outcome::Ok),
        refused: count(calls, Outcome::Refused),
        rejected: count(calls, Outcome::Rejected),
        server_errors: count(calls, Outcome::ServerError),
        timeouts: count(calls, Outcome::Timeout),
        unreachable: count(calls, Outcome::Unreachable),
        p50_ms: percentile(calls, 50.0),
        p99_ms: percentile(calls, 99.0),
        memory: None,
        failure: first_failure(calls),
    }
}

fn first_failure(calls: &[Call]) -> Option<String> {
    calls.iter().find(|c| c.outcome != Outcome::Ok).map(|c| {
        let what = match c.status {
            Some(s) => format!("HTTP {s}"),
            None => format!("{:?}", c.outcome).to_lowercase(),
        };
        match &c.error {
            Some(e) => format!("{what}: {}", e.chars().take(200).collect::<String>()),
            None => what,
        }
    })
}

fn suite(
    name: &str,
    status: Status,
    verdict: impl Into<String>,
    reason: Option<String>,
    steps: Vec<Step>,
    findings: serde_json::Value,
    t: Instant,
) -> SuiteReport {
    SuiteReport {
        suite: name.into(),
        status,
        verdict: verdict.into(),
        reason,
        steps,
        findings,
        duration_s: t.elapsed().as_secs_f64(),
    }
}

/// The knobs that tell one ramp from another.
struct Ramp {
    /// The first rung; each next rung doubles it.
    start: usize,
    /// The largest rung tried.
    limit: usize,
    /// The limit as the user set it, for "no failure up to ...".
    limit_note: String,
    /// A passing rung with its p99 over this ends the ramp, bounded by latency.
    latency_bound: Option<Duration>,
}

/// A ramp's report: it passes when some rung passed.
fn ramp_suite(
    name: &str,
    verdict: String,
    steps: Vec<Step>,
    fig: &Figure,
    t: Instant,
) -> SuiteReport {
    let status = if fig.value.is_some() {
        Status::Pass
    } else {
        Status::Fail
    };
    suite(
        name,
        status,
        verdict,
        None,
        steps,
        json!({"figure": fig}),
        t,
    )
}

impl Probe {
    fn ask(&self, words: usize, max_tokens: usize, timeout: Duration) -> Ask {
        Ask {
            model: self.cfg.model.clone(),
            prompt_words: words,
            max_tokens,
            idempotency_key: None,
            timeout,
        }
    }

    /// Memory at a step (the collector's peak since the step began), when a collector watches.
    fn measure(&mut self, st: &mut Step, since_ns: i64) {
        if let Some(w) = self.watch.as_mut() {
            st.memory = w.memory(since_ns);
        }
    }

    /// Why a step failed, as the domain that bounds a figure: the collector's
    /// incident for the server (an OOM, a kill), else what the calls showed.
    fn bound(&mut self, calls: &[Call], since_ns: i64) -> (String, Vec<String>) {
        let mut evidence = Vec::new();
        if let Some(w) = self.watch.as_mut() {
            // Give the agent's last messages (an OOM event, a death) a moment to land.
            std::thread::sleep(self.cfg.settle);
            if let Some(inc) = w.incidents_since(since_ns).into_iter().last() {
                evidence.push(format!(
                    "collector incident {} ({}): {}",
                    inc.id, inc.kind, inc.summary
                ));
                if !inc.domain.is_empty() && inc.domain != "unknown" {
                    return (inc.domain, evidence);
                }
            }
        }
        if let Some(f) = first_failure(calls) {
            evidence.push(f);
        }
        let bound = if calls.iter().any(|c| c.is_oom()) {
            "out_of_memory"
        } else if calls.iter().any(|c| c.outcome == Outcome::Rejected) {
            "max_context_setting"
        } else if calls.iter().any(|c| c.outcome == Outcome::Refused) {
            "admission_cap"
        } else if calls.iter().any(|c| c.outcome == Outcome::Timeout) {
            "timeout"
        } else {
            "server_error"
        };
        (bound.to_string(), evidence)
    }

    /// Step 1 of the decision tree: a tiny known-good request. Its failure
    /// is the environment (server down, wrong URL, model missing), never capacity.
    pub fn smoke(&mut self) -> SuiteReport {
        let t = Instant::now();
        let models = request(
            &self.ep,
            "GET",
            "/models",
            None,
            &[],
            self.cfg.request_timeout,
        );
        let model_note = match &models {
            Ok(r) if r.status == 200 => {
                let ids: Vec<String> = r
                    .json()
                    .ok()
                    .and_then(|v| v["data"].as_array().cloned())
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect();
                if let (Some(want), false) = (&self.cfg.model, ids.is_empty()) {
                    if !ids.contains(want) {
                        return suite(
                            "smoke",
                            Status::Fail,
                            "environment",
                            Some(format!(
                                "model {want:?} is not served here; /models lists {ids:?}"
                            )),
                            vec![],
                            json!({"models": ids}),
                            t,
                        );
                    }
                }
                json!(ids)
            }
            Ok(r) => json!(format!(
                "GET {} answered {}",
                self.ep.url("/models"),
                r.status
            )),
            Err(e) => {
                let reason = format!("nothing answers at {}: {e:#}. Is the server up, and is this the right host, port and /v1 prefix?", self.ep.url("/models"));
                return suite(
                    "smoke",
                    Status::Fail,
                    "environment",
                    Some(reason),
                    vec![],
                    json!({}),
                    t,
                );
            }
        };
        let call = complete(
            &self.ep,
            &self.ask(4, 4, self.cfg.request_timeout),
            Instant::now(),
        );
        let st = step("tiny request".into(), 4, 1, std::slice::from_ref(&call));
        if call.outcome == Outcome::Ok {
            suite(
                "smoke",
                Status::Pass,
                "a tiny request works",
                None,
                vec![st],
                json!({"models": model_note}),
                t,
            )
        } else {
            let reason = format!(
                "the tiny known-good request failed ({}): this is the environment or installation (wrong URL, model not loaded, server broken), not capacity",
                st.failure.clone().unwrap_or_default()
            );
            suite(
                "smoke",
                Status::Fail,
                "environment",
                Some(reason),
                vec![st],
                json!({"models": model_note}),
                t,
            )
        }
    }

    /// The shared ramp: rungs from `start`, each double the last, up to
    /// `limit` and within the suite budget. Each rung runs its calls, measures
    /// memory, and either passes (every call answered) or ends the ramp with the
    /// figure bounded by why it failed; a passing rung slower than the latency
    /// bound ends it too. Returns the steps and the last rung that passed, with
    /// its prompt tokens.
    fn ramp(
        &mut self,
        t: Instant,
        knobs: Ramp,
        fig: &mut Figure,
        mut rung: impl FnMut(&mut Self, usize) -> (Step, Vec<Call>),
    ) -> (Vec<Step>, Option<(usize, Option<u64>)>) {
        let mut steps = Vec::new();
        let mut best = None;
        let mut x = knobs.start;
        while x <= knobs.limit && t.elapsed() < self.cfg.suite_budget {
            let since = oomscope_proto::now_ns();
            let (mut st, calls) = rung(self, x);
            self.measure(&mut st, since);
            let ok = st.ok == st.calls;
            let slow = knobs
                .latency_bound
                .filter(|b| st.p99_ms.is_some_and(|p| p > b.as_secs_f64() * 1e3));
            let tokens = st.prompt_tokens;
            steps.push(st);
            if !ok {
                let (b, ev) = self.bound(&calls, since);
                fig.bounded_by = b;
                fig.evidence = ev;
                break;
            }
            best = Some((x, tokens));
            if let Some(b) = slow {
                fig.bounded_by = "latency".into();
                fig.evidence = vec![format!(
                    "p99 over the {:.0} s latency bound at {x} {}",
                    b.as_secs_f64(),
                    fig.unit
                )];
                break;
            }
            x *= 2;
        }
        if best.is_some() && fig.bounded_by == "probe_limit" {
            fig.evidence
                .push(format!("no failure up to {}", knobs.limit_note));
        }
        (steps, best)
    }

    /// Ramp the prompt at concurrency 1 until a failure or --max-context.
    pub fn long_context(&mut self) -> (SuiteReport, Figure) {
        let t = Instant::now();
        let mut fig = Figure {
            unit: "tokens".into(),
            concurrency: Some(1),
            bounded_by: "probe_limit".into(),
            ..Default::default()
        };
        let knobs = Ramp {
            start: self.cfg.min_context.max(1),
            limit: self.cfg.max_context,
            limit_note: format!("--max-context {} words", self.cfg.max_context),
            latency_bound: None,
        };
        let (steps, best) = self.ramp(t, knobs, &mut fig, |p, words| {
            let calls = vec![complete(
                &p.ep,
                &p.ask(words, p.cfg.output_tokens, p.cfg.request_timeout),
                Instant::now(),
            )];
            (
                step(format!("prompt {words} words"), words, 1, &calls),
                calls,
            )
        });
        fig.value = best.map(|(w, tokens)| tokens.unwrap_or(w as u64));
        fig.context_tokens = fig.value;
        let verdict = match fig.value {
            Some(v) => format!(
                "max context at concurrency 1: {v} tokens (bounded by {})",
                fig.bounded_by
            ),
            None => format!(
                "even {} words failed (bounded by {})",
                self.cfg.min_context, fig.bounded_by
            ),
        };
        (ramp_suite("long-context", verdict, steps, &fig, t), fig)
    }

    /// Ramp concurrent long conversations at `words` until a failure, the
    /// latency bound, or --max-concurrency.
    pub fn concurrency_at(&mut self, name: &str, words: usize) -> (SuiteReport, Figure) {
        let t = Instant::now();
        let mut fig = Figure {
            unit: "sequences".into(),
            context_tokens: Some(words as u64),
            bounded_by: "probe_limit".into(),
            ..Default::default()
        };
        let knobs = Ramp {
            start: 1,
            limit: self.cfg.max_concurrency,
            limit_note: format!("--max-concurrency {}", self.cfg.max_concurrency),
            latency_bound: Some(self.cfg.latency_bound),
        };
        let (steps, best) = self.ramp(t, knobs, &mut fig, |p, n| {
            let asks = (0..n)
                .map(|_| p.ask(words, p.cfg.output_tokens, p.cfg.request_timeout))
                .collect();
            let calls = burst(&p.ep, asks);
            (
                step(format!("{n} x {words} words"), words, n, &calls),
                calls,
            )
        });
        // The context the server counted, from the last step that says.
        if let Some(tok) = steps.iter().rev().find_map(|s| s.prompt_tokens) {
            fig.context_tokens = Some(tok);
        }
        fig.value = best.map(|(n, _)| n as u64);
        fig.concurrency = fig.value;
        let verdict = match fig.value {
            Some(v) => format!(
                "{v} concurrent sequences at {words} words (bounded by {})",
                fig.bounded_by
            ),
            None => format!(
                "one sequence at {words} words already failed (bounded by {})",
                fig.bounded_by
            ),
        };
        (ramp_suite(name, verdict, steps, &fig, t), fig)
    }

    /// N identical requests at a fixed concurrency; the leak verdict is the collector's.
    pub fn repeated(&mut self) -> SuiteReport {
        let t = Instant::now();
        let since = oomscope_proto::now_ns();
        let c = self.cfg.repeat_concurrency.max(1);
        let mut calls = Vec::new();
        while calls.len() < self.cfg.repeat && t.elapsed() < self.cfg.suite_budget {
            let n = c.min(self.cfg.repeat - calls.len());
            let asks = (0..n)
                .map(|_| {
                    self.ask(
                        self.cfg.typical_context,
                        self.cfg.output_tokens,
                        self.cfg.request_timeout,
                    )
                })
                .collect();
            calls.extend(burst(&self.ep, asks));
        }
        let mut st = step(
            format!(
                "{} x {} words at {c}",
                calls.len(),
                self.cfg.typical_context
            ),
            self.cfg.typical_context,
            c,
            &calls,
        );
        self.measure(&mut st, since);
        let failed = st.ok < calls.len();
        let mut findings = json!({"requests": calls.len()});
        let mut leak: Option<String> = None;
        match self.watch.as_mut() {
            Some(w) => {
                std::thread::sleep(self.cfg.settle);
                if let Some(d) = w.diagnose_since(since) {
                    let causes: Vec<_> = d.causes.iter().map(|c| json!({"kind": c.kind, "confidence": c.confidence, "metrics": c.metrics})).collect();
                    findings["causes"] = json!(causes);
                    findings["trigger"] = json!(d.trigger);
                    if let Some(c) = d
                        .causes
                        .iter()
                        .find(|c| c.kind == "leak" || c.kind == "host_growth")
                    {
                        let per = c.metrics.get("bytes_per_request").copied().unwrap_or(0.0);
                        leak = Some(format!(
                            "{}: {} per request ({})",
                            c.kind,
                            oomscope_analysis::units::bytes_table(per.max(0.0) as u64),
                            c.evidence.first().cloned().unwrap_or_default()
                        ));
                    }
                }
            }
            None => {
                findings["note"] = json!("no --collector: latency and errors only, no leak verdict")
            }
        }
        let (status, verdict) = match (&leak, failed) {
            (Some(l), _) => (Status::Fail, format!("memory grows per request: {l}")),
            (None, true) => (
                Status::Fail,
                format!(
                    "{} of {} repeated requests failed",
                    calls.len() - st.ok,
                    calls.len()
                ),
            ),
            (None, false) if self.watch.is_some() => (
                Status::Pass,
                format!("{} requests, no growth per request", calls.len()),
            ),
            (None, false) => (
                Status::Pass,
                format!(
                    "{} requests succeeded (no collector: growth not checked)",
                    calls.len()
                ),
            ),
        };
        suite("repeated", status, verdict, None, vec![st], findings, t)
    }

    /// A burst above capacity. A well-run server answers 429/503 quickly,
    /// keeps its queue bounded (nothing waits out the timeout), and survives.
    pub fn overload(&mut self, capacity: Option<u64>) -> SuiteReport {
        let t = Instant::now();
        let since = oomscope_proto::now_ns();
        let n = self
            .cfg
            .burst
            .unwrap_or_else(|| (capacity.unwrap_or(8) as usize * 4).clamp(16, 256));
        let asks = (0..n)
            .map(|_| {
                self.ask(
                    self.cfg.overload_context,
                    self.cfg.output_tokens,
                    self.cfg.overload_timeout,
                )
            })
            .collect();
        let calls = burst(&self.ep, asks);
        let mut st = step(
            format!("burst of {n} x {} words", self.cfg.overload_context),
            self.cfg.overload_context,
            n,
            &calls,
        );
        self.measure(&mut st, since);
        let refused: Vec<Call> = calls
            .iter()
            .filter(|c| c.outcome == Outcome::Refused)
            .cloned()
            .collect();
        let refuse_p99 = percentile(&refused, 99.0);
        // After the burst: is the server still there?
        let alive = complete(
            &self.ep,
            &self.ask(4, 4, self.cfg.request_timeout),
            Instant::now(),
        )
        .outcome
            == Outcome::Ok;
        let incidents: Vec<String> = self
            .watch
            .as_mut()
            .map(|w| {
                std::thread::sleep(self.cfg.settle);
                w.incidents_since(since)
                    .into_iter()
                    .map(|i| format!("{} {} ({}): {}", i.id, i.kind, i.domain, i.summary))
                    .collect()
            })
            .unwrap_or_default();
        let oom = calls.iter().any(Call::is_oom)
            || incidents.iter().any(|i| {
                i.contains(" oom ")
                    || i.contains("(gpu_vram)")
                    || i.contains("(cgroup)")
                    || i.contains("(host_ram)")
            });
        let mut problems = Vec::new();
        if oom {
            problems.push("the server ran out of memory under the burst".to_string());
        }
        if st.timeouts > 0 {
            problems.push(format!(
                "{} requests waited out the {:.0} s timeout: the queue is not bounded",
                st.timeouts,
                self.cfg.overload_timeout.as_secs_f64()
            ));
        }
        if !alive {
            problems.push("the server stopped answering after the burst (it died)".into());
        } else if st.unreachable > 0 {
            problems.push(format!(
                "{} connections were dropped instead of refused with 429/503",
                st.unreachable
            ));
        }
        if st.server_errors > 0 && !oom {
            problems.push(format!("{} requests got a server error", st.server_errors));
        }
        if let Some(p) = refuse_p99.filter(|&p| p > self.cfg.refuse_bound.as_secs_f64() * 1e3) {
            problems.push(format!(
                "refusals were slow: p99 {p:.0} ms (bound {:.0} ms)",
                self.cfg.refuse_bound.as_secs_f64() * 1e3
            ));
        }
        let findings = json!({
            "burst": n, "ok": st.ok, "refused": st.refused, "timeouts": st.timeouts, "server_errors": st.server_errors,
            "unreachable": st.unreachable, "refused_p99_ms": refuse_p99, "alive_after": alive, "oom": oom, "incidents": incidents,
        });
        let (status, verdict) = if problems.is_empty() {
            (Status::Pass, format!("{} served, {} refused cleanly with 429/503 (p99 {:.0} ms); queue bounded; server alive", st.ok, st.refused, refuse_p99.unwrap_or(0.0)))
        } else {
            (Status::Fail, problems.join("; "))
        };
        suite("overload", status, verdict, None, vec![st], findings, t)
    }
}
