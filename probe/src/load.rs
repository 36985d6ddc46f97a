//! One completion request and a burst of them: the body for the API in use
//! (completions or chat), streamed where the server streams (for the time
//! to first token), and every ending classified as an [`Outcome`]. The body
//! and answer parsing are pure; [`complete`] and [`burst`] do the I/O.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use super::http::{request, Endpoint, Failure, HttpError, Response};

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
    /// Connection refused or dropped: the server is down or died.
    Unreachable,
    /// Cut by the probe's own suite budget or deadline before an answer:
    /// no claim about the server either way, never a failure.
    NotMeasured,
}

/// The OpenAI-compatible API the probe drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// POST /completions {"prompt"}.
    Completions,
    /// POST /chat/completions {"messages"}.
    Chat,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/completions",
            Api::Chat => "/chat/completions",
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }
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
    /// Why the transport failed, when it did.
    #[serde(skip)]
    pub failure: Option<Failure>,
    /// Milliseconds since the burst started, when the request was sent...
    pub start_ms: f64,
    /// ...when its first streamed token came (streaming only)...
    pub first_token_ms: Option<f64>,
    /// ...and when the answer was complete.
    pub at_ms: f64,
    /// Words in its prompt.
    pub prompt_words: usize,
}

impl Call {
    pub fn is_oom(&self) -> bool {
        self.error
            .as_deref()
            .is_some_and(oomscope_analysis::is_oom_text)
    }

    /// The connection was refused: nothing listens where the server was.
    pub fn refused_connection(&self) -> bool {
        self.failure == Some(Failure::Refused)
    }

    pub fn timing(&self) -> crate::concurrency::Timing {
        crate::concurrency::Timing {
            start_ms: self.start_ms,
            first_token_ms: self.first_token_ms,
            end_ms: self.at_ms,
        }
    }
}

/// What to send.
#[derive(Clone, Debug)]
pub struct Ask {
    pub model: Option<String>,
    pub prompt: String,
    pub max_tokens: usize,
    pub idempotency_key: Option<String>,
    pub timeout: Duration,
    pub api: Api,
    /// Ask for a stream (and its usage), to see the first token.
    pub stream: bool,
    /// The tokens the server is expected to count for the prompt (0: unknown).
    pub prompt_tokens: u64,
    /// Where the request is reported as the server's workload, if anywhere.
    pub workload: Option<std::sync::Arc<crate::workload::Workload>>,
}

/// The request body for `ask`.
pub fn body(ask: &Ask) -> Value {
    let mut b = match ask.api {
        Api::Completions => json!({"prompt": ask.prompt}),
        Api::Chat => json!({"messages": [{"role": "user", "content": ask.prompt}]}),
    };
    b["max_tokens"] = json!(ask.max_tokens);
    b["temperature"] = json!(0);
    if ask.stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    if let Some(m) = &ask.model {
        b["model"] = json!(m);
    }
    b
}

/// What an answer said: usage, id, the first token's time, or an error.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub id: Option<String>,
    /// ms after the request was sent (streams only).
    pub first_token_ms: Option<f64>,
    pub error: Option<String>,
}

fn error_text(v: &Value) -> Option<String> {
    v["error"]["message"]
        .as_str()
        .or_else(|| v["error"].as_str())
        .or_else(|| v["detail"].as_str())
        .or_else(|| v["message"].as_str().filter(|_| v.get("choices").is_none()))
        .map(str::to_string)
}

fn has_token(choice: &Value) -> bool {
    let nonempty = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
    nonempty(&choice["text"])
        || nonempty(&choice["delta"]["content"])
        || nonempty(&choice["delta"]["reasoning_content"])
}

/// Reads a JSON answer or an event stream (usage from whichever event carries it).
pub fn parse(resp: &Response) -> Parsed {
    if !resp.events.is_empty() || resp.is_event_stream() {
        let mut p = Parsed::default();
        let mut tokens = 0u64;
        for e in &resp.events {
            if e.data == "[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(&e.data) else {
                continue;
            };
            if let Some(err) = error_text(&v) {
                p.error.get_or_insert(err);
            }
            if p.id.is_none() {
                p.id = v["id"].as_str().map(str::to_string);
            }
            if v["choices"]
                .as_array()
                .is_some_and(|c| c.iter().any(has_token))
            {
                tokens += 1;
                p.first_token_ms.get_or_insert(e.at_ms);
            }
            if let Some(u) = v["usage"].as_object() {
                p.prompt_tokens = u
                    .get("prompt_tokens")
                    .and_then(Value::as_u64)
                    .or(p.prompt_tokens);
                p.completion_tokens = u
                    .get("completion_tokens")
                    .and_then(Value::as_u64)
                    .or(p.completion_tokens);
            }
        }
        if p.completion_tokens.is_none() && tokens > 0 {
            p.completion_tokens = Some(tokens);
        }
        return p;
    }
    let v = resp.json().unwrap_or(Value::Null);
    Parsed {
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64(),
        completion_tokens: v["usage"]["completion_tokens"].as_u64(),
        id: v["id"].as_str().map(str::to_string),
        first_token_ms: None,
        error: error_text(&v),
    }
}

/// The outcome of an HTTP status (an error event inside a 200 stream is a server error).
pub fn outcome_of(status: u16, stream_error: bool) -> Outcome {
    match status {
        200..=299 if stream_error => Outcome::ServerError,
        200..=299 => Outcome::Ok,
        429 | 503 => Outcome::Refused,
        400..=499 => Outcome::Rejected,
        _ => Outcome::ServerError,
    }
}

/// One completion; never fails: every ending is an Outcome.
pub fn complete(ep: &Endpoint, ask: &Ask, t0: Instant) -> Call {
    let payload = body(ask);
    let mut headers: Vec<(&str, &str)> = Vec::new();
    if let Some(k) = &ask.idempotency_key {
        headers.push(("Idempotency-Key", k));
    }
    let start_ms = t0.elapsed().as_secs_f64() * 1e3;
    let open = ask
        .workload
        .as_ref()
        .map(|w| w.start(ask.prompt_tokens, ask.max_tokens as u64));
    let started = Instant::now();
    let r = request(
        ep,
        "POST",
        ask.api.path(),
        Some(&payload),
        &headers,
        ask.timeout,
    );
    let latency_ms = started.elapsed().as_secs_f64() * 1e3;
    let at_ms = t0.elapsed().as_secs_f64() * 1e3;
    let prompt_words = ask.prompt.split_whitespace().count();
    let call = call_of(r, latency_ms, start_ms, at_ms, prompt_words);
    if let (Some(w), Some(open)) = (&ask.workload, open) {
        w.end(
            open,
            call.prompt_tokens,
            call.completion_tokens,
            call.error.as_deref(),
        );
    }
    call
}

/// What one request's answer (or its failure) was.
fn call_of(
    r: Result<Response, HttpError>,
    latency_ms: f64,
    start_ms: f64,
    at_ms: f64,
    prompt_words: usize,
) -> Call {
    match r {
        Err(e) => Call {
            outcome: if e.kind == Failure::Timeout {
                Outcome::Timeout
            } else {
                Outcome::Unreachable
            },
            status: None,
            latency_ms,
            prompt_tokens: None,
            completion_tokens: None,
            id: None,
            replayed: false,
            error: Some(e.text),
            failure: Some(e.kind),
            start_ms,
            first_token_ms: None,
            at_ms,
            prompt_words,
        },
        Ok(resp) => {
            let p = parse(&resp);
            let stream_error =
                resp.is_event_stream() && p.error.is_some() && p.completion_tokens.is_none();
            let outcome = outcome_of(resp.status, stream_error);
            let error = (outcome != Outcome::Ok)
                .then(|| p.error.clone().unwrap_or_else(|| resp.text_head(300)));
            Call {
                outcome,
                status: Some(resp.status),
                latency_ms,
                prompt_tokens: p.prompt_tokens,
                completion_tokens: p.completion_tokens,
                id: p.id,
                replayed: resp
                    .header("x-idempotent-replay")
                    .is_some_and(|h| h.eq_ignore_ascii_case("true")),
                error,
                failure: None,
                start_ms,
                first_token_ms: p.first_token_ms.map(|f| start_ms + f),
                at_ms,
                prompt_words,
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
    quantile(
        calls
            .iter()
            .filter(|c| c.status.is_some())
            .map(|c| c.latency_ms),
        p,
    )
}

/// Percentile (0..=100) of the time to first token, over the calls that streamed.
pub fn first_token_percentile(calls: &[Call], p: f64) -> Option<f64> {
    quantile(
        calls
            .iter()
            .filter_map(|c| c.first_token_ms.map(|f| f - c.start_ms)),
        p,
    )
}

fn quantile(values: impl Iterator<Item = f64>, p: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.collect();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::SseEvent;

    fn ask(api: Api, stream: bool) -> Ask {
        Ask {
            model: Some("m".into()),
            prompt: "a b c".into(),
            max_tokens: 4,
            idempotency_key: None,
            timeout: Duration::from_secs(1),
            api,
            stream,
            prompt_tokens: 0,
            workload: None,
        }
    }

    #[test]
    fn bodies_for_each_api() {
        let b = body(&ask(Api::Completions, false));
        assert_eq!(b["prompt"], "a b c");
        assert!(b.get("stream").is_none());
        let b = body(&ask(Api::Chat, true));
        assert_eq!(b["messages"][0]["content"], "a b c");
        assert_eq!(
            (
                b["stream"].as_bool(),
                b["stream_options"]["include_usage"].as_bool()
            ),
            (Some(true), Some(true))
        );
        assert_eq!(b["model"], "m");
    }

    fn sse(events: &[(f64, &str)]) -> Response {
        Response {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: vec![],
            events: events
                .iter()
                .map(|(t, d)| SseEvent {
                    at_ms: *t,
                    data: d.to_string(),
                })
                .collect(),
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn a_stream_gives_its_first_token_time_and_usage() {
        let r = sse(&[
            (
                5.0,
                r#"{"id":"c1","choices":[{"delta":{"role":"assistant"}}]}"#,
            ),
            (
                40.0,
                r#"{"id":"c1","choices":[{"delta":{"content":"Hi"}}]}"#,
            ),
            (50.0, r#"{"id":"c1","choices":[{"delta":{"content":"!"}}]}"#),
            (
                51.0,
                r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2}}"#,
            ),
            (51.0, "[DONE]"),
        ]);
        let p = parse(&r);
        assert_eq!(p.first_token_ms, Some(40.0));
        assert_eq!((p.prompt_tokens, p.completion_tokens), (Some(12), Some(2)));
        assert_eq!(p.id.as_deref(), Some("c1"));
        // Completions streams carry text.
        let r = sse(&[(9.0, r#"{"choices":[{"text":" x"}]}"#)]);
        assert_eq!(
            (parse(&r).first_token_ms, parse(&r).completion_tokens),
            (Some(9.0), Some(1))
        );
        // An error event in a 200 stream.
        let r = sse(&[(3.0, r#"{"error":{"message":"CUDA out of memory"}}"#)]);
        assert_eq!(parse(&r).error.as_deref(), Some("CUDA out of memory"));
    }

    #[test]
    fn json_answers_and_statuses() {
        let r = Response {
            status: 500,
            headers: vec![],
            body: br#"{"error":{"message":"OutOfMemoryError: x"}}"#.to_vec(),
            events: vec![],
            elapsed: Duration::ZERO,
        };
        assert_eq!(parse(&r).error.as_deref(), Some("OutOfMemoryError: x"));
        assert_eq!(outcome_of(200, false), Outcome::Ok);
        assert_eq!(outcome_of(200, true), Outcome::ServerError);
        assert_eq!(outcome_of(429, false), Outcome::Refused);
        assert_eq!(outcome_of(404, false), Outcome::Rejected);
        assert_eq!(outcome_of(500, false), Outcome::ServerError);
    }
}
