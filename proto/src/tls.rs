//! TLS for clients of a collector: an `https://` URL is dialled with
//! rustls, trusting the CA in the PEM file named by `OOMSCOPE_CA` (the
//! CLI's `--ca` sets it), or the public web roots without one. A collector
//! that verifies clients (`--tls-client-ca`) is shown the certificate and
//! key of `OOMSCOPE_CLIENT_CERT` and `OOMSCOPE_CLIENT_KEY`.

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// A PEM file of the CA(s) that signed the collector's certificate.
pub const CA_ENV: &str = "OOMSCOPE_CA";
/// The client's certificate (PEM), for a collector that verifies clients.
pub const CLIENT_CERT_ENV: &str = "OOMSCOPE_CLIENT_CERT";
/// The client certificate's private key (PEM).
pub const CLIENT_KEY_ENV: &str = "OOMSCOPE_CLIENT_KEY";

/// `endpoint` (made from `url`) set up for TLS when `url` is `https://`,
/// from the environment; unchanged for `http://`.
pub fn secure(endpoint: Endpoint, url: &str) -> Result<Endpoint, String> {
    if !url
        .trim_start()
        .to_ascii_lowercase()
        .starts_with("https://")
    {
        return Ok(endpoint);
    }
    let read = |var: &str| -> Result<Option<Vec<u8>>, String> {
        match std::env::var_os(var) {
            None => Ok(None),
            Some(p) if p.is_empty() => Ok(None),
            Some(p) => std::fs::read(&p)
                .map(Some)
                .map_err(|e| format!("{var}={}: {e}", p.to_string_lossy())),
        }
    };
    let mut tls = ClientTlsConfig::new();
    tls = match read(CA_ENV)? {
        Some(pem) => tls.ca_certificate(Certificate::from_pem(pem)),
        None => tls.with_webpki_roots(),
    };
    match (read(CLIENT_CERT_ENV)?, read(CLIENT_KEY_ENV)?) {
        (Some(cert), Some(key)) => tls = tls.identity(Identity::from_pem(cert, key)),
        (None, None) => {}
        _ => {
            return Err(format!(
                "{CLIENT_CERT_ENV} and {CLIENT_KEY_ENV} go together: set both or neither"
            ))
        }
    }
    endpoint
        .tls_config(tls)
        .map_err(|e| format!("TLS for {url}: {e}"))
}

/// What to add to an error (its Debug form, with its sources) from a call to `url`: a plaintext client of a TLS
/// port sees only an HTTP/2 framing error (the TLS handshake bytes read as
/// a frame) or a closed connection, so it is told what that may mean.
pub fn hint(url: &str, error: &str) -> &'static str {
    let plaintext = url.trim_start().to_ascii_lowercase().starts_with("http://");
    // What a TLS port does to plaintext varies with timing: a framing
    // error, or the connection closed under the first call.
    let broken = [
        "h2 protocol error",
        "FRAME_SIZE_ERROR",
        "transport error",
        "broken pipe",
        // hyper's `Canceled`: the server closed the connection mid-call.
        "connection closed",
    ]
    .iter()
    .any(|s| error.contains(s));
    match plaintext && broken {
        true => {
            " (the collector did not speak plaintext HTTP/2: if it serves TLS, use an https:// URL)"
        }
        false => "",
    }
}

/// An error with its sources, since tonic's transport errors say little at
/// the top level ("transport error"): a refused TLS handshake says why
/// (an expired or untrusted certificate) only in a source.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_framing_error_on_http_hints_at_tls() {
        assert!(
            super::hint("http://c:7433", "h2 protocol error: http2 error").contains("https://")
        );
        // The other timing: the TLS port closed the connection under the call.
        let closed = r#"Status { code: Cancelled, message: "operation was canceled", source: Some(tonic::transport::Error(Transport, hyper::Error(Canceled, "connection closed"))) }"#;
        assert!(super::hint("http://c:7433", closed).contains("https://"));
        assert_eq!(super::hint("https://c:7433", "h2 protocol error"), "");
        assert_eq!(super::hint("http://c:7433", "connection refused"), "");
    }
}
