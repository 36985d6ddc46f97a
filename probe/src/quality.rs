//! The quality check of a retest: a fixed prompt set answered greedily
//! (temperature 0, a fixed seed), one prompt at a time, compared with the
//! baseline launch's answers. A change that alters the numerics (precision,
//! KV-cache type, quantization) shows as different completions, or, where
//! the server returns `logprobs`, as moved token log-probabilities even
//! when the greedy tokens stay the same. Sent one at a time so that batch
//! composition, which may legitimately change float sums, is the same in
//! every launch. A server with no `/completions` answers through
//! `/chat/completions` (the same prompts as one user message each).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::http::{request, Endpoint};
use crate::load::Api;
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
    /// The path that answered (`/completions` or `/chat/completions`).
    #[serde(default)]
    pub via: String,
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
    /// The path the candidate answered through (`/completions`, or
    /// `/chat/completions` on a server that offers only chat).
    #[serde(default)]
    pub via: String,
}

impl Drift {
    /// What the check could not measure, where it could not: a server that
    /// returned no log-probabilities leaves the drift to the text alone.
    pub fn note(&self) -> Option<String> {
        self.mean_abs_logprob_delta.is_none().then(|| {
            format!(
                "no logprobs from the server (through {}): drift from the completions' text alone",
                self.via
            )
        })
    }
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
        via: cand[0].via.clone(),
    }
}

/// Request fields a server may refuse (400/422: FastAPI servers reject what
/// they do not know), dropped in this order before the first answer: the
/// check then runs on the text alone, and says so.
const OPTIONAL_FIELDS: [&str; 2] = ["logprobs", "seed"];

/// The quality prompts' requests and answers through either API: on a
/// server that offers only chat (`transformers serve`, many vLLM
/// deployments), the prompt is one user message.
trait Greedy {
    fn body(self, prompt: &str, model: Option<&str>, dropped: usize) -> serde_json::Value;
    fn answer(self, v: &serde_json::Value) -> Answer;
}

impl Greedy for Api {
    /// The greedy request for `prompt`, without the `dropped` optional fields.
    fn body(self, prompt: &str, model: Option<&str>, dropped: usize) -> serde_json::Value {
        let mut body = match self {
            Api::Completions => json!({"prompt": prompt, "logprobs": 1}),
            Api::Chat => {
                json!({"messages": [{"role": "user", "content": prompt}], "logprobs": true})
            }
        };
        body["max_tokens"] = json!(QUALITY_TOKENS);
        body["temperature"] = json!(0);
        body["seed"] = json!(0);
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        for f in &OPTIONAL_FIELDS[..dropped] {
            body.as_object_mut().map(|o| o.remove(*f));
        }
        body
    }

    /// The answer in a 200's JSON (pure): the text and, where returned, the
    /// tokens and their log-probabilities (`/completions`: `logprobs.tokens`
    /// and `.token_logprobs`; chat: `logprobs.content[].token`/`.logprob`).
    fn answer(self, v: &serde_json::Value) -> Answer {
        let c = &v["choices"][0];
        let strings = |a: Option<&Vec<serde_json::Value>>, key: Option<&str>| {
            a.map(|t| {
                t.iter()
                    .map(|x| {
                        key.map_or(x, |k| &x[k])
                            .as_str()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .collect::<Vec<_>>()
            })
        };
        let floats = |a: Option<&Vec<serde_json::Value>>, key: Option<&str>| {
            a.map(|t| {
                t.iter()
                    .map(|x| key.map_or(x, |k| &x[k]).as_f64().unwrap_or(f64::NAN))
                    .collect::<Vec<_>>()
            })
        };
        let (text, tokens, token_logprobs) = match self {
            Api::Completions => {
                let lp = &c["logprobs"];
                (
                    c["text"].as_str(),
                    strings(lp["tokens"].as_array(), None),
                    floats(lp["token_logprobs"].as_array(), None),
                )
            }
            Api::Chat => {
                let content = c["logprobs"]["content"].as_array();
                (
                    c["message"]["content"].as_str(),
                    strings(content, Some("token")),
                    floats(content, Some("logprob")),
                )
            }
        };
        Answer {
            text: text.unwrap_or_default().to_string(),
            tokens,
            token_logprobs,
            via: self.path().to_string(),
        }
    }
}

/// The fixed prompt set's greedy answers from the server at `ep`, one at a
/// time: through `/completions`, or `/chat/completions` where the server
/// has no `/completions` (404/405 to the first prompt). Err: why not (one
/// failed request fails the set).
pub fn answers(
    ep: &Endpoint,
    model: Option<&str>,
    timeout: Duration,
) -> Result<Vec<Answer>, String> {
    let mut prompts = Prompts::new(QUALITY_SEED);
    let mut out = Vec::with_capacity(QUALITY_PROMPTS);
    let mut api = Api::Completions;
    let mut dropped = 0;
    for _ in 0..QUALITY_PROMPTS {
        let prompt = prompts.next(QUALITY_WORDS);
        let v = loop {
            let r = request(
                ep,
                "POST",
                api.path(),
                Some(&api.body(&prompt, model, dropped)),
                &[],
                timeout,
            )
            .map_err(|e| format!("quality prompt: {}", e.text))?;
            match r.status {
                200 => {
                    break serde_json::from_slice::<serde_json::Value>(&r.body)
                        .map_err(|e| format!("quality prompt: {e}"))?
                }
                404 | 405 if out.is_empty() && api == Api::Completions => api = Api::Chat,
                400 | 422 if out.is_empty() && dropped < OPTIONAL_FIELDS.len() => dropped += 1,
                s => return Err(format!("quality prompt ({}): HTTP {s}", api.path())),
            }
        };
        out.push(api.answer(&v));
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
            via: "/completions".into(),
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

    #[test]
    fn both_apis_answers_are_read_with_their_logprobs() {
        let chat = json!({"choices": [{"message": {"role": "assistant", "content": "t1 t2"},
            "logprobs": {"content": [{"token": "t1", "logprob": -0.5}, {"token": "t2", "logprob": -1.5}]}}]});
        let a = Api::Chat.answer(&chat);
        assert_eq!(a.text, "t1 t2");
        assert_eq!(a.tokens, Some(vec!["t1".to_string(), "t2".to_string()]));
        assert_eq!(a.token_logprobs, Some(vec![-0.5, -1.5]));
        assert_eq!(a.via, "/chat/completions");
        let plain = json!({"choices": [{"text": " x", "logprobs": {"tokens": [" x"], "token_logprobs": [-2.0]}}]});
        let b = Api::Completions.answer(&plain);
        assert_eq!(
            (b.text.as_str(), b.token_logprobs),
            (" x", Some(vec![-2.0]))
        );
        // A chat answer without logprobs: the text alone, and the drift says so.
        let bare = Api::Chat.answer(&json!({"choices": [{"message": {"content": "t1"}}]}));
        assert_eq!((&bare.tokens, &bare.token_logprobs), (&None, &None));
        let d = compare(std::slice::from_ref(&bare), std::slice::from_ref(&bare));
        assert!(
            d.note().unwrap().contains("through /chat/completions"),
            "{d:?}"
        );
        // The bodies: greedy either way; a refused field dropped in order.
        let body = Api::Chat.body("p", None, 0);
        assert_eq!(
            (body["logprobs"].clone(), body["temperature"].clone()),
            (json!(true), json!(0))
        );
        assert_eq!(body["messages"][0]["content"], "p");
        let body = Api::Completions.body("p", Some("m"), 1);
        assert!(body.get("logprobs").is_none() && body["seed"] == 0 && body["model"] == "m");
    }
}
