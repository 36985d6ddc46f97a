//! TLS certificates made at test time (never committed): a CA, a server
//! certificate for `localhost` and 127.0.0.1 signed by it, a client
//! certificate, and expired server and client certificates, as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// The PEM files of one test's PKI.
pub struct TestPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// A server certificate for the same names that expired in 2021.
    pub expired_server_cert: PathBuf,
    pub expired_server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A client certificate that expired in 2021.
    pub expired_cert: PathBuf,
    pub expired_key: PathBuf,
}

impl TestPki {
    /// Makes the certificates and writes them under `dir`.
    pub fn create(dir: &Path) -> TestPki {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let write = |name: &str, text: String| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let leaf = |names: &[&str], expired: bool| {
            let mut params =
                CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                    .unwrap();
            if expired {
                params.not_before = rcgen::date_time_ymd(2020, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &ca).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(&["localhost", "127.0.0.1"], false);
        let (expired_server_cert, expired_server_key) = leaf(&["localhost", "127.0.0.1"], true);
        let (client_cert, client_key) = leaf(&["client.test"], false);
        let (expired_cert, expired_key) = leaf(&["client.test"], true);
        TestPki {
            ca: write("ca.pem", ca.pem()),
            server_cert: write("server.pem", server_cert),
            server_key: write("server.key", server_key),
            expired_server_cert: write("expired-server.pem", expired_server_cert),
            expired_server_key: write("expired-server.key", expired_server_key),
            client_cert: write("client.pem", client_cert),
            client_key: write("client.key", client_key),
            expired_cert: write("expired.pem", expired_cert),
            expired_key: write("expired.key", expired_key),
        }
    }
}
