//! The quality check of a retest: a fixed prompt set answered greedily
//! (temperature 0, a fixed seed), one prompt at a time, compared with the
//! baseline launch's answers. A change that alters the numerics (precision,
//! KV-cache type, quantization) shows as different completions, or, where
//! the server returns `logprobs`, as moved token log-probabilities even
//! when the greedy tokens stay the same. Sent one at a time so that batch
//! composition, which may legitimately change float sums, is the same in
//! every launch.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::http::{request, Endpoint};
use crate::tokens::Prompts;

/// Prompts in the set: enough that one flipped token among them shows.
pub const QUALITY_PROMPTS: usize = 8;
/// Words a prompt: a short turn, well inside any fixture's failing size.
pub const QUALITY_WORDS: usize = 48;
/// Tokens generated per prompt: drift compounds along a greedy answer.
pub const QUALITY_TOKENS: u64 = 24;
/// The prompts' seed: the same set in every launch.
const QUALITY_SEED: u64 = 0x00c0_ffee;
/// A change is flagged when fewer than all completions are identical, or
/// when the mean |Δ logprob| passes this many nats. The same build answering
/// the same prompt alone is bit-exact (0.0 measured on the reference server
/// across launches); a bfloat16 KV cache moved it by about 6e-5 with every
/// completion still identical. 1e-5 sits between, above the last digits
/// float32 JSON printing can round.
pub const MAX_MEAN_LOGPROB_DELTA: f64 = 1e-5;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub text: String,
    /// The generated tokens and their log-probabilities, where returned.
    pub tokens: Option<Vec<String>>,
    pub token_logprobs: Option<Vec<f64>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Drift {
    /// Share of completions identical to the baseline's.
    pub identical_share: f64,
    /// Mean position (0-based, in tokens where returned, else words) of the
    /// first difference among the completions that differ.
    pub mean_first_difference: Option<f64>,
    /// Mean |Δ logprob| over the tokens both answers generated alike, where
    /// both launches returned logprobs.
    pub mean_abs_logprob_delta: Option<f64>,
    /// Over the threshold: the model's own accuracy suite must be rerun.
    pub flagged: bool,
}

fn pieces(a: &Answer) -> Vec<String> {
    a.tokens
        .clone()
        .unwrap_or_else(|| a.text.split_whitespace().map(str::to_string).collect())
}

/// `cand`'s drift from `base`, prompt by prompt (pure).
pub fn compare(base: &[Answer], cand: &[Answer]) -> Drift {
    let n = base.len().min(cand.len());
    if n == 0 {
        return Drift::default();
    }
    let same = (0..n).filter(|&i| base[i].text == cand[i].text).count();
    let firsts: Vec<f64> = (0..n)
        .filter(|&i| base[i].text != cand[i].text)
        .map(|i| {
            let (a, b) = (pieces(&base[i]), pieces(&cand[i]));
            a.iter().zip(&b).take_while(|(x, y)| x == y).count() as f64
        })
        .collect();
    let mut deltas = Vec::new();
    for i in 0..n {
        if let (Some(a), Some(b)) = (&base[i].token_logprobs, &cand[i].token_logprobs) {
            // Only where both generated the same token: a different token's
            // probability is another question.
            let (ta, tb) = (pieces(&base[i]), pieces(&cand[i]));
            let alike = ta.iter().zip(&tb).take_while(|(x, y)| x == y).count();
            deltas.extend(a.iter().zip(b).take(alike).map(|(x, y)| (x - y).abs()));
        }
    }
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let identical_share = same as f64 / n as f64;
    let mean_abs_logprob_delta = mean(&deltas);
    Drift {
        identical_share,
        mean_first_difference: mean(&firsts),
        mean_abs_logprob_delta,
        flagged: same < n || mean_abs_logprob_delta.is_some_and(|d| d > MAX_MEAN_LOGPROB_DELTA),
    }
}

/// The fixed prompt set's greedy answers from the server at `ep`
/// (`/completions`), one at a time. Err: why not (one failed request fails the set).
pub fn answers(
    ep: &Endpoint,
    model: Option<&str>,
    timeout: Duration,
) -> Result<Vec<Answer>, String> {
    let mut prompts = Prompts::new(QUALITY_SEED);
    let mut out = Vec::with_capacity(QUALITY_PROMPTS);
    for _ in 0..QUALITY_PROMPTS {
        let mut body = json!({"prompt": prompts.next(QUALITY_WORDS), "max_tokens": QUALITY_TOKENS,
            "temperature": 0, "seed": 0, "logprobs": 1});
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        let r = request(ep, "POST", "/completions", Some(&body), &[], timeout)
            .map_err(|e| format!("quality prompt: {}", e.text))?;
        if r.status != 200 {
            return Err(format!("quality prompt: HTTP {}", r.status));
        }
        let v: serde_json::Value =
            serde_json::from_slice(&r.body).map_err(|e| format!("quality prompt: {e}"))?;
        let c = &v["choices"][0];
        let lp = &c["logprobs"];
        out.push(Answer {
            text: c["text"].as_str().unwrap_or_default().to_string(),
            tokens: lp["tokens"].as_array().map(|t| {
                t.iter()
                    .map(|x| x.as_str().unwrap_or_default().to_string())
                    .collect()
            }),
            token_logprobs: lp["token_logprobs"]
                .as_array()
                .map(|t| t.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect()),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(text: &str, lps: Option<&[f64]>) -> Answer {
        Answer {
            text: text.into(),
            tokens: lps.map(|_| text.split(' ').map(str::to_string).collect()),
            token_logprobs: lps.map(<[f64]>::to_vec),
        }
    }

    #[test]
    fn identical_answers_do_not_drift() {
        let base = vec![a("t1 t2 t3", Some(&[-1.0, -2.0, -3.0])), a("t4 t5", None)];
        let d = compare(&base, &base.clone());
        assert_eq!(d.identical_share, 1.0);
        assert_eq!(d.mean_first_difference, None);
        assert_eq!(d.mean_abs_logprob_delta, Some(0.0));
        assert!(!d.flagged);
    }

    #[test]
    fn moved_logprobs_or_tokens_are_flagged() {
        let base = vec![
            a("t1 t2 t3", Some(&[-1.0, -2.0, -3.0])),
            a("t4 t5 t6", None),
        ];
        // Same tokens, log-probabilities moved by 1e-4: flagged on the logprobs alone.
        let moved = vec![
            a("t1 t2 t3", Some(&[-1.0001, -2.0001, -3.0001])),
            a("t4 t5 t6", None),
        ];
        let d = compare(&base, &moved);
        assert_eq!(d.identical_share, 1.0);
        assert!((d.mean_abs_logprob_delta.unwrap() - 1e-4).abs() < 1e-9);
        assert!(d.flagged);
        // One completion differs from its third word.
        let other = vec![
            a("t1 t2 t3", Some(&[-1.0, -2.0, -3.0])),
            a("t4 t5 t9", None),
        ];
        let d = compare(&base, &other);
        assert_eq!(d.identical_share, 0.5);
        assert_eq!(d.mean_first_difference, Some(2.0));
        assert!(d.flagged);
    }
}
