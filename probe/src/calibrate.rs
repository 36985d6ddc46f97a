//! Tokens always counted. Before any suite the probe learns how the server
//! counts a prompt, trying in this order and recording which one worked:
//! a tokenize endpoint (the paths and bodies of vLLM, SGLang, llama.cpp's
//! server and its Python bindings, TGI), a non-streamed answer's
//! `usage.prompt_tokens`, a stream's usage (`stream_options.include_usage`),
//! then `echo` with `logprobs`. Where none answers, every context figure is
//! the server's own refusals bisected in words and is labelled estimated.
//! Streaming is then chosen once, by one rule, so that two runs of one
//! server measure alike. Parsing is pure; the `Probe` methods do requests.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::{request, Endpoint};
use crate::load::{complete, Api, Outcome};
use crate::Probe;

/// How the probe counted tokens (the report's `server.token_count`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Method {
    /// The server's tokenize endpoint.
    Tokenize,
    /// `usage.prompt_tokens` of a non-streamed answer.
    Usage,
    /// The usage chunk of a stream (`stream_options.include_usage`).
    StreamUsage,
    /// The prompt's tokens echoed back with their logprobs.
    EchoLogprobs,
    /// Nothing counted: figures in tokens are estimates from words.
    #[default]
    None,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Tokenize => "tokenize",
            Method::Usage => "usage",
            Method::StreamUsage => "stream_usage",
            Method::EchoLogprobs => "echo_logprobs",
            Method::None => "none",
        }
    }

    /// What the figures' evidence says about their tokens.
    pub fn described(self, path: Option<&str>) -> String {
        match self {
            Method::Tokenize => format!(
                "tokens as the server's {} counted them",
                path.unwrap_or("/tokenize")
            ),
            Method::Usage => "tokens as the server counted them (usage.prompt_tokens)".into(),
            Method::StreamUsage => {
                "tokens as the server counted them (usage in its streams)".into()
            }
            Method::EchoLogprobs => {
                "tokens as the server echoed them (echo with logprobs)".into()
            }
            Method::None => "tokens estimated from words: the server counts tokens nowhere the probe can read (no tokenize endpoint, no usage, no echo)".into(),
        }
    }
}

/// The body a tokenize endpoint reads its text from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// vLLM, SGLang: `{"prompt", "model"}`.
    Prompt,
    /// llama.cpp's server: `{"content"}`.
    Content,
    /// TGI: `{"inputs"}`.
    Inputs,
    /// llama-cpp-python: `{"input", "model"}`.
    Input,
}

/// Where a server tokenizes: a path at the server's root or below the API
/// prefix, and its body's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub path: &'static str,
    /// Below the endpoint's prefix (`/v1/tokenize`), else at the root.
    pub prefixed: bool,
    pub shape: Shape,
}

/// The known tokenize endpoints, most common first.
pub const ROUTES: [Route; 5] = [
    Route {
        path: "/tokenize",
        prefixed: false,
        shape: Shape::Prompt,
    },
    Route {
        path: "/tokenize",
        prefixed: false,
        shape: Shape::Content,
    },
    Route {
        path: "/tokenize",
        prefixed: false,
        shape: Shape::Inputs,
    },
    Route {
        path: "/tokenize",
        prefixed: true,
        shape: Shape::Prompt,
    },
    Route {
        path: "/extras/tokenize",
        prefixed: false,
        shape: Shape::Input,
    },
];

impl Route {
    /// The path as shown (`/v1/tokenize` for a prefixed one).
    pub fn shown(&self, ep: &Endpoint) -> String {
        if self.prefixed {
            format!("{}{}", ep.prefix, self.path)
        } else {
            self.path.to_string()
        }
    }
}

/// The request body of `route` for `text`.
pub fn body(shape: Shape, model: Option<&str>, text: &str) -> Value {
    let mut b = match shape {
        Shape::Prompt => json!({"prompt": text}),
        Shape::Content => json!({"content": text}),
        Shape::Inputs => json!({"inputs": text}),
        Shape::Input => json!({"input": text}),
    };
    if let (Some(m), Shape::Prompt | Shape::Input) = (model, shape) {
        b["model"] = json!(m);
    }
    b
}

/// A tokenize answer's count (`count`, else the length of `tokens`, else of
/// TGI's top-level list) and any `max_model_len` in it.
pub fn tokenized(v: &Value) -> Option<(u64, Option<u64>)> {
    let count = v["count"]
        .as_u64()
        .or_else(|| v["tokens"].as_array().map(|t| t.len() as u64))
        .or_else(|| v.as_array().map(|t| t.len() as u64))
        .filter(|&n| n > 0)?;
    Some((count, v["max_model_len"].as_u64()))
}

/// The prompt tokens an `echo` + `logprobs` completion gave back: the echoed
/// tokens less the `generated` ones.
pub fn echoed(v: &Value, generated: u64) -> Option<u64> {
    let n = v["choices"][0]["logprobs"]["tokens"].as_array()?.len() as u64;
    n.checked_sub(generated).filter(|&n| n > 0)
}

/// Which way `--stream` goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamChoice {
    /// Streamed where the server streams and its tokens are counted without
    /// a non-streamed answer (a tokenize endpoint, usage in its streams).
    #[default]
    Auto,
    /// Wherever the server streams, its tokens counted or not.
    On,
    Off,
}

impl std::str::FromStr for StreamChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(StreamChoice::Auto),
            "on" => Ok(StreamChoice::On),
            "off" => Ok(StreamChoice::Off),
            _ => Err(format!("--stream takes auto, on or off, not `{s}`")),
        }
    }
}

/// Whether a run streams: `auto` streams where the server streams and each
/// request's tokens are counted without a non-streamed answer (`counted`: a
/// tokenize endpoint, or usage in its streams); the same server gets the
/// same answer every run.
pub fn choose_stream(choice: StreamChoice, streams: bool, counted: bool) -> bool {
    match choice {
        // A server that refused or ignored the stream is not asked for one again.
        StreamChoice::On => streams,
        StreamChoice::Off => false,
        StreamChoice::Auto => streams && counted,
    }
}

/// Prompt sizes in words of the calibration requests: two, so that a chat
/// template's fixed overhead is told from the rate per word.
const SIZES: [usize; 2] = [16, 64];

impl Probe {
    /// The server's count of `text` on its tokenize route, with its
    /// `max_model_len` when it gives one.
    pub(crate) fn count_tokens(&self, text: &str, timeout: Duration) -> Option<(u64, Option<u64>)> {
        let route = self.server.tokenize?;
        fetch(&self.ep, route, self.cfg.model.as_deref(), text, timeout)
    }

    /// The first tokenize route that counts `text`.
    fn find_route(&self, text: &str, timeout: Duration) -> Option<(Route, Option<u64>)> {
        let mut missing: Vec<(&str, bool)> = Vec::new();
        for r in ROUTES {
            if missing.contains(&(r.path, r.prefixed)) {
                continue;
            }
            let ep = if r.prefixed {
                self.ep.clone()
            } else {
                self.ep.root()
            };
            let b = body(r.shape, self.cfg.model.as_deref(), text);
            match request(&ep, "POST", r.path, Some(&b), &[], timeout) {
                Ok(resp) if resp.status == 200 => {
                    if let Some((_, len)) = resp.json().ok().as_ref().and_then(tokenized) {
                        return Some((r, len));
                    }
                }
                // No such path: its other shapes are not tried.
                Ok(resp) if matches!(resp.status, 404 | 405 | 501) => {
                    missing.push((r.path, r.prefixed))
                }
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    }

    /// Calibrates before any suite (see the module's doc) and records how:
    /// `streams` says whether the smoke's stream carried tokens, `smoke` is
    /// its prompt and the tokens the server counted for it, if it did. Sets
    /// the run's streaming once.
    pub(crate) fn calibrate(
        &mut self,
        streams: bool,
        smoke: Option<(&str, u64)>,
        timeout: Duration,
    ) -> Method {
        let method = self.count_somehow(streams, smoke, timeout);
        self.server.token_count = method;
        // The smoke's answer was the stream, when the server streams.
        let stream_usage = streams && smoke.is_some();
        self.server.stream = choose_stream(
            self.cfg.stream,
            streams,
            method == Method::Tokenize || stream_usage,
        );
        method
    }

    fn count_somehow(
        &mut self,
        streams: bool,
        smoke: Option<(&str, u64)>,
        timeout: Duration,
    ) -> Method {
        let sample = self.sample(SIZES[0]);
        if let Some((route, len)) = self.find_route(&sample, timeout) {
            self.server.tokenize = Some(route);
            self.server.tokenizer = true;
            if let Some(len) = len {
                self.server.max_model_len.get_or_insert(len);
            }
            // What the server adds around a prompt (a chat template): its
            // usage of the smoke's prompt against the tokenizer's count.
            if let Some((prompt, used)) = smoke {
                if let Some((n, _)) = self.count_tokens(prompt, timeout) {
                    self.server.overhead_tokens = used.saturating_sub(n);
                }
            }
            for words in SIZES {
                let text = self.sample(words);
                if let Some((n, _)) = self.count_tokens(&text, timeout) {
                    self.cal.observe(words, n + self.server.overhead_tokens);
                }
            }
            return Method::Tokenize;
        }
        let mut tried = vec![Method::Usage];
        if streams {
            tried.push(Method::StreamUsage);
        }
        if self.server.api == Api::Completions {
            tried.push(Method::EchoLogprobs);
        }
        for method in tried {
            let mut counted = 0;
            for words in SIZES {
                if let Some(n) = self.count_by(method, words, timeout) {
                    self.cal.observe(words, n);
                    counted += 1;
                }
            }
            if counted > 0 {
                return method;
            }
        }
        Method::None
    }

    /// The tokens the server counts for a prompt of `words` words, by
    /// `method`: a request of one output token (or a tokenized sample).
    fn count_by(&mut self, method: Method, words: usize, timeout: Duration) -> Option<u64> {
        let ask = self.ask(words, 1, timeout);
        match method {
            Method::Tokenize => self
                .count_tokens(&ask.prompt, timeout)
                .map(|(n, _)| n + self.server.overhead_tokens),
            Method::Usage | Method::StreamUsage => {
                let ask = crate::load::Ask {
                    stream: method == Method::StreamUsage,
                    ..ask
                };
                let call = complete(&self.ep, &ask, Instant::now());
                call.prompt_tokens.filter(|_| call.outcome == Outcome::Ok)
            }
            Method::EchoLogprobs => {
                let mut b = crate::load::body(&ask);
                b["echo"] = json!(true);
                b["logprobs"] = json!(1);
                let path = Api::Completions.path();
                let resp = request(&self.ep, "POST", path, Some(&b), &[], timeout).ok()?;
                (resp.status == 200)
                    .then(|| resp.json().ok())
                    .flatten()
                    .and_then(|v| echoed(&v, 1))
            }
            Method::None => None,
        }
    }

    /// Re-checks the calibration at the largest size the run reached (its
    /// answers there carried no count, e.g. streams without usage): the
    /// server's count of a prompt of `words` words, by the run's method,
    /// taken into the fit.
    pub(crate) fn recheck(&mut self, words: usize, timeout: Duration) -> Option<u64> {
        let n = self.count_by(self.server.token_count, words, timeout)?;
        self.cal.observe(words, n);
        Some(n)
    }
}

/// `text` counted on `route`.
fn fetch(
    ep: &Endpoint,
    route: Route,
    model: Option<&str>,
    text: &str,
    timeout: Duration,
) -> Option<(u64, Option<u64>)> {
    let ep = if route.prefixed {
        ep.clone()
    } else {
        ep.root()
    };
    let r = request(
        &ep,
        "POST",
        route.path,
        Some(&body(route.shape, model, text)),
        &[],
        timeout,
    )
    .ok()?;
    if r.status != 200 {
        return None;
    }
    tokenized(&r.json().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_answers_of_each_runtime() {
        // vLLM, SGLang.
        assert_eq!(
            tokenized(&json!({"count": 7, "max_model_len": 2048, "tokens": [1,2,3,4,5,6,7]})),
            Some((7, Some(2048)))
        );
        // llama.cpp, llama-cpp-python.
        assert_eq!(tokenized(&json!({"tokens": [1, 2, 3]})), Some((3, None)));
        // TGI: a list of tokens.
        assert_eq!(
            tokenized(
                &json!([{"id": 1, "text": "a", "start": 0, "stop": 1}, {"id": 2, "text": " b", "start": 1, "stop": 3}])
            ),
            Some((2, None))
        );
        assert_eq!(tokenized(&json!({"error": "no"})), None);
        assert_eq!(tokenized(&json!({"tokens": []})), None);
        assert_eq!(
            body(Shape::Content, Some("m"), "a b"),
            json!({"content": "a b"})
        );
        assert_eq!(
            body(Shape::Prompt, Some("m"), "a b"),
            json!({"prompt": "a b", "model": "m"})
        );
        assert_eq!(body(Shape::Inputs, None, "a"), json!({"inputs": "a"}));
        assert_eq!(body(Shape::Input, None, "a"), json!({"input": "a"}));
    }

    #[test]
    fn echoed_prompts_count_their_tokens() {
        let v = json!({"choices": [{"text": "a b c", "logprobs": {"tokens": ["a", " b", " c", " x"], "token_logprobs": [null, -1.0, -1.0, -0.5]}}]});
        assert_eq!(echoed(&v, 1), Some(3));
        assert_eq!(echoed(&json!({"choices": [{"text": "x"}]}), 1), None);
    }

    #[test]
    fn streaming_is_chosen_by_one_rule() {
        use StreamChoice::*;
        assert!(choose_stream(Auto, true, true));
        // Counts only from non-streamed answers: JSON, so every answer counts.
        assert!(!choose_stream(Auto, true, false));
        assert!(!choose_stream(Auto, false, true));
        assert!(choose_stream(On, true, false));
        assert!(
            !choose_stream(On, false, true),
            "a server that does not stream"
        );
        assert!(!choose_stream(Off, true, true));
        assert_eq!("on".parse::<StreamChoice>(), Ok(On));
        assert!("yes".parse::<StreamChoice>().is_err());
    }
}
