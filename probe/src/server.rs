//! What the probe learns about the server before its suites: the models it
//! lists and its context limit (`/v1/models`), whether it counts tokens for
//! us (`/tokenize`: vLLM, SGLang, llama.cpp), and where its load can be
//! read (see [`crate::metrics`]). Parsing is pure; the `fetch_*` functions
//! do the requests.

use std::time::Duration;

use serde_json::{json, Value};

use crate::http::{request, Endpoint};
use crate::load::Api;
use crate::metrics;

/// Discovery requests (models, tokenizer, metrics) wait at most this long:
/// a server that takes longer to list its models is answered by the smoke
/// request's own timeout.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// What the probe knows about the server.
#[derive(Clone, Debug)]
pub struct Server {
    pub api: Api,
    /// It streams, so each request's first token is timed.
    pub stream: bool,
    /// `/tokenize` answers with a count.
    pub tokenizer: bool,
    /// Tokens the server adds around a prompt (a chat template), learned
    /// from the smoke request's usage against the tokenizer's count.
    pub overhead_tokens: u64,
    pub load: Option<metrics::Source>,
    /// The server's context limit, where it says.
    pub max_model_len: Option<u64>,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            api: Api::Completions,
            stream: false,
            tokenizer: false,
            overhead_tokens: 0,
            load: None,
            max_model_len: None,
        }
    }
}

/// The model ids `/v1/models` lists, and the context limit it gives
/// (vLLM's and SGLang's `max_model_len`; the smallest where several differ).
pub fn models(v: &Value) -> (Vec<String>, Option<u64>) {
    let data = v["data"].as_array().cloned().unwrap_or_default();
    let ids = data
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect();
    let len = data
        .iter()
        .filter_map(|m| {
            m["max_model_len"]
                .as_u64()
                .or_else(|| m["context_length"].as_u64())
        })
        .min();
    (ids, len)
}

/// A `/tokenize` answer: the count (vLLM's and SGLang's `count`, else the
/// length of `tokens` as llama.cpp answers) and any `max_model_len` in it.
pub fn tokenized(v: &Value) -> Option<(u64, Option<u64>)> {
    let count = v["count"]
        .as_u64()
        .or_else(|| v["tokens"].as_array().map(|t| t.len() as u64))?;
    Some((count, v["max_model_len"].as_u64()))
}

/// The body `/tokenize` takes on each runtime at once: vLLM and SGLang read
/// `prompt` (and `model`), llama.cpp reads `content`.
pub fn tokenize_body(model: Option<&str>, text: &str) -> Value {
    let mut b = json!({"prompt": text, "content": text});
    if let Some(m) = model {
        b["model"] = json!(m);
    }
    b
}

/// The server's count of `text`, with its `max_model_len` when it gives one.
pub fn fetch_tokens(
    ep: &Endpoint,
    model: Option<&str>,
    text: &str,
    timeout: Duration,
) -> Option<(u64, Option<u64>)> {
    let r = request(
        &ep.root(),
        "POST",
        "/tokenize",
        Some(&tokenize_body(model, text)),
        &[],
        timeout,
    )
    .ok()?;
    if r.status != 200 {
        return None;
    }
    tokenized(&r.json().ok()?)
}

/// Why the server refused a request for want of credentials (HTTP 401
/// or 403), and how to give them; None for any other answer. `key_given`:
/// whether a key was sent, so the advice is to give one or to check it.
pub fn auth_refused(status: Option<u16>, key_given: bool) -> Option<String> {
    let what = match status? {
        401 => "unauthorized (HTTP 401)",
        403 => "forbidden (HTTP 403)",
        _ => return None,
    };
    Some(match key_given {
        false => format!(
            "the server refused the request as {what}: it wants an API key. Give it with --api-key KEY or the OOMSCOPE_API_KEY variable (sent as `Authorization: Bearer KEY`)"
        ),
        true => format!(
            "the server refused the API key given as {what}: check the key in --api-key or OOMSCOPE_API_KEY, and that it may use this endpoint and model"
        ),
    })
}

/// An answer that says the API is not served here (so `--api auto` tries the
/// other one): no such route, or a server that says it only does chat.
pub fn api_missing(status: Option<u16>, error: Option<&str>) -> bool {
    match status {
        Some(404 | 405 | 501) => true,
        Some(400 | 422) => error.is_some_and(|e| {
            let e = e.to_ascii_lowercase();
            e.contains("chat") || e.contains("not supported") || e.contains("does not support")
        }),
        _ => false,
    }
}

/// An answer that refuses the streaming fields (the request is retried without them).
pub fn stream_refused(status: Option<u16>) -> bool {
    matches!(status, Some(400 | 422))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_and_their_limit() {
        let v = json!({"data": [{"id": "m", "max_model_len": 4096}, {"id": "n", "max_model_len": 8192}]});
        assert_eq!(
            models(&v),
            (vec!["m".to_string(), "n".to_string()], Some(4096))
        );
        assert_eq!(models(&json!({"data": [{"id": "x"}]})).1, None);
    }

    #[test]
    fn tokenize_answers_of_each_runtime() {
        assert_eq!(
            tokenized(&json!({"count": 7, "max_model_len": 2048, "tokens": [1,2,3,4,5,6,7]})),
            Some((7, Some(2048)))
        );
        assert_eq!(tokenized(&json!({"tokens": [1, 2, 3]})), Some((3, None)));
        assert_eq!(tokenized(&json!({"error": "no"})), None);
        let b = tokenize_body(Some("m"), "a b");
        assert_eq!(
            (
                b["prompt"].as_str(),
                b["content"].as_str(),
                b["model"].as_str()
            ),
            (Some("a b"), Some("a b"), Some("m"))
        );
    }

    #[test]
    fn which_answers_mean_the_api_is_missing() {
        assert!(api_missing(Some(404), None));
        assert!(api_missing(
            Some(400),
            Some("This model only supports chat completions")
        ));
        assert!(!api_missing(Some(400), Some("context too long")));
        assert!(!api_missing(Some(500), None));
        assert!(!api_missing(None, None));
    }
}
