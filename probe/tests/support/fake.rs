//! A small OpenAI-compatible server for the probe's tests, on a loopback
//! port: completions and/or chat, an optional API key, optional TLS (a
//! certificate made at test time), optional `/tokenize`, a vLLM-style
//! `/metrics`, streaming, and a scheduler that serves `slots` requests at a
//! time (the rest wait). It records every request, so a test can check what
//! the probe sent. It stops when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How the fake behaves.
#[derive(Clone, Debug)]
pub struct Spec {
    pub completions: bool,
    pub chat: bool,
    pub api_key: Option<String>,
    /// What a request without that key gets: 401, or 403 as some gateways answer.
    pub key_refusal: u16,
    pub tls: bool,
    /// Tokens per prompt word, as its tokenizer and usage count them.
    pub tokens_per_word: usize,
    /// Tokens a chat template adds.
    pub chat_overhead: usize,
    pub tokenize: bool,
    /// Prompts + max_tokens above this get 400; /v1/models and /tokenize
    /// say it unless `hide_limit`.
    pub max_model_len: Option<usize>,
    pub hide_limit: bool,
    /// Requests served at once; the rest wait.
    pub slots: usize,
    /// Time to serve one request.
    pub service: Duration,
    /// Expose vLLM-style /metrics; with `kv_full`, the KV pool reads full.
    pub metrics: bool,
    pub kv_full: bool,
    /// Answer `stream: true` with server-sent events.
    pub stream: bool,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            completions: true,
            chat: true,
            api_key: None,
            key_refusal: 401,
            tls: false,
            tokens_per_word: 1,
            chat_overhead: 0,
            tokenize: false,
            max_model_len: None,
            hide_limit: false,
            slots: 64,
            service: Duration::from_millis(20),
            metrics: false,
            kv_full: false,
            stream: false,
        }
    }
}

/// One request as the fake saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: serde_json::Value,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// The prompt of a completion or chat request.
    pub fn prompt(&self) -> Option<String> {
        self.body["prompt"]
            .as_str()
            .or_else(|| self.body["messages"][0]["content"].as_str())
            .map(str::to_string)
    }
}

struct State {
    spec: Spec,
    seen: Mutex<Vec<Seen>>,
    running: Mutex<usize>,
    freed: Condvar,
    waiting: AtomicUsize,
    preemptions: AtomicUsize,
}

pub struct Fake {
    pub port: u16,
    /// PEM of the certificate (TLS only), for `--ca-cert`.
    pub ca_pem: Option<String>,
    state: Arc<State>,
    stop: Arc<AtomicBool>,
}

trait Conn: Read + Write + Send {}
impl<T: Read + Write + Send> Conn for T {}

impl Fake {
    pub fn start(spec: Spec) -> Fake {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let (tls, ca_pem) = if spec.tls {
            let ck = rcgen::generate_simple_self_signed(vec![
                "localhost".to_string(),
                "127.0.0.1".to_string(),
            ])
            .unwrap();
            let pem = ck.cert.pem();
            let key = rustls::pki_types::PrivateKeyDer::Pkcs8(
                rustls::pki_types::PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()),
            );
            let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
            (Some(Arc::new(cfg)), Some(pem))
        } else {
            (None, None)
        };
        let state = Arc::new(State {
            spec,
            seen: Mutex::new(Vec::new()),
            running: Mutex::new(0),
            freed: Condvar::new(),
            waiting: AtomicUsize::new(0),
            preemptions: AtomicUsize::new(0),
        });
        let stop = Arc::new(AtomicBool::new(false));
        {
            let state = state.clone();
            let stop = stop.clone();
            l.set_nonblocking(true).unwrap();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((s, _)) => {
                            s.set_nonblocking(false).unwrap();
                            let state = state.clone();
                            let tls = tls.clone();
                            std::thread::spawn(move || {
                                let conn: Box<dyn Conn> = match tls {
                                    Some(cfg) => {
                                        let c = rustls::ServerConnection::new(cfg).unwrap();
                                        Box::new(rustls::StreamOwned::new(c, s))
                                    }
                                    None => Box::new(s),
                                };
                                let _ = serve(&state, conn);
                            });
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            });
        }
        Fake {
            port,
            ca_pem,
            state,
            stop,
        }
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.state.spec.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}/v1", self.port)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    /// The prompts of every completion or chat request, in order.
    pub fn prompts(&self) -> Vec<String> {
        self.seen()
            .iter()
            .filter(|s| s.path.ends_with("completions"))
            .filter_map(Seen::prompt)
            .collect()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn read_request(r: &mut BufReader<Box<dyn Conn>>) -> Option<Seen> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let len = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).ok()?;
    Some(Seen {
        method,
        path,
        headers,
        body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    })
}

fn reply(w: &mut dyn Write, status: u16, content_type: &str, body: &[u8]) -> std::io::Result<()> {
    write!(
        w,
        "HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    w.write_all(body)?;
    w.flush()
}

fn json(w: &mut dyn Write, status: u16, v: serde_json::Value) -> std::io::Result<()> {
    reply(w, status, "application/json", v.to_string().as_bytes())
}

fn serve(state: &State, conn: Box<dyn Conn>) -> std::io::Result<()> {
    let mut r = BufReader::new(conn);
    let Some(req) = read_request(&mut r) else {
        return Ok(());
    };
    state.seen.lock().unwrap().push(req.clone());
    let spec = &state.spec;
    let w: &mut dyn Write = r.get_mut();
    if let Some(k) = &spec.api_key {
        if req.header("authorization") != Some(&format!("Bearer {k}")) {
            return json(
                w,
                spec.key_refusal,
                serde_json::json!({"error": {"message": "bad or missing API key"}}),
            );
        }
    }
    let words = |text: &str| text.split_whitespace().count();
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/v1/models") => {
            let mut m = serde_json::json!({"id": "fake", "object": "model"});
            if let Some(l) = spec.max_model_len.filter(|_| !spec.hide_limit) {
                m["max_model_len"] = serde_json::json!(l);
            }
            json(w, 200, serde_json::json!({"object": "list", "data": [m]}))
        }
        ("POST", "/tokenize") if spec.tokenize => {
            let text = req.body["prompt"].as_str().unwrap_or("");
            let n = words(text) * spec.tokens_per_word;
            json(
                w,
                200,
                serde_json::json!({"count": n, "tokens": vec![1; n], "max_model_len": spec.max_model_len.filter(|_| !spec.hide_limit)}),
            )
        }
        ("GET", "/metrics") if spec.metrics => {
            let running = *state.running.lock().unwrap();
            let waiting = state.waiting.load(Ordering::Relaxed);
            let kv = if spec.kv_full && running > 0 {
                0.99
            } else {
                running as f64 / spec.slots.max(1) as f64 * 0.5
            };
            let text = format!(
                "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"fake\"}} {running}\nvllm:num_requests_waiting{{model_name=\"fake\"}} {waiting}\nvllm:kv_cache_usage_perc{{model_name=\"fake\"}} {kv}\nvllm:num_preemptions_total{{model_name=\"fake\"}} {}\n",
                state.preemptions.load(Ordering::Relaxed)
            );
            reply(w, 200, "text/plain; version=0.0.4", text.as_bytes())
        }
        ("POST", "/v1/completions") | ("POST", "/v1/chat/completions") => {
            let chat = req.path.ends_with("chat/completions");
            if (chat && !spec.chat) || (!chat && !spec.completions) {
                return json(w, 404, serde_json::json!({"detail": "Not Found"}));
            }
            let prompt = req.prompt().unwrap_or_default();
            let prompt_tokens =
                words(&prompt) * spec.tokens_per_word + if chat { spec.chat_overhead } else { 0 };
            let max_tokens = req.body["max_tokens"].as_u64().unwrap_or(16) as usize;
            if spec
                .max_model_len
                .is_some_and(|l| prompt_tokens + max_tokens > l)
            {
                return json(
                    w,
                    400,
                    serde_json::json!({"error": {"message": format!("This model's maximum context length is {} tokens", spec.max_model_len.unwrap())}}),
                );
            }
            // Wait for a slot.
            {
                state.waiting.fetch_add(1, Ordering::Relaxed);
                let mut running = state.running.lock().unwrap();
                while *running >= spec.slots {
                    running = state.freed.wait(running).unwrap();
                }
                *running += 1;
                state.waiting.fetch_sub(1, Ordering::Relaxed);
            }
            let release = || {
                *state.running.lock().unwrap() -= 1;
                state.freed.notify_one();
            };
            let usage = serde_json::json!({"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens});
            let id = format!("cmpl-{}", req.body.to_string().len());
            if spec.stream && req.body["stream"] == true {
                // First token after a fifth of the service time, then the rest.
                std::thread::sleep(spec.service / 5);
                let mut out = Vec::new();
                let piece = |t: &str| {
                    if chat {
                        serde_json::json!({"id": id, "choices": [{"index": 0, "delta": {"content": t}}]})
                    } else {
                        serde_json::json!({"id": id, "choices": [{"index": 0, "text": t}]})
                    }
                };
                write!(w, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")?;
                write!(w, "data: {}\n\n", piece(" a"))?;
                w.flush()?;
                std::thread::sleep(spec.service * 4 / 5);
                write!(out, "data: {}\n\n", piece(" b"))?;
                write!(
                    out,
                    "data: {}\n\n",
                    serde_json::json!({"id": id, "choices": [], "usage": usage})
                )?;
                write!(out, "data: [DONE]\n\n")?;
                release();
                w.write_all(&out)?;
                return w.flush();
            }
            std::thread::sleep(spec.service);
            release();
            let choice = if chat {
                serde_json::json!({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"})
            } else {
                serde_json::json!({"index": 0, "text": "ok", "finish_reason": "length"})
            };
            json(
                w,
                200,
                serde_json::json!({"id": id, "choices": [choice], "usage": usage}),
            )
        }
        _ => json(w, 404, serde_json::json!({"detail": "Not Found"})),
    }
}
