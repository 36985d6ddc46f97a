//! The probe's HTTP, over ureq (a maintained blocking client): http and
//! https (rustls, the webpki roots or `--ca-cert`), every resolved address
//! tried in turn (IPv6 too), one deadline on the whole exchange (connect,
//! send, and the body however slowly it trickles), JSON in and out, and
//! server-sent events read as they arrive (for the time to first token).
//! Talks only to the one endpoint the user named: no redirects are followed,
//! so the API key never leaves that origin.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// Responses larger than this are cut off: a completion is a few KiB.
const MAX_BODY_BYTES: u64 = 16 << 20;

/// How a request failed without an HTTP answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The deadline passed (connect, send or the body).
    Timeout,
    /// Nothing listens: every address refused the connection.
    Refused,
    /// The connection was reset or closed before a whole answer: the server
    /// (or its process) went away mid-request.
    Dropped,
    /// Anything else: name resolution, TLS, a malformed answer.
    Other,
}

/// A request that got no HTTP answer, with why.
#[derive(Clone, Debug)]
pub struct HttpError {
    pub kind: Failure,
    pub text: String,
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::error::Error for HttpError {}

impl HttpError {
    fn from_ureq(e: ureq::Error, url: &str) -> HttpError {
        use std::io::ErrorKind as K;
        let kind = match &e {
            ureq::Error::Timeout(_) => Failure::Timeout,
            ureq::Error::Io(io) => match io.kind() {
                K::ConnectionRefused => Failure::Refused,
                K::TimedOut | K::WouldBlock => Failure::Timeout,
                K::ConnectionReset
                | K::ConnectionAborted
                | K::BrokenPipe
                | K::UnexpectedEof
                | K::NotConnected => Failure::Dropped,
                _ => Failure::Other,
            },
            ureq::Error::ConnectionFailed => Failure::Refused,
            ureq::Error::Protocol(_) => Failure::Dropped,
            _ => Failure::Other,
        };
        let what = match kind {
            Failure::Timeout => "timed out",
            Failure::Refused => "connection refused",
            Failure::Dropped => "connection dropped",
            Failure::Other => "request failed",
        };
        HttpError {
            kind,
            text: format!("{url}: {what}: {e}"),
        }
    }
}

/// Where requests go, and how: `http[s]://host[:port]/prefix`, with the API
/// key (sent to this endpoint only) and the TLS roots.
#[derive(Clone)]
pub struct Endpoint {
    /// "http" or "https".
    pub scheme: String,
    /// The host without IPv6 brackets.
    pub host: String,
    pub port: u16,
    /// The path prefix, e.g. "/v1" (no trailing slash).
    pub prefix: String,
    api_key: Option<String>,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        write!(
            f,
            "Endpoint({}{}, key: {})",
            self.base(),
            self.prefix,
            if self.api_key.is_some() {
                "set"
            } else {
                "none"
            }
        )
    }
}

/// The client: answers of every status are answers (not errors), no
/// redirects (the key stays with the endpoint), and no idle connections
/// kept, so a restarted server is never reached over a dead pooled socket.
fn agent(roots: Option<ureq::tls::RootCerts>) -> ureq::Agent {
    let mut tls = ureq::tls::TlsConfig::builder();
    if let Some(r) = roots {
        tls = tls.root_certs(r);
    }
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .max_idle_connections(0)
        .max_idle_connections_per_host(0)
        .user_agent(concat!("oomscope-probe/", env!("CARGO_PKG_VERSION")))
        .tls_config(tls.build())
        .build()
        .new_agent()
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint> {
        let (scheme, rest) = if let Some(r) = url.strip_prefix("http://") {
            ("http", r)
        } else if let Some(r) = url.strip_prefix("https://") {
            ("https", r)
        } else {
            bail!("`{url}`: the endpoint is an http:// or https:// URL (e.g. http://127.0.0.1:8000/v1)");
        };
        let (hostport, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let default_port = if scheme == "https" { 443 } else { 80 };
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            // [::1]:8000 or [::1]
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| anyhow!("`{url}`: an IPv6 host needs its closing `]`"))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p
                    .parse::<u16>()
                    .with_context(|| format!("`{url}`: bad port `{p}`"))?,
                None if after.is_empty() => default_port,
                None => bail!("`{url}`: unexpected `{after}` after the host"),
            };
            (h, port)
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (
                    h,
                    p.parse::<u16>()
                        .with_context(|| format!("`{url}`: bad port `{p}`"))?,
                ),
                None => (hostport, default_port),
            }
        };
        if host.is_empty() {
            bail!("`{url}`: no host");
        }
        Ok(Endpoint {
            scheme: scheme.into(),
            host: host.to_string(),
            port,
            prefix: path.trim_end_matches('/').to_string(),
            api_key: None,
            agent: agent(None),
        })
    }

    /// Sends `Authorization: Bearer KEY` with every request to this endpoint
    /// (and nowhere else). An empty key is no key.
    pub fn with_api_key(mut self, key: Option<String>) -> Endpoint {
        self.api_key = key.filter(|k| !k.trim().is_empty());
        self
    }

    /// Trusts the certificates in this PEM file instead of the built-in
    /// roots (a private CA, a self-signed test server).
    pub fn with_ca_file(mut self, path: &Path) -> Result<Endpoint> {
        let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if certs.is_empty() {
            bail!("{}: no PEM certificate in it", path.display());
        }
        self.agent = agent(Some(ureq::tls::RootCerts::Specific(Arc::new(certs))));
        Ok(self)
    }

    pub fn has_api_key(&self) -> bool {
        self.api_key.is_some()
    }

    /// `host:port`, with brackets around an IPv6 host (for URLs and `Host`).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    fn base(&self) -> String {
        format!("{}://{}", self.scheme, self.authority())
    }

    /// The URL of `path` below the prefix.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}{}", self.base(), self.prefix, path)
    }

    /// The same server without the path prefix (for /health, /metrics, /tokenize).
    pub fn root(&self) -> Endpoint {
        Endpoint {
            prefix: String::new(),
            ..self.clone()
        }
    }
}

/// One server-sent event's data line and when it arrived (ms after the
/// request was sent).
#[derive(Clone, Debug)]
pub struct SseEvent {
    pub at_ms: f64,
    pub data: String,
}

#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The body; empty for an event stream, whose data lines are `events`.
    pub body: Vec<u8>,
    pub events: Vec<SseEvent>,
    pub elapsed: Duration,
}

#[cfg(test)]
impl Response {
    /// A 200 event stream of `(ms after the request, data)` events: the
    /// answer tests' stand-in for a server's stream.
    pub fn event_stream(events: &[(f64, &str)]) -> Response {
        Response {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: vec![],
            events: events
                .iter()
                .map(|&(at_ms, d)| SseEvent {
                    at_ms,
                    data: d.to_string(),
                })
                .collect(),
            elapsed: Duration::ZERO,
        }
    }
}

impl Response {
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!(
                "the server answered {} with a body that is not JSON: {}",
                self.status,
                self.text_head(200)
            )
        })
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text_head(&self, n: usize) -> String {
        let t = String::from_utf8_lossy(&self.body);
        t.chars().take(n).collect()
    }
    pub fn is_event_stream(&self) -> bool {
        self.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"))
    }
}

/// One request with a deadline covering resolve, connect, send and the
/// whole response. `path` is below the endpoint's prefix; `headers` are
/// extra headers. An event-stream answer is read event by event.
pub fn request(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> std::result::Result<Response, HttpError> {
    let url = ep.url(path);
    let started = Instant::now();
    let mut req = ureq::http::Request::builder()
        .method(method)
        .uri(&url)
        .header("Accept", "application/json, text/event-stream");
    if body.is_some() {
        req = req.header("Content-Type", "application/json");
    }
    if let Some(k) = &ep.api_key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let bad = |e: ureq::http::Error| HttpError {
        kind: Failure::Other,
        text: format!("{url}: {e}"),
    };
    let sent = match body {
        Some(b) => {
            let req = req.body(b.to_string()).map_err(bad)?;
            let req = ep
                .agent
                .configure_request(req)
                .timeout_global(Some(timeout))
                .build();
            ep.agent.run(req)
        }
        None => {
            let req = req.body(()).map_err(bad)?;
            let req = ep
                .agent
                .configure_request(req)
                .timeout_global(Some(timeout))
                .build();
            ep.agent.run(req)
        }
    };
    let mut resp = sent.map_err(|e| HttpError::from_ureq(e, &url))?;
    let status = resp.status().as_u16();
    let headers: Vec<(String, String)> = resp
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let sse = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("content-type") && v.starts_with("text/event-stream"));
    let mut out = Response {
        status,
        headers,
        body: Vec::new(),
        events: Vec::new(),
        elapsed: Duration::ZERO,
    };
    let body = resp.body_mut().with_config().limit(MAX_BODY_BYTES);
    if sse {
        let mut r = BufReader::new(body.reader());
        let mut line = String::new();
        loop {
            line.clear();
            match r.read_line(&mut line) {
                Ok(0) => break,
                Ok(_) => {}
                // A stream that never sends `data: [DONE]` (transformers serve)
                // is whole once a finish reason came, however the connection then ends.
                Err(_) if out.events.iter().any(|e| finished(&e.data)) => break,
                Err(e) => {
                    let kind = if started.elapsed() >= timeout {
                        Failure::Timeout
                    } else {
                        Failure::Dropped
                    };
                    return Err(HttpError {
                        kind,
                        text: format!("{url}: the event stream broke: {e}"),
                    });
                }
            }
            if let Some(d) = line.trim_end().strip_prefix("data:") {
                out.events.push(SseEvent {
                    at_ms: started.elapsed().as_secs_f64() * 1e3,
                    data: d.trim().to_string(),
                });
            }
        }
    } else {
        out.body = body
            .read_to_vec()
            .map_err(|e| HttpError::from_ureq(e, &url))?;
    }
    out.elapsed = started.elapsed();
    Ok(out)
}

/// An event whose choice carries a finish reason: the stream's last word.
fn finished(data: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(data).is_ok_and(|v| {
        v["choices"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| c["finish_reason"].as_str().is_some_and(|f| !f.is_empty()))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn endpoints_parse() {
        let e = Endpoint::parse("http://127.0.0.1:8000/v1/").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.prefix.as_str()),
            ("127.0.0.1", 8000, "/v1")
        );
        assert_eq!(e.url("/models"), "http://127.0.0.1:8000/v1/models");
        let e = Endpoint::parse("https://models.example/v1").unwrap();
        assert_eq!((e.scheme.as_str(), e.port), ("https", 443));
        // IPv6 keeps its brackets in URLs (and so in Host).
        let e = Endpoint::parse("http://[::1]:8000/v1").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 8000));
        assert_eq!(e.url("/models"), "http://[::1]:8000/v1/models");
        assert_eq!(e.root().url("/health"), "http://[::1]:8000/health");
        assert!(Endpoint::parse("ftp://x/v1").is_err());
        assert!(Endpoint::parse("http://h:notaport").is_err());
        assert!(Endpoint::parse("http://[::1/v1").is_err());
        // The key never shows in debug output.
        let e = e.with_api_key(Some("sk-secret".into()));
        assert!(!format!("{e:?}").contains("sk-secret"));
        assert!(!Endpoint::parse("http://h/v1")
            .unwrap()
            .with_api_key(Some(" ".into()))
            .has_api_key());
    }

    /// A one-shot server: answers each accepted connection with the next
    /// reply and hands back the requests it read.
    fn serve(
        l: std::net::TcpListener,
        replies: Vec<String>,
    ) -> std::thread::JoinHandle<Vec<String>> {
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            for reply in replies {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = vec![0u8; 65536];
                let mut n = 0;
                // Read the head and the body (Content-Length).
                loop {
                    let k = s.read(&mut buf[n..]).unwrap();
                    n += k;
                    let text = String::from_utf8_lossy(&buf[..n]).to_string();
                    if let Some(i) = text.find("\r\n\r\n") {
                        let len = text
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if n >= i + 4 + len {
                            break;
                        }
                    }
                    if k == 0 {
                        break;
                    }
                }
                seen.push(String::from_utf8_lossy(&buf[..n]).to_string());
                s.write_all(reply.as_bytes()).unwrap();
            }
            seen
        })
    }

    #[test]
    fn a_real_exchange_over_loopback_with_chunked_sized_and_streamed_bodies() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = serve(l, vec![
            "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\":true}".to_string(),
            "HTTP/1.1 429 Too Many Requests\r\nTransfer-Encoding: chunked\r\nRetry-After: 1\r\n\r\n5\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\n\r\n".to_string(),
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 43\r\n\r\ndata: {\"x\":1}\n\ndata: {\"x\":2}\n\ndata: [DONE]\n".to_string(),
        ]);
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}/v1"))
            .unwrap()
            .with_api_key(Some("sk-test".into()));
        let r = request(
            &ep,
            "POST",
            "/completions",
            Some(&serde_json::json!({"prompt": "hi"})),
            &[("Idempotency-Key", "k1")],
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            (r.status, r.json().unwrap()["ok"].as_bool()),
            (200, Some(true))
        );
        let r = request(&ep, "GET", "/models", None, &[], Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(r.json().unwrap()["a"], 1);
        let r = request(
            &ep,
            "POST",
            "/completions",
            Some(&serde_json::json!({})),
            &[],
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(r.is_event_stream());
        let data: Vec<&str> = r.events.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(data, ["{\"x\":1}", "{\"x\":2}", "[DONE]"]);
        let seen = server.join().unwrap();
        assert!(
            seen[0].starts_with("POST /v1/completions HTTP/1.1\r\n"),
            "{}",
            seen[0]
        );
        let head = seen[0].to_ascii_lowercase();
        assert!(head.contains("authorization: bearer sk-test"), "{head}");
        assert!(head.contains("idempotency-key: k1"), "{head}");
        assert!(head.contains(&format!("host: 127.0.0.1:{port}")), "{head}");
        assert!(seen[0].ends_with("{\"prompt\":\"hi\"}"), "{}", seen[0]);
    }

    #[test]
    fn a_stream_without_done_is_whole_once_its_finish_reason_came() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // Chunked, cut off without the last chunk: once after a finish
        // reason (complete), once before it (broken).
        let server = serve(l, vec![
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n48\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":\"length\"}]}\n\n\r\n".to_string(),
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n2f\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\r\n".to_string(),
        ]);
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}/v1")).unwrap();
        let body = serde_json::json!({});
        let r = request(
            &ep,
            "POST",
            "/chat/completions",
            Some(&body),
            &[],
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(r.events.len(), 1);
        let e = request(
            &ep,
            "POST",
            "/chat/completions",
            Some(&body),
            &[],
            Duration::from_secs(5),
        )
        .unwrap_err();
        assert_eq!(e.kind, Failure::Dropped, "{e}");
        server.join().unwrap();
    }

    #[test]
    fn a_silent_server_and_a_slow_body_time_out_on_the_whole_deadline() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ep = Endpoint::parse(&format!("http://{}/v1", l.local_addr().unwrap())).unwrap();
        let t = Instant::now();
        let e = request(&ep, "GET", "/models", None, &[], Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind, Failure::Timeout, "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
        // A body that trickles a byte at a time still ends at the deadline.
        drop(l);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let _ = s.read(&mut [0u8; 4096]);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n");
            for _ in 0..100 {
                if s.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}/v1")).unwrap();
        let t = Instant::now();
        let e = request(&ep, "GET", "/models", None, &[], Duration::from_millis(500)).unwrap_err();
        assert_eq!(e.kind, Failure::Timeout, "{e}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    #[test]
    fn nothing_listening_is_refused_and_localhost_tries_every_address() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}/v1")).unwrap();
        let e = request(&ep, "GET", "/models", None, &[], Duration::from_secs(2)).unwrap_err();
        assert_eq!(e.kind, Failure::Refused, "{e}");
        // localhost may resolve to ::1 first; a server on 127.0.0.1 only is still reached.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = serve(
            l,
            vec!["HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".into()],
        );
        let ep = Endpoint::parse(&format!("http://localhost:{port}/v1")).unwrap();
        let r = request(&ep, "GET", "/models", None, &[], Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, 200);
        let seen = server.join().unwrap();
        assert!(seen[0]
            .to_ascii_lowercase()
            .contains(&format!("host: localhost:{port}")));
    }

    #[test]
    fn ipv6_loopback_keeps_its_brackets_in_host() {
        let Ok(l) = std::net::TcpListener::bind("[::1]:0") else {
            return; // no IPv6 on this machine
        };
        let port = l.local_addr().unwrap().port();
        let server = serve(
            l,
            vec!["HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".into()],
        );
        let ep = Endpoint::parse(&format!("http://[::1]:{port}/v1")).unwrap();
        let r = request(&ep, "GET", "/models", None, &[], Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, 200);
        let seen = server.join().unwrap();
        assert!(
            seen[0]
                .to_ascii_lowercase()
                .contains(&format!("host: [::1]:{port}")),
            "{}",
            seen[0]
        );
    }
}
