//! Completion requests and bounded bursts of them against one endpoint.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::http::{request, Endpoint};

/// How one request ended.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// 200 with a completion.
    Ok,
    /// 429 or 503: the server refused it cleanly (overload, not ready, restoring).
    Refused,
    /// 400/413/422: the request itself was refused (context too long, bad model).
    Rejected,
    /// 5xx other than 503, e.g. 500 with an out-of-memory error.
    ServerError,
    /// No answer in time.
    Timeout,
    /// Connection refused or reset: the server is down or died.
    Unreachable,
}

#[derive(Clone, Debug, Serialize)]
pub struct Call {
    pub outcome: Outcome,
    pub status: Option<u16>,
    pub latency_ms: f64,
    /// Prompt tokens as the server counted them (usage.prompt_tokens).
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// The completion's id, to tell a replayed answer from a reprocessed one.
    pub id: Option<String>,
    /// The server said it answered from its idempotency store.
    pub replayed: bool,
    /// The server's error text, or the transport error.
    pub error: Option<String>,
    /// Milliseconds since the burst started, when the answer came.
    pub at_ms: f64,
}

impl Call {
    pub fn is_oom(&self) -> bool {
        self.error
            .as_deref()
            .is_some_and(oomscope_analysis::is_oom_text)
    }
}

/// What to send.
#[derive(Clone, Debug)]
pub struct Ask {
    pub model: Option<String>,
    /// Words in the prompt; one word is one token for the reference servers'
    /// tokenizers and close to it for BPE models (reported usage is authoritative).
    pub prompt_words: usize,
    pub max_tokens: usize,
    pub idempotency_key: Option<String>,
    pub timeout: Duration,
}

pub fn prompt(words: usize) -> String {
    // Distinct words, so prefix caches and dedup do not make long prompts free.
    (0..words).map(|i| format!("w{} ", i % 997)).collect()
}

/// One completion; never fails: every ending is an Outcome.
pub fn complete(ep: &Endpoint, ask: &Ask, t0: Instant) -> Call {
    let mut body =
        json!({"prompt": prompt(ask.prompt_words), "max_tokens": ask.max_tokens, "temperature": 0});
    if let Some(m) = &ask.model {
        body["model"] = json!(m);
    }
    let key_header;
    let mut headers: Vec<(&str, &str)> = Vec::new();
    if let Some(k) = &ask.idempotency_key {
        key_header = k.clone();
        headers.push(("Idempotency-Key", &key_header));
    }
    let started = Instant::now();
    let r = request(
        ep,
        "POST",
        "/completions",
        Some(&body),
        &headers,
        ask.timeout,
    );
    let latency_ms = started.elapsed().as_secs_f64() * 1e3;
    let at_ms = t0.elapsed().as_secs_f64() * 1e3;
    match r {
        Err(e) => {
            let text = format!("{e:#}");
            let outcome = if text.contains("timed out")
                || text.contains("WouldBlock")
                || text.contains("Resource temporarily unavailable")
                || started.elapsed() >= ask.timeout
            {
                Outcome::Timeout
            } else {
                Outcome::Unreachable
            };
            Call {
                outcome,
                status: None,
                latency_ms,
                prompt_tokens: None,
                completion_tokens: None,
                id: None,
                replayed: false,
                error: Some(text),
                at_ms,
            }
        }
        Ok(resp) => {
            let v = resp.json().unwrap_or(serde_json::Value::Null);
            let outcome = match resp.status {
                200..=299 => Outcome::Ok,
                429 | 503 => Outcome::Refused,
                400..=499 => Outcome::Rejected,
                _ => Outcome::ServerError,
            };
            let error = (outcome != Outcome::Ok).then(|| {
                v["error"]["message"]
                    .as_str()
                    .or_else(|| v["error"].as_str())
                    .or_else(|| v["detail"].as_str())
                    .map(str::to_string)
                    .unwrap_or_else(|| resp.text_head(300))
            });
            Call {
                outcome,
                status: Some(resp.status),
                latency_ms,
                prompt_tokens: v["usage"]["prompt_tokens"].as_u64(),
                completion_tokens: v["usage"]["completion_tokens"].as_u64(),
                id: v["id"].as_str().map(str::to_string),
                replayed: resp
                    .header("x-idempotent-replay")
                    .is_some_and(|h| h.eq_ignore_ascii_case("true")),
                error,
                at_ms,
            }
        }
    }
}

/// `n` requests at once (one thread each), all started together.
pub fn burst(ep: &Endpoint, asks: Vec<Ask>) -> Vec<Call> {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = asks
            .into_iter()
            .map(|a| s.spawn(move || complete(ep, &a, t0)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("probe request thread"))
            .collect()
    })
}

/// Latency percentile (0..=100) of the calls that got an answer.
pub fn percentile(calls: &[Call], p: f64) -> Option<f64> {
    let mut v: Vec<f64> = calls
        .iter()
        .filter(|c| c.status.is_some())
        .map(|c| c.latency_ms)
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    Some(v[i.min(v.len() - 1)])
}

pub fn count(calls: &[Call], o: Outcome) -> usize {
    calls.iter().filter(|c| c.outcome == o).count()
}
