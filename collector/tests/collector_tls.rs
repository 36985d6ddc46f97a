//! TLS over real loopback connections, with certificates made at test time:
//! an https client that trusts the test CA is served; a plaintext client
//! on the TLS port is not; a client refuses a collector whose certificate
//! expired, saying so; with client verification on, a client without a
//! certificate or with an expired one is refused.

#[path = "collector_support.rs"]
mod support;

use std::time::Duration;

use oomscope_collector::ingest::Collector;
use oomscope_collector::pb;
use oomscope_collector::serve::TlsFiles;
use oomscope_collector::store::Store;
use oomscope_testkit::certs::TestPki;
use support::*;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

async fn start_tls(dir: &tempfile::TempDir, pki: &TestPki, verify_clients: bool) -> Running {
    let files = TlsFiles {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        client_ca: verify_clients.then(|| pki.ca.clone()),
    };
    start_tls_with(dir, files).await
}

async fn start_tls_with(dir: &tempfile::TempDir, files: TlsFiles) -> Running {
    let db = dir.path().join("c.db");
    let collector = Collector::new(Store::open(&db).unwrap(), Duration::from_secs(5))
        .with_tls(files.server_config().unwrap());
    serving(&db, collector).await
}

/// `list_agents` over https://localhost:PORT, trusting the test CA and
/// showing `identity` (cert, key) if given.
async fn list_over_tls(
    run: &Running,
    pki: &TestPki,
    identity: Option<(&std::path::Path, &std::path::Path)>,
) -> Result<pb::ListAgentsResponse, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&pki.ca).unwrap()));
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(cert).unwrap(),
            std::fs::read(key).unwrap(),
        ));
    }
    let url = format!("https://localhost:{}", run.addr.port());
    let channel = Endpoint::from_shared(url)
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("connect: {}", oomscope_proto::tls::error_chain(&e)))?;
    let mut q = pb::query_service_client::QueryServiceClient::new(channel);
    tokio::time::timeout(
        Duration::from_secs(10),
        q.list_agents(pb::ListAgentsRequest::default()),
    )
    .await
    .map_err(|_| "no answer within 10 s".to_string())?
    .map(|r| r.into_inner())
    .map_err(|s| format!("{s:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_client_is_served_and_a_plaintext_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(dir.path());
    let run = start_tls(&dir, &pki, false).await;
    let listed = list_over_tls(&run, &pki, None).await.unwrap();
    assert!(listed.agents.is_empty());

    // Plaintext HTTP/2 to the TLS port: the handshake fails, nothing answers.
    let plain = async {
        let channel = Endpoint::from_shared(run.url())
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await?;
        pb::query_service_client::QueryServiceClient::new(channel)
            .list_agents(pb::ListAgentsRequest::default())
            .await
            .map_err(Into::<Box<dyn std::error::Error + Send + Sync>>::into)
    };
    let err = tokio::time::timeout(Duration::from_secs(10), plain)
        .await
        .expect("the plaintext call ended within 10 s")
        .expect_err("a plaintext call to a TLS port was answered");
    let said = format!("{err:?}");
    assert!(
        oomscope_proto::tls::hint("http://x", &said).contains("https://"),
        "the client's error is one the CLI and agents explain: {said}"
    );
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_client_verification_only_a_valid_client_certificate_passes() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(dir.path());
    let run = start_tls(&dir, &pki, true).await;
    list_over_tls(&run, &pki, Some((&pki.client_cert, &pki.client_key)))
        .await
        .unwrap();
    let none = list_over_tls(&run, &pki, None)
        .await
        .expect_err("served a client without a certificate");
    let expired = list_over_tls(&run, &pki, Some((&pki.expired_cert, &pki.expired_key)))
        .await
        .expect_err("served a client with an expired certificate");
    // TLS 1.3 sends the client's alert-bearing refusal after its first
    // flight, so how it surfaces varies (an alert, a closed connection);
    // that the call fails is what is certain.
    assert!(!none.is_empty() && !expired.is_empty());
    run.stop().await;
}

/// A collector serving a certificate that expired (signed by the CA the
/// client trusts): the handshake fails, nothing is served, and the client's
/// error names the expiry rather than only "transport error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_server_certificate_is_refused_and_the_client_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(dir.path());
    let files = TlsFiles {
        cert: pki.expired_server_cert.clone(),
        key: pki.expired_server_key.clone(),
        client_ca: None,
    };
    let run = start_tls_with(&dir, files).await;
    let err = list_over_tls(&run, &pki, None)
        .await
        .expect_err("a client accepted an expired server certificate");
    assert!(err.contains("certificate expired"), "{err}");
    run.stop().await;
}
