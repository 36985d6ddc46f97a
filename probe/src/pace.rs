//! The server's pace: how fast it reads a prompt (prefill) and writes an
//! answer (decode), fitted to a few timed requests of known sizes, so that
//! each rung's timeout and each suite's budget are sized to this server:
//! a slow one is measured, not timed out (a 2,048-token prompt that takes
//! 90 s there is no failure). Pure: the samples come from the probe, which
//! counts their tokens with its calibration (or the server's usage).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A rung's requests may take this many times what the pace predicts
/// before they time out: a shared machine's jitter, a second tenant, a
/// cold cache. The pace only ever lengthens a timeout (`--request-timeout`
/// is the floor).
pub const TIMEOUT_SLACK: f64 = 3.0;

/// A suite wants this many times what its planned requests are predicted
/// to take (bisection rungs, idle waits and warm-up come on top).
pub const BUDGET_SLACK: f64 = 1.5;

/// The bisection's rungs, at most, as the pace counts them: 5 % of an
/// interval of 2x is reached in about this many halvings.
pub const BISECT_RUNGS: u64 = 5;

/// One timed request: the tokens it read and wrote, and how long it took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub prompt_tokens: f64,
    pub output_tokens: f64,
    pub latency_ms: f64,
}

/// `latency = overhead + prompt x prefill + output x decode`, in ms.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pace {
    /// Prompt tokens read per second (null: too fast to tell from the samples).
    pub prefill_tokens_per_s: Option<f64>,
    /// Tokens generated per second (null: too fast to tell).
    pub decode_tokens_per_s: Option<f64>,
    /// A request's fixed cost (HTTP, scheduling).
    pub overhead_ms: f64,
    /// The fastest tiny request on the idle server: the reference a later
    /// tiny request is held to, to tell that the server is idle again.
    pub tiny_ms: f64,
    pub samples: usize,
}

impl Pace {
    /// The pace that explains `samples` best (least squares), with no cost
    /// below zero; `tiny_ms` is the fastest sample. None without at least
    /// one sample whose prompt and one whose output differ from the others'.
    pub fn fit(samples: &[Sample]) -> Option<Pace> {
        let distinct =
            |f: fn(&Sample) -> f64| samples.iter().any(|s| (f(s) - f(&samples[0])).abs() > 0.5);
        if samples.len() < 3 || !distinct(|s| s.prompt_tokens) || !distinct(|s| s.output_tokens) {
            return None;
        }
        // Terms in order: overhead, prefill, decode. A term whose cost comes
        // out below zero (noise on a fast server) is dropped and the rest refit.
        let mut keep = [true; 3];
        let coef = loop {
            let c = least_squares(samples, keep)?;
            match (0..3).find(|&i| keep[i] && c[i] < 0.0) {
                Some(i) => keep[i] = false,
                None => break c,
            }
        };
        let rate = |ms: f64| (ms > 1e-6).then(|| 1e3 / ms);
        Some(Pace {
            overhead_ms: coef[0],
            prefill_tokens_per_s: rate(coef[1]),
            decode_tokens_per_s: rate(coef[2]),
            tiny_ms: samples
                .iter()
                .map(|s| s.latency_ms)
                .fold(f64::INFINITY, f64::min),
            samples: samples.len(),
        })
    }

    fn prefill_ms(&self) -> f64 {
        self.prefill_tokens_per_s.map_or(0.0, |r| 1e3 / r)
    }

    fn decode_ms(&self) -> f64 {
        self.decode_tokens_per_s.map_or(0.0, |r| 1e3 / r)
    }

    /// One request's predicted time on the idle server.
    pub fn predict(&self, prompt_tokens: u64, output_tokens: u64) -> Duration {
        let ms = self.overhead_ms
            + self.prefill_ms() * prompt_tokens as f64
            + self.decode_ms() * output_tokens as f64;
        Duration::from_secs_f64(ms.max(0.0) / 1e3)
    }

    /// A request's timeout when `in_line` requests of its size are sent
    /// together (a server that serializes them answers the last after all):
    /// [`TIMEOUT_SLACK`] times their predicted time, never below `floor`.
    pub fn timeout(&self, floor: Duration, prompt: u64, output: u64, in_line: u64) -> Duration {
        floor.max(
            self.predict(prompt, output)
                .mul_f64(TIMEOUT_SLACK * in_line.max(1) as f64),
        )
    }

    /// The predicted time of a ramp's rungs, each `(prompt tokens, requests
    /// sent together)`, as a server that serializes them would take it; a
    /// rung takes at most `rung_cap` (a latency bound ends a ramp there),
    /// and the ramp ends after its first rung that reaches it.
    pub fn ramp(&self, rungs: &[(u64, u64)], output: u64, rung_cap: Option<Duration>) -> Duration {
        let mut total = Duration::ZERO;
        for &(prompt, n) in rungs {
            let t = self.predict(prompt, output).mul_f64(n.max(1) as f64);
            match rung_cap {
                Some(cap) if t >= cap => return total + cap,
                _ => total += t,
            }
        }
        total
    }
}

/// Least squares over the kept terms (1, prompt, output); dropped terms are 0.
fn least_squares(samples: &[Sample], keep: [bool; 3]) -> Option<[f64; 3]> {
    let idx: Vec<usize> = (0..3).filter(|&i| keep[i]).collect();
    let row = |s: &Sample| [1.0, s.prompt_tokens, s.output_tokens];
    let k = idx.len();
    if k == 0 {
        return Some([0.0; 3]);
    }
    // Normal equations, solved by Gauss-Jordan with partial pivoting.
    let mut m = vec![vec![0.0f64; k + 1]; k];
    for s in samples {
        let x = row(s);
        for (a, &i) in idx.iter().enumerate() {
            for (b, &j) in idx.iter().enumerate() {
                m[a][b] += x[i] * x[j];
            }
            m[a][k] += x[i] * s.latency_ms;
        }
    }
    for col in 0..k {
        let p = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[p][col].abs() < 1e-9 {
            return None;
        }
        m.swap(col, p);
        let pivot = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot[col];
                for (x, p) in row.iter_mut().zip(&pivot).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut out = [0.0; 3];
    for (a, &i) in idx.iter().enumerate() {
        out[i] = m[a][k] / m[a][a];
    }
    Some(out)
}

/// This suite's share of the time left: what it wants where all the
/// suites still to run (`wants`, this one first) fit, else its part of the
/// time left in proportion to what each wants, so that the last suite
/// still gets its turn within the deadline.
pub fn share(left: Duration, wants: &[Duration]) -> Duration {
    let Some(&mine) = wants.first() else {
        return left;
    };
    let all: Duration = wants.iter().sum();
    if all <= left || all.is_zero() {
        return mine;
    }
    left.mul_f64(mine.as_secs_f64() / all.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(p: f64, o: f64, ms: f64) -> Sample {
        Sample {
            prompt_tokens: p,
            output_tokens: o,
            latency_ms: ms,
        }
    }

    /// A server of 20 ms overhead, 5 ms a prompt token, 12 ms a generated one.
    fn truth(p: f64, o: f64) -> Sample {
        s(p, o, 20.0 + 5.0 * p + 12.0 * o)
    }

    #[test]
    fn the_fit_finds_prefill_and_decode_rates() {
        let pace = Pace::fit(&[
            truth(7.0, 4.0),
            truth(7.0, 4.0),
            truth(260.0, 4.0),
            truth(7.0, 32.0),
        ])
        .unwrap();
        assert!(
            (pace.prefill_tokens_per_s.unwrap() - 200.0).abs() < 0.5,
            "{pace:?}"
        );
        assert!(
            (pace.decode_tokens_per_s.unwrap() - 1e3 / 12.0).abs() < 0.5,
            "{pace:?}"
        );
        assert!((pace.overhead_ms - 20.0).abs() < 0.5, "{pace:?}");
        assert_eq!(pace.tiny_ms, 20.0 + 35.0 + 48.0);
        // 2048 tokens with 16 out: 20 + 10240 + 192 ms.
        let t = pace.predict(2048, 16).as_secs_f64();
        assert!((t - 10.452).abs() < 0.01, "{t}");
        // Four sent together to a server that serializes them.
        let floor = Duration::from_secs(60);
        assert_eq!(pace.timeout(floor, 64, 16, 1), floor);
        let long = pace.timeout(floor, 2048, 16, 4).as_secs_f64();
        assert!((long - 3.0 * 4.0 * 10.452).abs() < 0.1, "{long}");
    }

    #[test]
    fn noise_never_makes_a_cost_negative_and_too_few_samples_fit_nothing() {
        // A fast server: the long prompt came back sooner than the tiny one.
        let pace =
            Pace::fit(&[s(7.0, 4.0, 30.0), s(260.0, 4.0, 28.0), s(7.0, 32.0, 90.0)]).unwrap();
        assert_eq!(pace.prefill_tokens_per_s, None, "{pace:?}");
        assert!(
            pace.decode_tokens_per_s.unwrap() > 0.0 && pace.overhead_ms >= 0.0,
            "{pace:?}"
        );
        assert!(Pace::fit(&[truth(7.0, 4.0), truth(7.0, 4.0), truth(7.0, 32.0)]).is_none());
        assert!(Pace::fit(&[truth(7.0, 4.0), truth(260.0, 4.0)]).is_none());
    }

    #[test]
    fn a_ramp_ends_at_its_first_rung_over_the_latency_bound() {
        let pace = Pace::fit(&[truth(0.0, 0.0), truth(100.0, 0.0), truth(0.0, 100.0)]).unwrap();
        // 100 ms a request of 16 tokens, no output: rungs of 1, 2, 4, 8.
        let rungs: Vec<(u64, u64)> = [1, 2, 4, 8].iter().map(|&n| (16, n)).collect();
        let whole = pace.ramp(&rungs, 0, None).as_secs_f64();
        assert!((whole - 1.5).abs() < 0.01, "{whole}");
        let capped = pace
            .ramp(&rungs, 0, Some(Duration::from_millis(300)))
            .as_secs_f64();
        assert!(
            (capped - 0.6).abs() < 0.01,
            "1, 2, then 4 stopped at the bound: {capped}"
        );
    }

    #[test]
    fn suites_share_what_is_left_in_proportion() {
        let secs = Duration::from_secs;
        assert_eq!(share(secs(600), &[secs(100), secs(200)]), secs(100));
        assert_eq!(share(secs(60), &[secs(100), secs(200)]), secs(20));
        assert_eq!(share(secs(60), &[]), secs(60));
    }
}
