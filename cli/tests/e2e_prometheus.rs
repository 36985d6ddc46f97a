//! A real Prometheus (Debian's `prometheus`, started here in a temporary
//! directory on a free port) scrapes a collector's `/metrics`, and the test
//! reads a value back through Prometheus's own HTTP query API: the cgroup
//! limit of an agent that `oomscope run` ran in a 64 MiB test cgroup.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use oomscope_testkit::CollectorProcess;

const MIB: u64 = 1 << 20;
/// Prometheus starts, scrapes every second and answers within this.
const DEADLINE: Duration = Duration::from_secs(60);

/// Kills the Prometheus it holds when the test ends, however it ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` on 127.0.0.1:port: the body of a 200, else None.
fn get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    if !text.starts_with("HTTP/1.1 200") {
        return None;
    }
    let body = text.split_once("\r\n\r\n")?.1;
    // Go's server chunks bodies of unknown length.
    match text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        true => Some(dechunk(body)),
        false => Some(body.to_string()),
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[test]
fn prometheus_scrapes_an_agents_cgroup_limit() {
    let prometheus = which("prometheus")
        .expect("prometheus is not installed: scripts/test installs Debian's `prometheus`");
    let tmp = tempdir();
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let col = CollectorProcess::start_with(
        oomscope,
        &tmp.path().join("db"),
        &["--metrics".as_ref(), metrics_addr.as_ref()],
        None,
    );

    let cg = TestCgroup::create(None, "oomscope-prom", Some(64 * MIB));
    let mut argv = vec![bin()];
    argv.extend(run_args(&col.url, "prom-agent"));
    argv.extend(["--", "sleep", "1"]);
    let out = cg.command(&argv).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let config = tmp.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: oomscope\n    \
             static_configs:\n      - targets: ['{metrics_addr}']\n"
        ),
    )
    .unwrap();
    let web_port = free_port();
    let _prom = Killed(
        std::process::Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                tmp.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{web_port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start prometheus"),
    );

    // oomscope_agent_memory_bytes{name="prom-agent",domain="cgroup",figure="limit"}
    let query = "/api/v1/query?query=oomscope_agent_memory_bytes%7Bname%3D%22prom-agent%22%2C\
                 domain%3D%22cgroup%22%2Cfigure%3D%22limit%22%7D";
    let started = Instant::now();
    let mut last = String::new();
    let value = loop {
        if let Some(body) = get(web_port, query) {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if let Some(s) = v["data"]["result"][0]["value"][1].as_str() {
                break s.parse::<f64>().unwrap();
            }
            last = body;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "Prometheus had no cgroup limit within {DEADLINE:?}; last answer: {last}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(value, (64 * MIB) as f64);
}

/// The first `name` on PATH.
fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| p.is_file())
}
