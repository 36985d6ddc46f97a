//! The run's time: each suite's budget (its default, grown to what the
//! server's measured pace says its requests need, capped by
//! `--suite-budget`), all within the run's `--deadline`; each request's
//! timeout cut where its suite's time ends first. A request that this cut
//! is not measured, never a failure of the server.

use std::time::{Duration, Instant};

use crate::load::{complete, Call, Outcome};
use crate::pace::{self, Pace, Sample, BISECT_RUNGS, BUDGET_SLACK};
use crate::tokens::doubling;
use crate::{Probe, Suite};

/// The pace's tiny requests: words in the prompt, tokens generated.
const PACE_TINY_WORDS: usize = 4;
const PACE_TINY_OUTPUT: usize = 4;
/// The pace's longer prompt, in tokens: long enough for its prefill to
/// stand out of a tiny request's overhead.
pub(crate) const PACE_PROMPT_TOKENS: u64 = 256;
/// The pace's longer answer, in tokens.
pub(crate) const PACE_OUTPUT_TOKENS: usize = 32;

/// What ends a suite's time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Limit {
    /// Its own budget (its default, its pace, or `--suite-budget`).
    Budget,
    /// The run's `--deadline` (it left the suite less than it wanted).
    Deadline,
}

/// A suite's clock: when it began and when its time ends.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    pub t: Instant,
    pub budget: Duration,
    pub by: Limit,
    /// The run's `--deadline`, for the words.
    pub deadline: Duration,
}

impl Clock {
    pub fn new(budget: Duration, by: Limit, deadline: Duration) -> Clock {
        Clock {
            t: Instant::now(),
            budget,
            by,
            deadline,
        }
    }

    pub fn left(&self) -> Duration {
        self.budget.saturating_sub(self.t.elapsed())
    }

    pub fn spent(&self) -> bool {
        self.left().is_zero()
    }

    /// A request's timeout: `wanted`, or less where the suite's time ends sooner.
    pub fn timeout(&self, wanted: Duration) -> Duration {
        wanted.min(self.left()).max(Duration::from_millis(50))
    }

    /// Calls sent with `given` as their timeout where they wanted
    /// `wanted`: where this clock cut it short, those that timed out ran
    /// out of the probe's time, not of server, and become
    /// [`Outcome::NotMeasured`]. True when there were any.
    pub fn settle(&self, calls: &mut [Call], given: Duration, wanted: Duration) -> bool {
        if given >= wanted {
            return false;
        }
        let mut cut = false;
        for c in calls.iter_mut().filter(|c| c.outcome == Outcome::Timeout) {
            c.outcome = Outcome::NotMeasured;
            cut = true;
        }
        cut
    }

    /// A figure's `bounded_by` when this clock ended its ramp.
    pub fn bound(&self) -> &'static str {
        match self.by {
            Limit::Budget => "suite_budget",
            Limit::Deadline => "deadline",
        }
    }

    /// What ended the suite's time: "the suite's 120 s budget ran out".
    pub fn ran_out(&self) -> String {
        match self.by {
            Limit::Budget => format!(
                "the suite's {:.0} s budget ran out",
                self.budget.as_secs_f64()
            ),
            Limit::Deadline => format!(
                "the run's {:.0} s deadline was reached",
                self.deadline.as_secs_f64()
            ),
        }
    }

    /// Why a ramp ended early, `at` where it was: "the suite's 120 s budget
    /// ran out at 2048 tokens".
    pub fn why(&self, at: &str) -> String {
        format!("{} at {at}", self.ran_out())
    }
}

impl Probe {
    /// The longest prompt the long-context ramp asks for: `--max-context`,
    /// or the server's own limit less the output tokens where lower.
    pub(crate) fn context_limit(&self) -> u64 {
        let out = self.cfg.output_tokens as u64;
        let limit = self.cfg.max_context as u64;
        match self.server.max_model_len {
            Some(m) => limit.min(m.saturating_sub(out)),
            None => limit,
        }
    }

    /// The budgeted suites a run of `wanted` takes, in order, each with the
    /// prompt size it runs at (the concurrency suite twice: at the typical
    /// context, then at the max context where long-context runs too).
    pub(crate) fn plan(&self, wanted: &[&str]) -> Vec<(Suite, u64)> {
        let has = |s: Suite| wanted.contains(&s.name());
        let mut plan = Vec::new();
        for s in Suite::ALL.into_iter().filter(|&s| has(s) && s.budgeted()) {
            match s {
                Suite::LongContext => plan.push((s, self.context_limit())),
                Suite::Concurrency => {
                    plan.push((s, self.cfg.typical_context as u64));
                    if has(Suite::LongContext) {
                        plan.push((s, self.context_limit()));
                    }
                }
                Suite::Repeated => plan.push((s, self.cfg.typical_context as u64)),
                Suite::Overload => plan.push((s, self.cfg.overload_context as u64)),
                Suite::Smoke | Suite::Restart => {}
            }
        }
        plan
    }

    /// What `suite`'s requests at `tokens` are predicted to take.
    fn need(&self, p: &Pace, suite: Suite, tokens: u64) -> Duration {
        let c = &self.cfg;
        let out = c.output_tokens as u64;
        match suite {
            Suite::LongContext => {
                let limit = self.context_limit();
                let rungs: Vec<(u64, u64)> = doubling((c.min_context as u64).min(limit), limit)
                    .into_iter()
                    .map(|t| (t, 1))
                    .collect();
                p.ramp(&rungs, out, None) + p.predict(limit, out) * BISECT_RUNGS as u32
            }
            Suite::Concurrency => {
                let rungs: Vec<(u64, u64)> = doubling(1, c.max_concurrency.max(1) as u64)
                    .into_iter()
                    .map(|n| (tokens, n))
                    .collect();
                p.ramp(&rungs, out, Some(c.latency_bound))
            }
            Suite::Repeated => p.predict(tokens, out) * c.repeat as u32,
            Suite::Overload => {
                let n = c.burst.unwrap_or(64) as u32;
                (p.predict(tokens, out) * n).min(c.overload_timeout)
            }
            Suite::Smoke | Suite::Restart => Duration::ZERO,
        }
    }

    /// What `suite` at `tokens` wants: `--suite-budget` where set, else its
    /// default budget, more where the pace says its requests need it.
    fn want(&self, suite: Suite, tokens: u64) -> Duration {
        if let Some(cap) = self.cfg.suite_budget {
            return cap;
        }
        let d = suite.default_budget();
        match &self.pace {
            Some(p) => d.max(self.need(p, suite, tokens).mul_f64(BUDGET_SLACK)),
            None => d,
        }
    }

    /// A rung's request timeout for prompts of `tokens` with `in_line` sent
    /// together: `--request-timeout`, longer where the pace says so.
    pub(crate) fn rung_timeout(&self, tokens: u64, in_line: u64) -> Duration {
        let floor = self.cfg.request_timeout;
        match &self.pace {
            Some(p) => p.timeout(floor, tokens, self.cfg.output_tokens as u64, in_line),
            None => floor,
        }
    }

    /// Times a few requests of known sizes and fits the server's pace
    /// ([`Pace::fit`]): a tiny one twice (the faster counts), one with a longer prompt
    /// ([`PACE_PROMPT_TOKENS`], or a quarter of the context limit), and one
    /// with a longer answer ([`PACE_OUTPUT_TOKENS`]). Each waits at least
    /// `--request-timeout`, and longer where the tiny one's time says a
    /// request that size could need it. Their tokens are the server's
    /// count (usage) where it gave one, else the calibration's.
    pub(crate) fn measure_pace(&mut self) -> Result<Pace, String> {
        let tiny_words = PACE_TINY_WORDS;
        let big = PACE_PROMPT_TOKENS.min(self.context_limit() / 4).max(1);
        let plan = [
            ("tiny", tiny_words, PACE_TINY_OUTPUT),
            ("tiny", tiny_words, PACE_TINY_OUTPUT),
            ("long-prompt", self.size(big), PACE_TINY_OUTPUT),
            ("long-answer", tiny_words, PACE_OUTPUT_TOKENS),
        ];
        let mut samples = Vec::new();
        // The fastest tiny request so far, (ms, prompt and output tokens): the smoke's first.
        let mut tiny: Option<(f64, f64, f64)> = self.tiny_ms.map(|ms| {
            let prompt = self.cal.tokens_for(tiny_words) as f64;
            (ms, prompt, PACE_TINY_OUTPUT as f64)
        });
        let mut fitted_tiny: Option<f64> = None;
        for (what, words, out) in plan {
            let floor = self.cfg.request_timeout;
            // Whatever a tiny request's time went on (overhead, prompt,
            // answer), one with at most k times its prompt and k times its
            // answer takes at most k times as long.
            let scale = match tiny {
                Some((ms, prompt, answer)) => {
                    let k = (self.cal.tokens_for(words) as f64 / prompt.max(1.0))
                        .max(out as f64 / answer.max(1.0))
                        .max(1.0);
                    Duration::from_secs_f64(ms * k * pace::TIMEOUT_SLACK / 1e3)
                }
                None => floor,
            };
            let left = self.deadline_left();
            let timeout = floor.max(scale).min(left);
            if timeout.is_zero() {
                return Err("the deadline was reached".into());
            }
            let ask = self.ask(words, out, timeout);
            let call = complete(&self.ep, &ask, Instant::now());
            self.after_calls(std::slice::from_ref(&call));
            if call.outcome != Outcome::Ok {
                return Err(format!(
                    "its {what} request ({words} words) ended {:?}: {}",
                    call.outcome,
                    call.error.as_deref().unwrap_or("no error text")
                ));
            }
            let sample = Sample {
                prompt_tokens: call
                    .prompt_tokens
                    .unwrap_or_else(|| self.cal.tokens_for(words))
                    as f64,
                output_tokens: call.completion_tokens.unwrap_or(out as u64) as f64,
                latency_ms: call.latency_ms,
            };
            if what == "tiny" {
                // Of the two tiny ones only the faster is fitted: the
                // other paid for a busy moment (or a warm-up) that the
                // larger requests' costs must not absorb as a negative.
                if tiny.is_none_or(|(ms, ..)| sample.latency_ms < ms) {
                    tiny = Some((
                        sample.latency_ms,
                        sample.prompt_tokens,
                        sample.output_tokens,
                    ));
                }
                match fitted_tiny {
                    Some(ms) if ms <= sample.latency_ms => continue,
                    Some(_) => {
                        samples.pop();
                    }
                    None => {}
                }
                fitted_tiny = Some(sample.latency_ms);
            }
            samples.push(sample);
        }
        Pace::fit(&samples).ok_or_else(|| "its samples did not tell prompt from answer".into())
    }

    /// What is left of the run's deadline.
    pub(crate) fn deadline_left(&self) -> Duration {
        self.deadline_at.saturating_duration_since(Instant::now())
    }

    /// The clock of `suite` at `tokens`, the next in the plan: what it
    /// wants, or its share of what the deadline leaves the suites still to
    /// run ([`pace::share`]) where that is less.
    pub(crate) fn clock_for(&mut self, suite: Suite, tokens: u64) -> Clock {
        if let Some(i) = self.ahead.iter().position(|(s, _)| *s == suite) {
            self.ahead.remove(i);
        }
        let mine = self.want(suite, tokens);
        let wants: Vec<Duration> = std::iter::once(mine)
            .chain(self.ahead.iter().map(|&(s, t)| self.want(s, t)))
            .collect();
        let given = pace::share(self.deadline_left(), &wants);
        let by = if given < mine {
            Limit::Deadline
        } else {
            Limit::Budget
        };
        Clock::new(given.min(mine), by, self.cfg.deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::Call;

    fn call(outcome: Outcome, latency_ms: f64) -> Call {
        Call {
            outcome,
            status: None,
            latency_ms,
            prompt_tokens: None,
            completion_tokens: None,
            id: None,
            replayed: false,
            error: None,
            failure: None,
            start_ms: 0.0,
            first_token_ms: None,
            at_ms: latency_ms,
            prompt_words: 1,
        }
    }

    #[test]
    fn a_timeout_the_clock_cut_short_is_not_measured() {
        let c = Clock::new(
            Duration::from_secs(2),
            Limit::Deadline,
            Duration::from_secs(9),
        );
        let wanted = Duration::from_secs(60);
        let given = c.timeout(wanted);
        assert!(given <= Duration::from_secs(2), "{given:?}");
        // Sent with the 2 s the clock had left of the 60 s they wanted.
        let mut calls = vec![call(Outcome::Timeout, 2000.0), call(Outcome::Ok, 10.0)];
        assert!(c.settle(&mut calls, given, wanted));
        let got: Vec<_> = calls.iter().map(|c| c.outcome.clone()).collect();
        assert_eq!(got, [Outcome::NotMeasured, Outcome::Ok]);
        // One that had its whole timeout and waited it out timed out.
        let mut whole = vec![call(Outcome::Timeout, 60_000.0)];
        assert!(!c.settle(&mut whole, wanted, wanted));
        assert_eq!(whole[0].outcome, Outcome::Timeout);
        assert_eq!(c.bound(), "deadline");
        assert_eq!(
            c.why("2048 tokens"),
            "the run's 9 s deadline was reached at 2048 tokens"
        );
    }
}
