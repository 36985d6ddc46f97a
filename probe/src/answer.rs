//! What an answer means, whatever OpenAI-compatible server gave it. Pure:
//! the bytes of one response in, its [`Outcome`] and what it counted out.
//!
//! A 200 is no success by itself: some servers answer a prompt over their
//! context window with 200 and an event stream that carries no event. A
//! success needs evidence of generation (a token, `completion_tokens > 0`
//! or a finish reason); a 200 without any is [`Outcome::Empty`], a refusal
//! at that size. An error inside a stream is a server error, unless its text
//! is about the context length: then it is the server refusing the size
//! ([`crate::load::outcome`] maps an answer to its outcome).

use serde_json::Value;

use crate::http::Response;

/// What an answer said: usage, id, the first token's time, or an error.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub id: Option<String>,
    /// ms after the request was sent (streams only).
    pub first_token_ms: Option<f64>,
    pub error: Option<String>,
    /// Generated text seen (stream events or choices carrying text).
    pub tokens_seen: u64,
    /// A choice's finish reason ("length", "stop").
    pub finish_reason: Option<String>,
}

impl Parsed {
    /// Evidence that the server generated something for the request.
    pub fn generated(&self) -> bool {
        self.tokens_seen > 0
            || self.completion_tokens.is_some_and(|n| n > 0)
            || self.finish_reason.is_some()
    }
}

/// The error text of an OpenAI (`{"error": {"message"}}`, `{"error": "..."}`),
/// vLLM (`{"object": "error", "message"}`) or FastAPI (`{"detail": "..."}`,
/// or pydantic's `{"detail": [{"loc", "msg"}]}`) error body.
pub fn error_text(v: &Value) -> Option<String> {
    if let Some(s) = v["error"]["message"]
        .as_str()
        .or_else(|| v["error"].as_str())
        .or_else(|| v["detail"].as_str())
        .or_else(|| v["detail"]["message"].as_str())
        .or_else(|| v["message"].as_str().filter(|_| v.get("choices").is_none()))
    {
        return Some(s.to_string());
    }
    let items = v["detail"].as_array()?;
    let msgs: Vec<String> = items
        .iter()
        .filter_map(|d| {
            let msg = d["msg"].as_str().or_else(|| d.as_str())?;
            let loc: Vec<String> = d["loc"]
                .as_array()
                .map(|l| {
                    l.iter()
                        .map(|x| x.as_str().map_or(x.to_string(), str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            Some(match loc.is_empty() {
                true => msg.to_string(),
                false => format!("{}: {msg}", loc.join(".")),
            })
        })
        .collect();
    (!msgs.is_empty()).then(|| msgs.join("; "))
}

fn has_token(choice: &Value) -> bool {
    let nonempty = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
    nonempty(&choice["text"])
        || nonempty(&choice["delta"]["content"])
        || nonempty(&choice["delta"]["reasoning_content"])
        || nonempty(&choice["message"]["content"])
        || nonempty(&choice["message"]["reasoning_content"])
}

fn finish_reason(choices: &[Value]) -> Option<String> {
    choices
        .iter()
        .find_map(|c| c["finish_reason"].as_str().filter(|s| !s.is_empty()))
        .map(str::to_string)
}

fn read_usage(p: &mut Parsed, v: &Value) {
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

/// Reads a JSON answer or an event stream (usage from whichever event carries it).
pub fn parse(resp: &Response) -> Parsed {
    let mut p = Parsed::default();
    if !resp.events.is_empty() || resp.is_event_stream() {
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
            let choices = v["choices"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            if choices.iter().any(has_token) {
                p.tokens_seen += 1;
                p.first_token_ms.get_or_insert(e.at_ms);
            }
            if let Some(f) = finish_reason(choices) {
                p.finish_reason = Some(f);
            }
            read_usage(&mut p, &v);
        }
        if p.completion_tokens.is_none() && p.tokens_seen > 0 {
            p.completion_tokens = Some(p.tokens_seen);
        }
        count_from_refusal(&mut p, None);
        return p;
    }
    let v = resp.json().unwrap_or(Value::Null);
    let choices = v["choices"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    p.tokens_seen = choices.iter().filter(|c| has_token(c)).count() as u64;
    p.finish_reason = finish_reason(choices);
    read_usage(&mut p, &v);
    p.id = v["id"].as_str().map(str::to_string);
    p.error = error_text(&v);
    count_from_refusal(&mut p, Some(&v));
    p
}

/// A refusal for length that states the prompt's count: the server's count.
fn count_from_refusal(p: &mut Parsed, body: Option<&Value>) {
    if p.prompt_tokens.is_some() {
        return;
    }
    if let Some(e) = p.error.as_deref().filter(|e| is_context_refusal(e)) {
        p.prompt_tokens = refused_prompt_tokens(body, e);
    }
}

/// Error texts that say the prompt is over the server's context window, as
/// vLLM, SGLang, llama.cpp, TGI, transformers and OpenAI word it.
const CONTEXT_TEXTS: [&str; 16] = [
    "`max_new_tokens` must be",
    "maximum context length",
    "context length",
    "context window",
    "context_length",
    "max_model_len",
    "max-model-len",
    "max-context",
    "must have less than",
    "maximum sequence length",
    "max sequence length",
    "input is too long",
    "prompt is too long",
    "too many tokens",
    "exceeds the maximum",
    // transformers serve: "The prompt has 2069 tokens, but the model takes at most 2048"
    "model takes at most",
];

/// Where refusal texts give the prompt's length as the server counted it:
/// the number right after each of these (lower case).
const REFUSAL_COUNTS: [&str; 7] = [
    // llama-cpp-python: "Requested tokens (10331) exceed context window of 8192"
    "requested tokens (",
    // transformers serve: "The prompt has 2069 tokens, but the model takes at most 2048"
    "prompt has ",
    // vLLM: "... However, your request has 2092 input tokens"
    "your request has ",
    // SGLang: "The input (2100 tokens) is longer than the model's context length"
    "the input (",
    // TGI: "... must be <= 2048. Given: 2092 `inputs` tokens and 8 `max_new_tokens`"
    "given: ",
    // OpenAI: "... your prompt contains at least 4097 input tokens"
    "contains at least ",
    // older vLLM: "you requested 2100 tokens (2092 in the messages, 8 in the completion)"
    "tokens (",
];

/// The prompt's length in tokens that a refusal's body or text states:
/// llama.cpp's server gives `n_prompt_tokens` in its error object; the
/// others say it in words ([`REFUSAL_COUNTS`]). A refused prompt is still a
/// count of the server's tokenizer: a server with no tokenize endpoint and
/// no usage is calibrated from its refusals.
pub fn refused_prompt_tokens(body: Option<&Value>, text: &str) -> Option<u64> {
    if let Some(n) = body.and_then(|v| v["error"]["n_prompt_tokens"].as_u64()) {
        return Some(n);
    }
    let t = text.to_ascii_lowercase();
    REFUSAL_COUNTS.iter().find_map(|marker| {
        t.match_indices(marker).find_map(|(at, m)| {
            let digits: String = t[at + m.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse::<u64>().ok().filter(|&n| n > 0)
        })
    })
}

/// The text is the server refusing a prompt for its length.
pub fn is_context_refusal(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    CONTEXT_TEXTS.iter().any(|c| t.contains(c))
}

/// The request fields a server may not know; a server that rejects one of
/// them by name gets the request again without them.
pub const OPTIONAL_FIELDS: [&str; 2] = ["ignore_eos", "temperature"];

/// A 400/422 that names one of our optional fields: the server rejects
/// fields it does not know (FastAPI's `extra_forbidden`, a strict schema).
pub fn rejects_optional_fields(status: u16, error: Option<&str>) -> bool {
    matches!(status, 400 | 422)
        && error.is_some_and(|e| OPTIONAL_FIELDS.iter().any(|f| e.contains(f)))
}

/// What an empty 200 looked like, for the report.
pub fn empty_text(resp: &Response) -> String {
    if resp.is_event_stream() {
        let n = resp.events.iter().filter(|e| e.data != "[DONE]").count();
        format!("no generated token: an event stream of {n} events without text, usage or finish reason (a refusal at this size)")
    } else {
        let head = resp.text_head(120);
        format!(
            "no generated token: {} (a refusal at this size)",
            if head.trim().is_empty() {
                "an empty body".to_string()
            } else {
                format!("no choice with text, usage or finish reason in {head:?}")
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{outcome, Outcome};
    use std::time::Duration;

    /// Events 10 ms apart.
    fn sse(events: &[&str]) -> Response {
        let timed: Vec<(f64, &str)> = events
            .iter()
            .enumerate()
            .map(|(i, &d)| (10.0 * (i + 1) as f64, d))
            .collect();
        Response::event_stream(&timed)
    }

    fn json(status: u16, body: &str) -> Response {
        Response {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.as_bytes().to_vec(),
            events: vec![],
            elapsed: Duration::ZERO,
        }
    }

    fn outcome_of(r: &Response) -> Outcome {
        outcome(r.status, &parse(r))
    }

    #[test]
    fn a_200_stream_with_no_event_or_no_text_is_empty_not_ok() {
        assert_eq!(outcome_of(&sse(&[])), Outcome::Empty);
        assert_eq!(outcome_of(&sse(&["[DONE]"])), Outcome::Empty);
        // A role-only delta is no token.
        let r = sse(&[r#"{"id":"c","choices":[{"delta":{"role":"assistant"}}]}"#]);
        assert_eq!(outcome_of(&r), Outcome::Empty);
        // Non-streamed: an empty body, or no choices.
        assert_eq!(outcome_of(&json(200, "")), Outcome::Empty);
        assert_eq!(
            outcome_of(&json(200, r#"{"id":"x","choices":[]}"#)),
            Outcome::Empty
        );
        assert!(empty_text(&sse(&[])).contains("0 events"));
        assert!(empty_text(&json(200, "")).contains("empty body"));
    }

    #[test]
    fn a_token_usage_or_finish_reason_is_evidence_of_generation() {
        // transformers serve: no [DONE], usage only when asked; the stream ends on its finish reason.
        let r = sse(&[
            r#"{"id":"c","choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"id":"c","choices":[{"delta":{"content":"Hi"}}]}"#,
            r#"{"id":"c","choices":[{"delta":{},"finish_reason":"length"}]}"#,
        ]);
        let p = parse(&r);
        assert_eq!(
            (p.tokens_seen, p.finish_reason.as_deref(), p.first_token_ms),
            (1, Some("length"), Some(20.0))
        );
        assert_eq!(outcome(200, &p), Outcome::Ok);
        // Only a finish reason (a stop at once).
        let r = sse(&[r#"{"choices":[{"text":"","finish_reason":"stop"}]}"#]);
        assert_eq!(outcome_of(&r), Outcome::Ok);
        // Only usage.
        let r = sse(&[r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}"#]);
        assert_eq!(outcome_of(&r), Outcome::Ok);
        assert_eq!(parse(&r).prompt_tokens, Some(9));
        // Usage of zero completion tokens is no evidence.
        let r = json(
            200,
            r#"{"choices":[{"text":""}],"usage":{"prompt_tokens":9,"completion_tokens":0}}"#,
        );
        assert_eq!(outcome_of(&r), Outcome::Empty);
        // A chat answer with text.
        let r = json(
            200,
            r#"{"id":"x","choices":[{"message":{"role":"assistant","content":"ok"},"finish_reason":null}]}"#,
        );
        assert_eq!(outcome_of(&r), Outcome::Ok);
    }

    #[test]
    fn an_error_in_a_stream_is_a_server_error_unless_it_is_about_the_context() {
        let oom = sse(&[r#"{"error":{"message":"CUDA out of memory","code":500}}"#]);
        assert_eq!(outcome_of(&oom), Outcome::ServerError);
        assert_eq!(parse(&oom).error.as_deref(), Some("CUDA out of memory"));
        for text in [
            "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens",
            "Requested tokens (10331) exceed context window of 8192",
            "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
            "`inputs` must have less than 1024 tokens. Given: 1300",
            // transformers serve 5.x (its 400 detail, as it said here).
            "The prompt has 1049 tokens, but the model takes at most 1024, prompt and answer (`--max-model-len`).",
            "Input length of input_ids is 5000, but `max_length` is set to 4096. This can lead to unexpected behavior. The prompt exceeds the maximum",
        ] {
            let body = serde_json::json!({"error": {"message": text}}).to_string();
            assert_eq!(outcome_of(&sse(&[&body])), Outcome::Rejected, "{text}");
        }
        // An error after tokens were generated does not undo them.
        let r = sse(&[
            r#"{"choices":[{"text":"a"}]}"#,
            r#"{"error":{"message":"x"}}"#,
        ]);
        assert_eq!(outcome_of(&r), Outcome::Ok);
    }

    #[test]
    fn fastapi_errors_read_like_openai_ones() {
        let r = json(400, r#"{"detail":"Prompt is too long: 5000 > 4096"}"#);
        assert_eq!(
            (outcome_of(&r), parse(&r).error.as_deref()),
            (Outcome::Rejected, Some("Prompt is too long: 5000 > 4096"))
        );
        let r = json(
            422,
            r#"{"detail":[{"type":"extra_forbidden","loc":["body","ignore_eos"],"msg":"Extra inputs are not permitted","input":true}]}"#,
        );
        let p = parse(&r);
        assert_eq!(
            p.error.as_deref(),
            Some("body.ignore_eos: Extra inputs are not permitted")
        );
        assert!(rejects_optional_fields(422, p.error.as_deref()));
        assert!(!rejects_optional_fields(
            400,
            Some("context 5000 > --max-context 4096")
        ));
        assert!(!rejects_optional_fields(500, Some("ignore_eos")));
        assert_eq!(
            parse(&json(404, r#"{"object":"error","message":"no model"}"#))
                .error
                .as_deref(),
            Some("no model")
        );
        assert_eq!(outcome_of(&json(429, "{}")), Outcome::Refused);
        assert_eq!(outcome_of(&json(500, "{}")), Outcome::ServerError);
    }

    #[test]
    fn a_refusal_for_length_gives_the_servers_count_of_the_prompt() {
        let texts = [
            ("Requested tokens (10331) exceed context window of 8192", 10331),
            ("The prompt has 2069 tokens, but the model takes at most 2048", 2069),
            ("This model's maximum context length is 2048 tokens. However, your request has 2092 input tokens. Please reduce the length of the input messages.", 2092),
            ("The input (2100 tokens) is longer than the model's context length (2048 tokens).", 2100),
            ("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 2048. Given: 2092 `inputs` tokens and 8 `max_new_tokens`", 2092),
            ("This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2092 in the messages, 8 in the completion).", 2092),
        ];
        for (text, n) in texts {
            assert!(is_context_refusal(text), "{text}");
            assert_eq!(refused_prompt_tokens(None, text), Some(n), "{text}");
        }
        // llama.cpp's server says it in its error object.
        let v: Value = serde_json::from_str(
            r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":10331,"n_ctx":8192}}"#,
        )
        .unwrap();
        assert_eq!(
            refused_prompt_tokens(Some(&v), "the request exceeds the available context size"),
            Some(10331)
        );
        assert_eq!(
            refused_prompt_tokens(None, "the request exceeds the available context size"),
            None
        );
        // Through a whole answer: a 400 for length carries the count; another 400 does not.
        let r = json(
            400,
            r#"{"detail":"The prompt has 2069 tokens, but the model takes at most 2048"}"#,
        );
        assert_eq!(parse(&r).prompt_tokens, Some(2069));
        let r = json(
            400,
            r#"{"detail":"model 'x' has 12 tokens of nothing: not found"}"#,
        );
        assert_eq!(parse(&r).prompt_tokens, None);
    }
}
