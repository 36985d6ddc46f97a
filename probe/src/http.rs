//! A small blocking HTTP/1.1 client for the probe: one request per
//! connection, a hard deadline on each, JSON in and out. Enough for the
//! OpenAI-compatible endpoints (vLLM, SGLang, TGI, the reference servers)
//! without pulling a client stack into the collector. Talks only to the one
//! endpoint the user named.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// Responses larger than this are cut off: a completion is a few KiB.
const MAX_BODY_BYTES: usize = 16 << 20;

/// Where requests go: `http://host:port/prefix` (no TLS: local endpoints).
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// The path prefix, e.g. "/v1" (no trailing slash).
    pub prefix: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            anyhow!("`{url}`: only http:// endpoints are supported (e.g. http://127.0.0.1:8000/v1)")
        })?;
        let (hostport, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .with_context(|| format!("`{url}`: bad port `{p}`"))?,
            ),
            None => (hostport, 80),
        };
        if host.is_empty() {
            bail!("`{url}`: no host");
        }
        Ok(Endpoint {
            host: host.trim_matches(['[', ']']).to_string(),
            port,
            prefix: path.trim_end_matches('/').to_string(),
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}:{}{}{}", self.host, self.port, self.prefix, path)
    }
}

#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub elapsed: Duration,
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
}

/// One request with a deadline covering connect, send and the whole response.
/// `path` is below the endpoint's prefix; `headers` are extra headers.
pub fn request(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<Response> {
    let started = Instant::now();
    let addr = (ep.host.as_str(), ep.port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {}", ep.host))?
        .next()
        .ok_or_else(|| anyhow!("{} resolves to nothing", ep.host))?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("cannot connect to {addr}"))?;
    let left = |started: Instant| {
        timeout
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1))
    };
    stream.set_write_timeout(Some(left(started)))?;
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let mut head = format!(
        "{method} {}{path} HTTP/1.1\r\nHost: {}:{}\r\nConnection: close\r\nAccept: application/json\r\nContent-Length: {}\r\n",
        ep.prefix,
        ep.host,
        ep.port,
        payload.len()
    );
    if body.is_some() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(payload.as_bytes())?;
    stream.set_read_timeout(Some(left(started)))?;
    let mut reader = BufReader::new(stream);

    let mut status_line = String::new();
    reader.read_line(&mut status_line).context("no response")?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("not an HTTP response: {:?}", status_line.trim()))?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
        if started.elapsed() > timeout {
            bail!("timed out reading headers after {timeout:?}");
        }
    }
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| anyhow!("bad chunk size {:?}", size.trim()))?;
            if n == 0 {
                break;
            }
            if body.len() + n > MAX_BODY_BYTES {
                bail!("response body over {MAX_BODY_BYTES} bytes");
            }
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        if len > MAX_BODY_BYTES {
            bail!("response body of {len} bytes is over {MAX_BODY_BYTES}");
        }
        body.resize(len, 0);
        reader.read_exact(&mut body)?;
    } else {
        reader.take(MAX_BODY_BYTES as u64).read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
        elapsed: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        let e = Endpoint::parse("http://127.0.0.1:8000/v1/").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.prefix.as_str()),
            ("127.0.0.1", 8000, "/v1")
        );
        assert_eq!(e.url("/models"), "http://127.0.0.1:8000/v1/models");
        assert!(Endpoint::parse("https://x/v1")
            .unwrap_err()
            .to_string()
            .contains("only http://"));
        assert!(Endpoint::parse("http://h:notaport").is_err());
    }

    #[test]
    fn a_real_exchange_over_loopback_with_chunked_and_sized_bodies() {
        use std::net::TcpListener;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            for reply in [
                "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\":true}".to_string(),
                "HTTP/1.1 429 Too Many Requests\r\nTransfer-Encoding: chunked\r\nRetry-After: 1\r\n\r\n5\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\n\r\n".to_string(),
            ] {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 4096];
                let n = s.read(&mut buf).unwrap();
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                assert!(req.starts_with("POST /v1/completions HTTP/1.1\r\n") || req.starts_with("GET /v1/models"), "{req}");
                s.write_all(reply.as_bytes()).unwrap();
            }
        });
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}/v1")).unwrap();
        let r = request(
            &ep,
            "POST",
            "/completions",
            Some(&serde_json::json!({"prompt": "hi"})),
            &[],
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
        server.join().unwrap();
    }

    #[test]
    fn a_silent_server_times_out() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ep = Endpoint::parse(&format!("http://{}/v1", l.local_addr().unwrap())).unwrap();
        let t = Instant::now();
        assert!(request(&ep, "GET", "/models", None, &[], Duration::from_millis(300)).is_err());
        assert!(t.elapsed() < Duration::from_secs(3));
        drop(l);
    }
}
