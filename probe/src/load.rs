//! One completion request and a burst of them: the body for the API in use
//! (completions or chat), streamed where the server streams (for the time
//! to first token), and every ending classified as an [`Outcome`]. The body
//! and answer parsing are pure; [`complete`] and [`burst`] do the I/O.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use super::answer::{self, parse, Parsed};
use super::http::{request, Endpoint, Failure, HttpError, Response};

/// How one request ended.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// 200 with evidence of generation (a token, completion tokens, a finish reason).
    Ok,
    /// 200 without any evidence of generation (no event, an empty body, no
    /// choices): a refusal at that size, seen on servers that answer a
    /// prompt over their context window so.
    Empty,
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
    /// Shared by a run's requests: the server rejected our optional fields
    /// ([`answer::OPTIONAL_FIELDS`]) once, so none of them is sent again.
    pub lean: Lean,
}

/// Whether the server rejects the optional request fields (set once, read by every request of a run).
pub type Lean = std::sync::Arc<std::sync::atomic::AtomicBool>;

/// The request body for `ask`.
pub fn body(ask: &Ask) -> Value {
    let mut b = match ask.api {
        Api::Completions => json!({"prompt": ask.prompt}),
        Api::Chat => json!({"messages": [{"role": "user", "content": ask.prompt}]}),
    };
    b["max_tokens"] = json!(ask.max_tokens);
    if !ask.lean.load(Ordering::Relaxed) {
        // Greedy, and the whole max_tokens (vLLM's and SGLang's ignore_eos): each request costs alike.
        b["temperature"] = json!(0);
        b["ignore_eos"] = json!(true);
    }
    if ask.stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    if let Some(m) = &ask.model {
        b["model"] = json!(m);
    }
    b
}

/// How one HTTP answer ended: 200 needs evidence of generation (else
/// [`Outcome::Empty`]); an error in a 200 stream is a server error unless it
/// is about the context length; 429/503 refused; other 4xx rejected.
pub fn outcome(status: u16, p: &Parsed) -> Outcome {
    match status {
        200..=299 => match (&p.error, p.generated()) {
            (Some(e), false) if answer::is_context_refusal(e) => Outcome::Rejected,
            (Some(_), false) => Outcome::ServerError,
            (_, true) => Outcome::Ok,
            (None, false) => Outcome::Empty,
        },
        429 | 503 => Outcome::Refused,
        400..=499 => Outcome::Rejected,
        _ => Outcome::ServerError,
    }
}

/// One completion; never fails: every ending is an Outcome. A server that
/// rejects an optional field by name gets the request again without them
/// (once; the run remembers it).
pub fn complete(ep: &Endpoint, ask: &Ask, t0: Instant) -> Call {
    let call = complete_once(ep, ask, t0);
    let rejected = call
        .status
        .is_some_and(|s| answer::rejects_optional_fields(s, call.error.as_deref()));
    if rejected && !ask.lean.swap(true, Ordering::Relaxed) {
        return complete_once(ep, ask, t0);
    }
    call
}

fn complete_once(ep: &Endpoint, ask: &Ask, t0: Instant) -> Call {
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
            let outcome = outcome(resp.status, &p);
            let error = match outcome {
                Outcome::Ok => None,
                Outcome::Empty => Some(answer::empty_text(&resp)),
                _ => Some(p.error.clone().unwrap_or_else(|| resp.text_head(300))),
            };
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
            lean: Lean::default(),
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
        assert_eq!(
            (b["ignore_eos"].as_bool(), b["temperature"].as_i64()),
            (Some(true), Some(0))
        );
        let a = ask(Api::Chat, true);
        a.lean.store(true, Ordering::Relaxed);
        let b = body(&a);
        assert!(
            b.get("ignore_eos").is_none() && b.get("temperature").is_none(),
            "{b}"
        );
        assert_eq!(b["stream"], true, "what the request needs stays");
    }

    /// A server that rejects unknown fields (422 naming `ignore_eos`, as
    /// FastAPI does) gets the request again without them, once per run.
    #[test]
    fn a_rejected_optional_field_is_dropped_and_remembered() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let mut bodies = Vec::new();
            for _ in 0..3 {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = vec![0u8; 65536];
                let mut n = 0;
                while !String::from_utf8_lossy(&buf[..n]).ends_with('}') {
                    n += s.read(&mut buf[n..]).unwrap();
                }
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let body = req.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
                let reply = if body.contains("ignore_eos") {
                    r#"{"detail":[{"type":"extra_forbidden","loc":["body","ignore_eos"],"msg":"Extra inputs are not permitted"}]}"#
                        .to_string()
                } else {
                    r#"{"id":"c","choices":[{"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#
                        .to_string()
                };
                let status = if body.contains("ignore_eos") {
                    "422 Unprocessable Entity"
                } else {
                    "200 OK"
                };
                let _ = s.write_all(
                    format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}", reply.len())
                        .as_bytes(),
                );
                bodies.push(body);
            }
            bodies
        });
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}/v1")).unwrap();
        let a = ask(Api::Completions, false);
        let c = complete(&ep, &a, Instant::now());
        assert_eq!(
            (c.outcome.clone(), c.prompt_tokens),
            (Outcome::Ok, Some(3)),
            "{c:?}"
        );
        assert!(a.lean.load(Ordering::Relaxed));
        // The next request of the run goes lean at once.
        let c = complete(&ep, &a.clone(), Instant::now());
        assert_eq!(c.outcome, Outcome::Ok);
        let bodies = server.join().unwrap();
        assert!(bodies[0].contains("ignore_eos"));
        assert!(
            !bodies[1].contains("ignore_eos") && !bodies[2].contains("ignore_eos"),
            "{bodies:?}"
        );
    }

    fn sse(events: &[(f64, &str)]) -> Response {
        Response::event_stream(events)
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
        assert_eq!(outcome(500, &parse(&r)), Outcome::ServerError);
    }
}
