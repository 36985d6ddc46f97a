//! Tokens at the real `oomscope` binary: a collector process with
//! `--token-file`, `run` and the query verbs with and without a token, and
//! the refusal to serve a non-loopback address without one.

mod common;

use std::process::Output;

use common::*;
use oomscope_testkit::CollectorProcess;

const SECRET: &str = "e2e-secret-0123456789";

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `run` reaches a collector with tokens through OOMSCOPE_TOKEN (its
/// reporter reads it); `agents` without a token is told how to give one,
/// and with `--token` lists the agent.
#[test]
fn a_token_reaches_the_collector_from_run_and_the_query_verbs() {
    let tmp = tempdir();
    let tokens = tmp.path().join("tokens");
    std::fs::write(&tokens, format!("ci:{SECRET}\n")).unwrap();
    let col = CollectorProcess::start(
        || {
            let mut c = oomscope();
            c.env("OOMSCOPE_TOKEN_FILE", &tokens);
            c
        },
        &tmp.path().join("db"),
        None,
    );
    let out = oomscope()
        .args(run_args(&col.url, "authed"))
        .env("OOMSCOPE_TOKEN", SECRET)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let out = oomscope()
        .args(["agents", "--json", "--collector", &col.url])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = stderr(&out);
    assert!(
        err.contains("Unauthenticated") && err.contains("OOMSCOPE_TOKEN"),
        "{err}"
    );

    let out = oomscope()
        .args([
            "agents",
            "--json",
            "--collector",
            &col.url,
            "--token",
            SECRET,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let agents: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = agents
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["hello"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["authed"], "{agents}");
    // The run's samples were stored, not only its Hello.
    assert!(agents[0]["last_seq"].as_u64().unwrap() >= 1, "{agents}");
}

/// A collector asked to listen on every interface without tokens refuses,
/// says why and what to give, and creates no store.
#[test]
fn a_non_loopback_listen_without_a_token_refuses_to_start() {
    let tmp = tempdir();
    let db = tmp.path().join("never.db");
    let out = collector_refusing("0.0.0.0:0", &db);
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("0.0.0.0:0") && err.contains("--token-file") && err.contains("--insecure"),
        "{err}"
    );
    assert!(!err.contains("listening on"), "{err}");
    assert!(!db.exists());
}

/// A collector with TLS and a token, certificates made now: `run` and
/// `agents` reach it over https:// trusting the test CA (OOMSCOPE_CA and
/// --ca); an http:// URL to it fails saying to use https://.
#[test]
fn tls_and_a_token_together_from_run_and_the_query_verbs() {
    let tmp = tempdir();
    let pki = oomscope_testkit::certs::TestPki::create(tmp.path());
    let tokens = tmp.path().join("tokens");
    std::fs::write(&tokens, format!("ci:{SECRET}\n")).unwrap();
    let log = tmp.path().join("collector.log");
    let col = CollectorProcess::start_with(
        oomscope,
        &tmp.path().join("db"),
        &[
            "--token-file".as_ref(),
            tokens.as_os_str(),
            "--tls-cert".as_ref(),
            pki.server_cert.as_os_str(),
            "--tls-key".as_ref(),
            pki.server_key.as_os_str(),
        ],
        Some(&log),
    );
    let port = col.port;
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("(TLS)"), "{said}");

    let https = format!("https://localhost:{port}");
    let out = oomscope()
        .args(run_args(&https, "over-tls"))
        .env("OOMSCOPE_TOKEN", SECRET)
        .env("OOMSCOPE_CA", &pki.ca)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let out = oomscope()
        .args([
            "agents",
            "--json",
            "--collector",
            &https,
            "--token",
            SECRET,
            "--ca",
        ])
        .arg(&pki.ca)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let agents: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(agents[0]["hello"]["name"], "over-tls", "{agents}");
    assert!(agents[0]["last_seq"].as_u64().unwrap() >= 1, "{agents}");

    let plain = format!("http://127.0.0.1:{port}");
    let out = oomscope()
        .args(["agents", "--collector", &plain, "--token", SECRET])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(
        stderr(&out).contains("use an https:// URL"),
        "{}",
        stderr(&out)
    );
}

/// A collector whose certificate expired (made now, signed by the CA the
/// client trusts): `agents` is refused and says the certificate expired.
#[test]
fn an_expired_collector_certificate_is_refused_by_the_query_verbs() {
    let tmp = tempdir();
    let pki = oomscope_testkit::certs::TestPki::create(tmp.path());
    let col = CollectorProcess::start_with(
        oomscope,
        &tmp.path().join("db"),
        &[
            "--tls-cert".as_ref(),
            pki.expired_server_cert.as_os_str(),
            "--tls-key".as_ref(),
            pki.expired_server_key.as_os_str(),
        ],
        None,
    );
    let out = oomscope()
        .args([
            "agents",
            "--collector",
            &format!("https://localhost:{}", col.port),
            "--ca",
        ])
        .arg(&pki.ca)
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(
        stderr(&out).contains("certificate expired"),
        "{}",
        stderr(&out)
    );
}
