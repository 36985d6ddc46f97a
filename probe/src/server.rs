//! What the probe learns about the server before its suites: the models it
//! lists and its context limit (`/v1/models`), whether it counts tokens for
//! us (`/tokenize`: vLLM, SGLang, llama.cpp), and where its load can be
//! read (see [`crate::metrics`]). Parsing is pure; the `fetch_*` functions
//! do the requests.

use std::time::Duration;

use serde_json::Value;

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
    /// A tokenize endpoint answers with a count.
    pub tokenizer: bool,
    /// Where (see [`crate::calibrate`]).
    pub tokenize: Option<crate::calibrate::Route>,
    /// How the run counts tokens.
    pub token_count: crate::calibrate::Method,
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
            tokenize: None,
            token_count: crate::calibrate::Method::None,
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
    use serde_json::json;

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
