//! Loopback ports for the processes a test starts.

use std::net::TcpListener;

/// A port nobody listens on right now (another process may take it before
/// the test binds it: see [`crate::CollectorProcess::start`]).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
