//! The smoke, capacity and overload suites. Each is bounded in requests and
//! time (every request's deadline is cut at its suite's budget), stops by
//! itself, and talks only to the given endpoint.

use std::time::{Duration, Instant};

use oomscope_proto::CauseKind;
use serde_json::json;

use super::calibrate::StreamChoice;
use super::clock::{Clock, Limit};
use super::concurrency::{self, Effective};
use super::fixture::{self, Fixture};
use super::http::request;
use super::load::{burst, complete, count, first_token_percentile, percentile, Api, Call, Outcome};
use super::metrics::{self, Load};
use super::progress;
use super::report::{Figure, Status, Step, SuiteReport};
use super::server::{self, DISCOVERY_TIMEOUT};
use super::tokens::{bisect, doubling};
use super::{ApiChoice, Probe, Suite};

/// Words in the smoke request's prompt: tiny, but enough for the counter
/// words that keep it distinct.
const SMOKE_WORDS: usize = 4;
/// Tokenizer rounds to size one rung's prompt (each refits the calibration).
const TOKENIZE_ROUNDS: usize = 3;
/// A tokenized sample this close to its target (share of it) is close enough.
const SIZE_TOLERANCE: f64 = 0.01;

fn step(
    label: String,
    words: usize,
    target: Option<u64>,
    concurrency: usize,
    calls: &[Call],
) -> Step {
    Step {
        label,
        prompt_words: words,
        prompt_tokens: calls.iter().filter_map(|c| c.prompt_tokens).max(),
        context_tokens: target,
        concurrency,
        calls: calls.len(),
        ok: count(calls, Outcome::Ok),
        refused: count(calls, Outcome::Refused),
        rejected: count(calls, Outcome::Rejected),
        empty: count(calls, Outcome::Empty),
        server_errors: count(calls, Outcome::ServerError),
        timeouts: count(calls, Outcome::Timeout),
        unreachable: count(calls, Outcome::Unreachable),
        not_measured: count(calls, Outcome::NotMeasured),
        p50_ms: percentile(calls, 50.0),
        p99_ms: percentile(calls, 99.0),
        first_token_p50_ms: first_token_percentile(calls, 50.0),
        effective_concurrency: None,
        effective_method: None,
        server_load: None,
        memory: None,
        failure: first_failure(calls),
        idle_wait: None,
    }
}

fn first_failure(calls: &[Call]) -> Option<String> {
    // A request the probe's own clock cut is no failure of the server.
    calls
        .iter()
        .find(|c| !matches!(c.outcome, Outcome::Ok | Outcome::NotMeasured))
        .map(|c| {
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

#[allow(clippy::too_many_arguments)]
fn suite(
    name: &str,
    status: Status,
    verdict: impl Into<String>,
    reason: Option<String>,
    steps: Vec<Step>,
    findings: serde_json::Value,
    t: Instant,
    budget: Option<Duration>,
) -> SuiteReport {
    SuiteReport {
        suite: name.into(),
        status,
        verdict: verdict.into(),
        reason,
        steps,
        findings,
        duration_s: t.elapsed().as_secs_f64(),
        budget_s: budget.map(|b| b.as_secs_f64()),
    }
}

/// Where the token counts came from, for a figure's evidence.
fn counted_by(p: &Probe, server_counted: bool) -> String {
    use super::calibrate::Method;
    let path = p.server.tokenize.map(|r| r.shown(&p.ep));
    match (server_counted, p.server.token_count) {
        (true, Method::None) => Method::Usage.described(None),
        (true, m) => m.described(path.as_deref()),
        // The only counts were of prompts refused for their length.
        (false, Method::None) if p.cal.observed() > 0 => format!(
            "tokens from the words, at the rate fitted to the server's counts of the prompts it refused for their length ({} refusals: {:.2} tokens a word); no answer it gave counted its tokens",
            p.cal.observed(),
            p.cal.fit().1
        ),
        (false, Method::None) => format!(
            "{} ({:.2} tokens a word)",
            Method::None.described(None),
            p.cal.fit().1
        ),
        (false, Method::Tokenize) => Method::Tokenize.described(path.as_deref()),
        (false, m) => format!(
            "tokens from the words, at the rate fitted to the server's counts ({}: {:.2} tokens a word)",
            m.name(),
            p.cal.fit().1
        ),
    }
}

impl Probe {
    /// Memory at a step (the collector's peak since the step began), when a collector watches.
    fn measure(&mut self, st: &mut Step, since_ns: i64) {
        if let Some(w) = self.watch.as_mut() {
            st.memory = w.memory(since_ns);
        }
    }

    /// The runtime's settings that size its KV pool and cap the sequences it
    /// runs, as the probe can name them: from the server's own command with
    /// their values, else from the runtime its metrics name, else in words.
    fn setting_names(&self) -> (String, String) {
        use oomscope_analysis::settings::Knob;
        let set = |knobs: &[Knob]| -> Option<String> {
            let s = self.server_settings.as_ref()?;
            knobs.iter().find_map(|&k| {
                s.get(k).map(|(setting, v)| {
                    format!(
                        "{} (now {})",
                        s.spelling(setting),
                        if v.is_empty() { "on" } else { v }
                    )
                })
            })
        };
        let named = |knobs: &[Knob]| -> Option<String> {
            let s = self.server_settings.as_ref()?;
            knobs
                .iter()
                .find_map(|&k| s.setting(k))
                .map(|setting| format!("{} (at its default)", setting.name))
        };
        let rt = self.server.load.as_ref().map(metrics::Source::runtime);
        let kv = [Knob::KvCacheSize, Knob::MemoryFraction];
        let seqs = [Knob::MaxSequences];
        (
            set(&kv)
                .or_else(|| rt.map(|r| r.kv_setting().to_string()))
                .or_else(|| named(&kv))
                .unwrap_or_else(|| "the KV pool's size".into()),
            set(&seqs)
                .or_else(|| rt.map(|r| r.sequences_setting().to_string()))
                .or_else(|| named(&seqs))
                .unwrap_or_else(|| "the server's cap on sequences run at once".into()),
        )
    }

    /// The server's load over a step: what the probe's polls read, joined
    /// with what its agent told the collector (the peaks of both: the polls
    /// miss what falls between them). With no polled reading the agent's is
    /// all there is, and its last samples may trail the answers, so an empty
    /// answer is asked again once they have had time to land.
    fn step_load(&mut self, polled: Option<Load>, since: i64, until: i64) -> Option<Load> {
        let settle = self.cfg.settle;
        let polled = polled.filter(|l| l.readings > 0);
        let Some(w) = self.watch.as_mut() else {
            return polled;
        };
        match polled {
            Some(p) => Some(match w.load(since, until) {
                Some(agent) => p.merge(agent),
                None => p,
            }),
            None => w.load(since, until).or_else(|| {
                std::thread::sleep(settle);
                w.load(since, until)
            }),
        }
    }

    /// The words for prompts the server will count as about `tokens`
    /// tokens: from the calibration, refined with the server's tokenizer
    /// where it has one (a few sample prompts counted, the fit corrected).
    pub(crate) fn size(&mut self, tokens: u64) -> usize {
        let mut words = self.cal.words_for(tokens);
        if self.server.tokenizer {
            for _ in 0..TOKENIZE_ROUNDS {
                let sample = self.sample(words);
                let Some((n, _)) = self.count_tokens(&sample, DISCOVERY_TIMEOUT) else {
                    break;
                };
                let counted = n + self.server.overhead_tokens;
                self.cal.observe(words, counted);
                if (counted as f64 - tokens as f64).abs() <= SIZE_TOLERANCE * tokens as f64 {
                    break;
                }
                words = self.cal.words_for(tokens);
            }
        }
        words
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
                if !inc.domain.is_empty()
                    && inc.domain != oomscope_analysis::Domain::Unknown.as_str()
                {
                    return (inc.domain, evidence);
                }
            }
        }
        if let Some(f) = first_failure(calls) {
            evidence.push(f);
        }
        let bound = if calls.iter().any(|c| c.is_oom()) {
            "out_of_memory"
        } else if calls
            .iter()
            .any(|c| matches!(c.outcome, Outcome::Rejected | Outcome::Empty))
        {
            // An empty 200 is the server refusing the size without saying so.
            "max_context_setting"
        } else if calls.iter().any(|c| c.outcome == Outcome::Refused) {
            "admission_cap"
        } else if calls.iter().any(|c| c.outcome == Outcome::Timeout) {
            "timeout"
        } else if calls.iter().any(|c| c.outcome == Outcome::Unreachable) {
            "server_died"
        } else {
            "server_error"
        };
        (bound.to_string(), evidence)
    }

    /// One tiny request on `api`, streamed or not, and its prompt.
    fn tiny(&mut self, api: Api, stream: bool, timeout: Duration) -> (Call, String) {
        self.server.api = api;
        self.server.stream = stream;
        let ask = self.ask(SMOKE_WORDS, 4, timeout);
        (complete(&self.ep, &ask, Instant::now()), ask.prompt)
    }

    /// Step 1 of the decision tree: a tiny known-good request, within
    /// [`Suite::default_budget`] of the smoke. Its failure
    /// is the environment (server down, wrong URL, model missing), never
    /// capacity. On the way it learns the server: its models and context
    /// limit, its tokenizer, where its load can be read, which API it
    /// serves (`--api auto`: completions where offered, else chat) and
    /// whether it streams.
    pub fn smoke(&mut self) -> SuiteReport {
        let t = Instant::now();
        // Its own budget, whatever --suite-budget says: a server that cannot
        // answer a tiny request within it is the environment, not capacity.
        let clock = Clock::new(
            Suite::Smoke.default_budget().min(self.deadline_left()),
            Limit::Budget,
            self.cfg.deadline,
        );
        let fail = |reason: String, steps: Vec<Step>, findings: serde_json::Value| {
            suite(
                "smoke",
                Status::Fail,
                "environment",
                Some(reason),
                steps,
                findings,
                t,
                None,
            )
        };
        self.progress
            .doing("smoke: asking the server what it serves");
        let models = request(
            &self.ep,
            "GET",
            "/models",
            None,
            &[],
            clock.timeout(self.cfg.request_timeout.min(DISCOVERY_TIMEOUT)),
        );
        let model_note = match &models {
            Ok(r) if r.status == 200 => {
                let (ids, len) = r.json().map(|v| server::models(&v)).unwrap_or_default();
                self.server.max_model_len = len;
                if let (Some(want), false) = (&self.cfg.model, ids.is_empty()) {
                    if !ids.contains(want) {
                        return fail(
                            format!("model {want:?} is not served here; /models lists {ids:?}"),
                            vec![],
                            json!({"models": ids}),
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
                let reason = format!(
                    "nothing answers at {}: {e}. Is the server up, and is this the right host, port and /v1 prefix?",
                    self.ep.url("/models")
                );
                return fail(reason, vec![], json!({}));
            }
        };
        self.server.load = metrics::discover(&self.ep, clock.timeout(DISCOVERY_TIMEOUT));
        let mut prompt = String::new();

        // The API and streaming: each candidate streamed first (for the time
        // to first token), then plain where the stream fields are refused.
        let apis: &[Api] = match self.cfg.api {
            ApiChoice::Auto => &[Api::Completions, Api::Chat],
            ApiChoice::Completions => &[Api::Completions],
            ApiChoice::Chat => &[Api::Chat],
        };
        let mut tried = Vec::new();
        let mut answer: Option<Call> = None;
        'apis: for &api in apis {
            self.progress.doing(&format!(
                "smoke: a tiny request on /{}",
                api.path().trim_start_matches('/')
            ));
            let streams: &[bool] = match self.cfg.stream {
                StreamChoice::Off => &[false],
                _ => &[true, false],
            };
            for &stream in streams {
                let (call, sent) = self.tiny(api, stream, clock.timeout(self.cfg.request_timeout));
                prompt = sent;
                let status = call.status;
                tried.push(json!({"api": api.name(), "stream": stream, "status": status, "error": call.error}));
                if call.outcome == Outcome::Ok {
                    // A server that ignores `stream` answers with JSON: no first tokens to time.
                    self.server.stream = stream && call.first_token_ms.is_some();
                    answer = Some(call);
                    break 'apis;
                }
                if server::api_missing(status, call.error.as_deref()) && apis.len() > 1 {
                    answer = Some(call);
                    continue 'apis;
                }
                answer = Some(call);
                if !(stream && server::stream_refused(status)) {
                    break 'apis;
                }
            }
        }
        let call = answer.expect("at least one API is tried");
        self.after_calls(std::slice::from_ref(&call));
        if call.outcome == Outcome::Ok {
            self.tiny_ms = Some(call.latency_ms);
            self.progress.doing("smoke: how the server counts tokens");
            let streams = self.server.stream;
            let smoke = call.prompt_tokens.map(|n| (prompt.as_str(), n));
            self.calibrate(streams, smoke, clock.timeout(DISCOVERY_TIMEOUT));
        }
        if let Some(n) = self.cfg.shared_prefix {
            let words = self.size(n as u64);
            self.book
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .prompts
                .set_shared_prefix(words);
        }
        let st = step(
            "tiny request".into(),
            SMOKE_WORDS,
            None,
            1,
            std::slice::from_ref(&call),
        );
        let findings = json!({
            "models": model_note,
            "api": self.server.api.name(),
            "streaming": self.server.stream,
            "tokenizer": self.server.tokenizer,
            "token_count": self.server.token_count.name(),
            "load_source": self.server.load.as_ref().map(metrics::Source::label),
            "max_model_len": self.server.max_model_len,
            "tried": tried,
        });
        if call.outcome == Outcome::Ok {
            suite(
                "smoke",
                Status::Pass,
                format!(
                    "a tiny request works (/{}{})",
                    self.server.api.path().trim_start_matches('/'),
                    if self.server.stream { ", streamed" } else { "" }
                ),
                None,
                vec![st],
                findings,
                t,
                None,
            )
        } else {
            let failure = st.failure.clone().unwrap_or_default();
            let reason = match server::auth_refused(call.status, self.ep.has_api_key()) {
                Some(why) => format!("the tiny known-good request failed ({failure}): {why}"),
                None => format!(
                    "the tiny known-good request failed ({failure}): this is the environment or installation (wrong URL, model not loaded, server broken), not capacity"
                ),
            };
            fail(reason, vec![st], findings)
        }
    }

    /// One rung of the long-context ramp: a single request sized to
    /// `target` tokens. Returns the step, its calls, whether the budget cut
    /// it, and when it began.
    fn context_rung(
        &mut self,
        clock: Clock,
        target: u64,
        label: String,
    ) -> (Step, Vec<Call>, bool, i64) {
        let waited = self.await_idle();
        self.progress.doing(&format!("long-context: {label}"));
        let words = self.size(target);
        let since = oomscope_proto::now_ns();
        let wanted = self.rung_timeout(target, 1);
        let given = clock.timeout(wanted);
        let ask = self.ask(words, self.cfg.output_tokens, given);
        let mut calls = vec![complete(&self.ep, &ask, Instant::now())];
        let cut = clock.settle(&mut calls, given, wanted);
        self.after_calls(&calls);
        let mut st = step(label, words, Some(target), 1, &calls);
        st.idle_wait = waited;
        self.measure(&mut st, since);
        st.effective_concurrency = Some(1);
        self.progress
            .line(&progress::rung_line("long-context", &st));
        (st, calls, cut, since)
    }

    /// Ramp the prompt in tokens at concurrency 1 until a failure or the
    /// limit (--max-context, or the server's max_model_len less the output
    /// tokens where that is lower), then bisect between the last pass and the
    /// first failure until the figure is within the tolerance of the bound.
    pub fn long_context(&mut self) -> (SuiteReport, Figure) {
        // The probe's leftovers are waited out before the suite's time starts.
        let mut waited = self.await_idle();
        let clock = self.clock_for(Suite::LongContext, self.context_limit());
        let budget = clock.budget;
        let mut fig = Figure {
            unit: "tokens".into(),
            concurrency: Some(1),
            bounded_by: "probe_limit".into(),
            ..Default::default()
        };
        let out = self.cfg.output_tokens as u64;
        let mut limit = self.cfg.max_context as u64;
        let mut limit_bound = (
            "probe_limit",
            format!("no failure up to --max-context {limit} tokens"),
        );
        if let Some(m) = self.server.max_model_len {
            let room = m.saturating_sub(out);
            if room < limit {
                limit = room;
                limit_bound = (
                    "max_context_setting",
                    format!("the server's max_model_len is {m} tokens (from /v1/models or /tokenize): at most {room} prompt tokens with {out} output tokens"),
                );
            }
        }
        let min = (self.cfg.min_context as u64).min(limit);
        self.progress.line(&progress::suite_line(
            "long-context",
            &format!("{min}..{limit} tokens at concurrency 1"),
            budget,
        ));
        let mut steps = Vec::new();
        // The last passing rung: (target, tokens the server counted).
        let mut best: Option<(u64, Option<u64>)> = None;
        let mut best_words = 0;
        let mut fail: Option<u64> = None;
        let mut budget_out = false;
        // Where the ramp was when its time ran out: the rung cut, or the next.
        let mut cut_at: Option<u64> = None;
        for target in doubling(min, limit) {
            if clock.spent() {
                budget_out = true;
                cut_at = Some(target);
                break;
            }
            let (mut st, calls, cut, since) =
                self.context_rung(clock, target, format!("prompt {target} tokens"));
            if st.idle_wait.is_none() {
                st.idle_wait = waited.take();
            }
            let ok = st.ok == st.calls;
            let counted = st.prompt_tokens;
            let words = st.prompt_words;
            steps.push(st);
            if cut {
                budget_out = true;
                cut_at = Some(target);
                break;
            }
            if ok {
                best = Some((target, counted));
                best_words = words;
            } else {
                let (b, ev) = self.bound(&calls, since);
                fig.bounded_by = b;
                fig.evidence = ev;
                fail = Some(counted.unwrap_or(target));
                // A refusal that stated the prompt's count recalibrated the
                // words (a server that counts nowhere else): the last pass,
                // sized at the old rate, in the same tokens as the failure.
                if let (Some(_), Some((_, None))) = (counted, best) {
                    best = Some((self.cal.tokens_for(best_words), None));
                }
                break;
            }
        }
        // Bisect the last interval, unless the server died there.
        let mut bisected = 0;
        if let (Some(mut hi), Some((mut lo, _))) = (fail, best) {
            while !self.down {
                let Some(mid) = bisect(lo, hi, self.cfg.context_tolerance) else {
                    break;
                };
                if clock.spent() {
                    budget_out = true;
                    cut_at = Some(mid);
                    break;
                }
                let (st, calls, cut, since) =
                    self.context_rung(clock, mid, format!("bisect {mid} tokens"));
                let ok = st.ok == st.calls;
                let counted = st.prompt_tokens;
                steps.push(st);
                bisected += 1;
                if cut {
                    budget_out = true;
                    cut_at = Some(mid);
                    break;
                }
                if ok {
                    lo = mid;
                    best = Some((mid, counted));
                } else {
                    hi = mid;
                    let (b, ev) = self.bound(&calls, since);
                    fig.bounded_by = b;
                    fig.evidence = ev;
                }
            }
            if !budget_out && !self.down {
                fig.evidence.push(format!(
                    "bisected ({bisected} more requests) to within {:.0} % of the bound: {lo} tokens passed, {hi} failed",
                    100.0 * self.cfg.context_tolerance
                ));
            }
        }
        // The answers at the largest passing size carried no count: count it again.
        if let Some((target, None)) = best.filter(|_| !self.down) {
            let words = steps
                .iter()
                .rev()
                .find(|s| s.ok == s.calls && s.context_tokens == Some(target))
                .map_or_else(|| self.cal.words_for(target), |s| s.prompt_words);
            if let Some(n) = self.recheck(words, clock.timeout(self.cfg.request_timeout)) {
                best = Some((target, Some(n)));
                fig.evidence.push(format!(
                    "re-checked at the largest size reached: {words} words are {n} tokens"
                ));
            }
        }
        let server_counted = best.is_some_and(|b| b.1.is_some());
        fig.value = best.map(|(target, counted)| {
            counted.unwrap_or_else(|| self.cal.tokens_for(self.cal.words_for(target)))
        });
        fig.context_tokens = fig.value;
        if budget_out {
            fig.bounded_by = clock.bound().into();
            let at = cut_at.map_or("the end of its ramp".into(), |t| format!("{t} tokens"));
            fig.evidence.push(format!(
                "{} (after {} requests): the figure is a lower bound",
                clock.why(&at),
                steps.len()
            ));
        } else if fail.is_none() && best.is_some() {
            fig.bounded_by = limit_bound.0.into();
            fig.evidence.push(limit_bound.1);
        }
        if fig.value.is_some() {
            fig.evidence.push(counted_by(self, server_counted));
        }
        // Nothing counted: the figure is words at an assumed rate, however
        // far the ramp went; it is labelled so, never as a measured bound.
        if !server_counted && self.server.token_count == super::calibrate::Method::None {
            fig.estimated = true;
            if fig.bounded_by == "probe_limit" {
                fig.bounded_by = "estimated".into();
            }
        }
        let verdict = match (fig.value, budget_out) {
            (Some(v), false) => format!(
                "max context at concurrency 1: {v} tokens (bounded by {})",
                fig.bounded_by
            ),
            (Some(v), true) => format!(
                "incomplete: {}; {v} tokens passed at concurrency 1 (a lower bound)",
                clock.why(&cut_at.map_or("its end".into(), |t| format!("{t} tokens")))
            ),
            (None, true) => format!(
                "incomplete: {} before any rung finished",
                clock.why("the first rung")
            ),
            (None, false) => match steps.first().and_then(|s| s.prompt_tokens) {
                // The server's own count of what it refused, where it said it.
                Some(n) if n != min => format!(
                    "even {min} tokens failed: {n} as the server counted them (bounded by {})",
                    fig.bounded_by
                ),
                _ => format!("even {min} tokens failed (bounded by {})", fig.bounded_by),
            },
        };
        let (status, reason) = ramp_status(budget_out, fig.value.is_some(), &clock);
        (
            suite(
                "long-context",
                status,
                verdict,
                reason,
                steps,
                json!({"figure": fig}),
                clock.t,
                Some(budget),
            ),
            fig,
        )
    }

    /// Ramp concurrent requests at `tokens` each until a failure, the
    /// latency bound, or --max-concurrency. Each rung measures how many
    /// requests the server really had in service at once: its figure is that
    /// effective concurrency, bounded by why the rest waited (serialized, the
    /// KV pool, a sequence cap) where they did.
    pub fn concurrency_at(&mut self, name: &str, tokens: u64) -> (SuiteReport, Figure) {
        // The probe's leftovers are waited out before the suite's time starts.
        let mut first_wait = self.await_idle();
        let clock = self.clock_for(Suite::Concurrency, tokens);
        let budget = clock.budget;
        let words = self.size(tokens);
        let mut fig = Figure {
            unit: "sequences".into(),
            context_tokens: Some(tokens),
            bounded_by: "probe_limit".into(),
            ..Default::default()
        };
        let max = self.cfg.max_concurrency.max(1) as u64;
        self.progress.line(&progress::suite_line(
            name,
            &format!("1..{max} concurrent requests of {tokens} tokens"),
            budget,
        ));
        let mut steps: Vec<Step> = Vec::new();
        let mut offered: Option<u64> = None;
        let mut best: Option<Effective> = None;
        let mut top_load: Option<Load> = None;
        let mut stop: Option<(String, Vec<String>)> = None;
        let mut budget_out = false;
        let mut cut_at: Option<u64> = None;
        for n in doubling(1, max) {
            if clock.spent() {
                budget_out = true;
                cut_at = Some(n);
                break;
            }
            let waited = first_wait.take().or_else(|| self.await_idle());
            let label = format!("{n} x {tokens} tokens");
            self.progress.doing(&format!("{name}: {label}"));
            let wanted = self.rung_timeout(tokens, n);
            let given = clock.timeout(wanted);
            let asks = (0..n)
                .map(|_| self.ask(words, self.cfg.output_tokens, given))
                .collect();
            let since = oomscope_proto::now_ns();
            let (mut calls, load) = metrics::during(
                &self.ep,
                self.server.load.as_ref(),
                self.cfg.metrics_poll,
                || burst(&self.ep, asks),
            );
            let until = oomscope_proto::now_ns();
            let cut = clock.settle(&mut calls, given, wanted);
            self.after_calls(&calls);
            let mut st = step(label, words, Some(tokens), n as usize, &calls);
            st.idle_wait = waited;
            self.measure(&mut st, since);
            let load = self.step_load(load, since, until);
            let timings: Vec<_> = calls
                .iter()
                .filter(|c| c.outcome == Outcome::Ok)
                .map(Call::timing)
                .collect();
            let eff = concurrency::effective(n as usize, &timings, load.as_ref());
            st.effective_concurrency = Some(eff.value);
            st.effective_method = Some(eff.method.clone());
            st.server_load = load.clone();
            self.progress.line(&progress::rung_line(name, &st));
            let ok = st.ok == st.calls;
            let slow = st
                .p99_ms
                .is_some_and(|p| p > self.cfg.latency_bound.as_secs_f64() * 1e3);
            let p99 = st.p99_ms;
            steps.push(st);
            if cut {
                budget_out = true;
                cut_at = Some(n);
                break;
            }
            if !ok {
                stop = Some(self.bound(&calls, since));
                break;
            }
            if slow {
                // This rung is past the bound: the figure is the last one within it.
                stop = Some((
                    "latency".into(),
                    vec![format!(
                        "p99 {:.0} ms at {n} concurrent requests is over the {:.0} ms latency bound",
                        p99.unwrap_or(0.0),
                        self.cfg.latency_bound.as_secs_f64() * 1e3
                    )],
                ));
                break;
            }
            offered = Some(n);
            top_load = load;
            if best.as_ref().is_none_or(|b| eff.value >= b.value) {
                best = Some(eff);
            }
        }
        fig.offered = offered;
        let value = best
            .as_ref()
            .map(|b| b.value.min(offered.unwrap_or(b.value)));
        fig.value = value;
        fig.concurrency = value;
        fig.method = best.as_ref().map(|b| b.method.clone());
        if let Some(tok) = steps
            .iter()
            .rev()
            .filter(|s| s.ok == s.calls)
            .find_map(|s| s.prompt_tokens)
        {
            fig.context_tokens = Some(tok);
        }
        let (kv_setting, seq_setting) = self.setting_names();
        let pool = self.server_settings.as_ref().and_then(|s| {
            // The prompt as the server counted it where it did.
            let prompt = fig.context_tokens.unwrap_or(tokens);
            concurrency::pool_fit(s, prompt, self.cfg.output_tokens as u64)
        });
        let queued = match (value, offered) {
            (Some(v), Some(o)) => concurrency::queue_bound(
                v,
                o,
                top_load.as_ref(),
                pool.as_ref(),
                &kv_setting,
                &seq_setting,
            ),
            _ => None,
        };
        let stop_note = |stop: &Option<(String, Vec<String>)>| {
            stop.as_ref().map(|(b, ev)| {
                format!(
                    "the ramp stopped after {} concurrent requests: bounded by {b}{}",
                    offered.unwrap_or(0),
                    ev.first().map(|e| format!(" ({e})")).unwrap_or_default()
                )
            })
        };
        match (queued, &stop) {
            (Some((b, mut ev)), _) => {
                fig.bounded_by = b;
                if let Some(e) = best.as_ref() {
                    ev.push(format!("in service at once ({}): {}", e.method, e.detail));
                }
                ev.extend(stop_note(&stop));
                fig.evidence = ev;
            }
            (None, Some((b, ev))) => {
                fig.bounded_by = b.clone();
                fig.evidence = ev.clone();
                if let Some(e) = best.as_ref().filter(|_| offered.unwrap_or(0) > 1) {
                    fig.evidence.push(format!(
                        "all {} in service at once ({}): {}",
                        offered.unwrap_or(0),
                        e.method,
                        e.detail
                    ));
                }
            }
            (None, None) => {
                fig.evidence
                    .push(format!("no failure up to --max-concurrency {max}"));
            }
        }
        let at = cut_at.map_or("the end of its ramp".into(), |n| {
            format!("{n} concurrent requests of {tokens} tokens")
        });
        if budget_out {
            fig.bounded_by = clock.bound().into();
            fig.evidence.push(format!(
                "{} (after {} rungs): the figure is a lower bound",
                clock.why(&at),
                steps.len()
            ));
        }
        let verdict = match (fig.value, budget_out) {
            (_, true) => format!(
                "incomplete: {}; {} concurrent requests of {tokens} tokens passed (a lower bound)",
                clock.why(&at),
                offered.unwrap_or(0)
            ),
            (Some(v), false) if Some(v) < offered => format!(
                "{v} in service at once of {} sent together at {tokens} tokens (bounded by {})",
                offered.unwrap_or(0),
                fig.bounded_by
            ),
            (Some(v), false) => format!(
                "{v} concurrent sequences at {tokens} tokens (bounded by {})",
                fig.bounded_by
            ),
            (None, false) => format!(
                "one sequence at {tokens} tokens already failed (bounded by {})",
                fig.bounded_by
            ),
        };
        let (status, reason) = ramp_status(budget_out, fig.value.is_some(), &clock);
        (
            suite(
                name,
                status,
                verdict,
                reason,
                steps,
                json!({"figure": fig}),
                clock.t,
                Some(budget),
            ),
            fig,
        )
    }

    /// N distinct requests at a fixed concurrency; the leak verdict is the
    /// collector's, and "no growth" is said only where it had memory samples.
    pub fn repeated(&mut self) -> SuiteReport {
        let tokens = self.cfg.typical_context as u64;
        // The probe's leftovers are waited out before the suite's time starts.
        let mut waited = self.await_idle();
        let clock = self.clock_for(Suite::Repeated, tokens);
        let budget = clock.budget;
        let since = oomscope_proto::now_ns();
        let c = self.cfg.repeat_concurrency.max(1);
        let words = self.size(tokens);
        self.progress.line(&progress::suite_line(
            "repeated",
            &format!("{} requests of {tokens} tokens", self.cfg.repeat),
            budget,
        ));
        let mut calls = Vec::new();
        let mut budget_out = false;
        while calls.len() < self.cfg.repeat {
            if clock.spent() {
                budget_out = true;
                break;
            }
            if let Some(w) = self.await_idle() {
                waited.get_or_insert(w);
            }
            self.progress
                .doing(&format!("repeated: {} of {}", calls.len(), self.cfg.repeat));
            let n = c.min(self.cfg.repeat - calls.len());
            let wanted = self.rung_timeout(tokens, n as u64);
            let given = clock.timeout(wanted);
            let asks = (0..n)
                .map(|_| self.ask(words, self.cfg.output_tokens, given))
                .collect();
            let mut got = burst(&self.ep, asks);
            let cut = clock.settle(&mut got, given, wanted);
            self.after_calls(&got);
            calls.extend(got);
            if cut {
                budget_out = true;
                break;
            }
            if self.down {
                break;
            }
        }
        let mut st = step(
            format!("{} x {tokens} tokens at {c}", calls.len()),
            words,
            Some(tokens),
            c,
            &calls,
        );
        st.idle_wait = waited;
        self.measure(&mut st, since);
        self.progress.line(&progress::rung_line("repeated", &st));
        // A request the budget cut is neither: not a failure of the server.
        let failures = calls.len() - st.ok - st.not_measured;
        let failed = failures > 0;
        let mut findings = json!({"requests": calls.len()});
        let mut leak: Option<String> = None;
        let mut growth_measured = false;
        let mut not_measured_why = "no --collector/--agent: growth not checked".to_string();
        if let Some(w) = self.watch.as_mut() {
            std::thread::sleep(self.cfg.settle);
            match (w.diagnose_since(since), st.memory.is_some()) {
                (Some(d), true) => {
                    growth_measured = true;
                    let causes: Vec<_> = d
                        .causes
                        .iter()
                        .map(|c| json!({"kind": c.kind, "confidence": c.confidence, "metrics": c.metrics}))
                        .collect();
                    findings["causes"] = json!(causes);
                    findings["trigger"] = json!(d.trigger);
                    if let Some(c) = d.causes.iter().find(|c| {
                        matches!(c.kind.parse(), Ok(CauseKind::Leak | CauseKind::HostGrowth))
                    }) {
                        let per = c.metrics.get("bytes_per_request").copied().unwrap_or(0.0);
                        leak = Some(format!(
                            "{}: {} per request ({})",
                            c.kind,
                            oomscope_analysis::units::bytes_table(per.max(0.0) as u64),
                            c.evidence.first().cloned().unwrap_or_default()
                        ));
                    }
                }
                (None, _) => {
                    not_measured_why = format!(
                        "the collector gave no verdict on {}'s timeline: growth not measured",
                        w.agent
                    )
                }
                (Some(_), false) => {
                    not_measured_why = format!(
                        "the collector had no memory samples of {}: growth not measured",
                        w.agent
                    )
                }
            }
        }
        findings["growth_measured"] = json!(growth_measured);
        if !growth_measured {
            findings["note"] = json!(not_measured_why);
        }
        let (status, verdict) = match (&leak, failed, budget_out) {
            (Some(l), ..) => (Status::Fail, format!("memory grows per request: {l}")),
            (None, true, _) => (
                Status::Fail,
                format!("{failures} of {} repeated requests failed", calls.len()),
            ),
            (None, false, true) => (
                Status::Error,
                format!(
                    "incomplete: {} ({} of {} requests answered, {} cut before an answer: not measured)",
                    clock.why(&format!("request {}", calls.len())),
                    st.ok,
                    self.cfg.repeat,
                    st.not_measured
                ),
            ),
            (None, false, false) if growth_measured => (
                Status::Pass,
                format!("{} requests, no growth per request", calls.len()),
            ),
            (None, false, false) => (
                Status::Pass,
                format!("{} requests succeeded ({not_measured_why})", calls.len()),
            ),
        };
        let reason = budget_out.then(|| clock.why(&format!("request {}", calls.len())));
        suite(
            "repeated",
            status,
            verdict,
            reason,
            vec![st],
            findings,
            clock.t,
            Some(budget),
        )
    }

    /// The fixture, replayed: its requests in waves of its concurrency,
    /// each prompt distinct and sized to the fixture's tokens, `repeats`
    /// times. It fails at the first wave the server fails (an error, a
    /// death, no answer): the failure came back. Bounded by the fixture's
    /// own size ([`fixture::MAX_REPLAY_REQUESTS`]) and the run's deadline.
    pub(crate) fn replay_fixture(&mut self, f: &Fixture) -> SuiteReport {
        let t = Instant::now();
        let total = f.requests.len() * f.repeats;
        self.progress.line(&format!(
            "fixture: {total} requests, {} at a time ({})",
            f.concurrency, f.source
        ));
        // The runtime's preemption counter around the replay (where it
        // exposes one): a load served by evicting running sequences did not
        // fit the KV pool, though every request was answered.
        let preempted_before = self.preemptions();
        let mut words_for: std::collections::BTreeMap<u64, usize> = Default::default();
        let mut steps: Vec<Step> = Vec::new();
        let mut failed: Option<String> = None;
        let mut cut: Option<String> = None;
        for (i, wave) in f.waves().enumerate() {
            let left = self.deadline_left();
            if left.is_zero() {
                cut = Some(format!(
                    "the run's {:.0} s deadline came before wave {}",
                    self.cfg.deadline.as_secs_f64(),
                    i + 1
                ));
                break;
            }
            let timeout = self.cfg.request_timeout.min(left);
            let mut asks = Vec::with_capacity(wave.len());
            for q in wave {
                let words = match words_for.get(&q.prompt_tokens) {
                    Some(&w) => w,
                    None => {
                        let w = self.size(q.prompt_tokens);
                        words_for.insert(q.prompt_tokens, w);
                        w
                    }
                };
                asks.push(self.ask(words, q.output_tokens as usize, timeout));
            }
            let tokens = wave.iter().map(|q| q.prompt_tokens).max().unwrap_or(0);
            let words = words_for.get(&tokens).copied().unwrap_or(0);
            let since = oomscope_proto::now_ns();
            let calls = burst(&self.ep, asks);
            self.after_calls(&calls);
            let label = format!("wave {}: {} x {tokens} tokens", i + 1, wave.len());
            let mut st = step(label, words, Some(tokens), wave.len(), &calls);
            self.measure(&mut st, since);
            self.progress.line(&progress::rung_line("fixture", &st));
            let bad = fixture::step_failed(&st);
            steps.push(st);
            if bad {
                let (bound, evidence) = self.bound(&calls, since);
                failed = Some(format!("{bound}: {}", evidence.join("; ")));
                break;
            }
        }
        let (status, verdict, reason) = match (failed, cut) {
            (Some(why), _) => (
                Status::Fail,
                "the failure came back: the fixture failed".to_string(),
                Some(why),
            ),
            (None, Some(why)) => (
                Status::Error,
                "incomplete: the fixture did not finish".to_string(),
                Some(why),
            ),
            (None, None) => (
                Status::Pass,
                format!("the fixture completed: {total} requests without a failure"),
                None,
            ),
        };
        let preemptions = preempted_before
            .zip(self.preemptions())
            .map(|(a, b)| (b - a).max(0.0));
        SuiteReport {
            suite: "fixture".into(),
            status,
            verdict,
            reason,
            steps,
            findings: json!({"source": f.source, "requests": total, "concurrency": f.concurrency,
                "preemptions": preemptions}),
            duration_s: t.elapsed().as_secs_f64(),
            budget_s: None,
        }
    }

    /// The runtime's preemptions counter since it started, where its
    /// metrics expose one (vLLM's `num_preemptions`, SGLang's retractions).
    fn preemptions(&self) -> Option<f64> {
        let src = self.server.load.as_ref()?;
        src.read(&self.ep, DISCOVERY_TIMEOUT)?.preemptions
    }

    /// A burst above capacity. A well-run server answers 429/503 quickly,
    /// keeps its queue bounded (nothing waits out the timeout), and survives.
    /// "Queue bounded" is claimed only when something was refused: a burst
    /// that was all served never reached the bound.
    pub fn overload(&mut self, capacity: Option<u64>) -> SuiteReport {
        // The probe's leftovers are waited out before the suite's time starts.
        let waited = self.await_idle();
        let clock = self.clock_for(Suite::Overload, self.cfg.overload_context as u64);
        let budget = clock.budget;
        let since = oomscope_proto::now_ns();
        let n = self
            .cfg
            .burst
            .unwrap_or_else(|| (capacity.unwrap_or(8) as usize * 4).clamp(16, 256));
        let tokens = self.cfg.overload_context as u64;
        let words = self.size(tokens);
        self.progress.line(&progress::suite_line(
            "overload",
            &format!("a burst of {n} requests of {tokens} tokens"),
            budget,
        ));
        self.progress.doing("overload: the burst");
        // The overload timeout is the test itself (an unbounded queue waits
        // it out), so the pace does not lengthen it; the clock may cut it.
        let wanted = self.cfg.overload_timeout;
        let given = clock.timeout(wanted);
        let asks = (0..n)
            .map(|_| self.ask(words, self.cfg.output_tokens, given))
            .collect();
        let mut calls = burst(&self.ep, asks);
        clock.settle(&mut calls, given, wanted);
        self.after_calls(&calls);
        let mut st = step(
            format!("burst of {n} x {tokens} tokens"),
            words,
            Some(tokens),
            n,
            &calls,
        );
        st.idle_wait = waited;
        self.measure(&mut st, since);
        self.progress.line(&progress::rung_line("overload", &st));
        let refused: Vec<Call> = calls
            .iter()
            .filter(|c| c.outcome == Outcome::Refused)
            .cloned()
            .collect();
        let refuse_p99 = percentile(&refused, 99.0);
        // After the burst: is the server still there?
        let alive_ask = self.ask(SMOKE_WORDS, 4, self.cfg.request_timeout);
        let alive_call = complete(&self.ep, &alive_ask, Instant::now());
        let alive = alive_call.outcome == Outcome::Ok;
        self.after_calls(std::slice::from_ref(&alive_call));
        let incidents: Vec<String> = self
            .watch
            .as_mut()
            .map(|w| {
                std::thread::sleep(Duration::from_millis(700));
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
        // A bounded queue shows itself by refusing; a burst all served says nothing about it.
        let queue_bounded = (st.refused > 0 && st.timeouts == 0)
            .then_some(true)
            .or((st.timeouts > 0).then_some(false));
        let findings = json!({
            "burst": n, "ok": st.ok, "refused": st.refused, "timeouts": st.timeouts, "server_errors": st.server_errors,
            "unreachable": st.unreachable, "refused_p99_ms": refuse_p99, "alive_after": alive, "oom": oom, "incidents": incidents, // vocab: keys
            "queue_bounded": queue_bounded,
        });
        let (status, verdict) = if !problems.is_empty() {
            (Status::Fail, problems.join("; "))
        } else if st.not_measured > 0 {
            (
                Status::Error,
                format!(
                    "incomplete: {} with {} of the burst unanswered (not measured)",
                    clock.ran_out(),
                    st.not_measured
                ),
            )
        } else if st.refused > 0 {
            (
                Status::Pass,
                format!(
                    "{} served, {} refused cleanly with 429/503 (p99 {:.0} ms); queue bounded; server alive",
                    st.ok,
                    st.refused,
                    refuse_p99.unwrap_or(0.0)
                ),
            )
        } else {
            (
                Status::Pass,
                format!(
                    "all {} served within {:.0} s and none refused: the burst did not reach a queue bound (queue bound not measured; a larger --burst would); server alive",
                    st.ok,
                    self.cfg.overload_timeout.as_secs_f64()
                ),
            )
        };
        suite(
            "overload",
            status,
            verdict,
            None,
            vec![st],
            findings,
            clock.t,
            Some(budget),
        )
    }
}

/// A ramp suite's status: an error (incomplete, with why) when its budget
/// ran out before the ramp ended, else passed with a figure or failed without.
fn ramp_status(budget_out: bool, has_figure: bool, clock: &Clock) -> (Status, Option<String>) {
    if budget_out {
        (
            Status::Error,
            Some(format!("{} before its ramp ended", clock.ran_out())),
        )
    } else if has_figure {
        (Status::Pass, None)
    } else {
        (Status::Fail, None)
    }
}
