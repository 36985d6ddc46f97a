//! Test support shared by oomscope's crates (a dev-dependency only): it
//! starts and connects things, and holds no product logic, so a test reads
//! what it checks independently of the code under test.
//!
//! - [`collector_process`]: an `oomscope collector` process, ready once it
//!   says it listens;
//! - [`ports`]: a free loopback port;
//! - [`cgroups`]: a memory cgroup of the test's own (create, limit, run
//!   in, remove);
//! - [`torch_h200`]: the real H200 captures of `tests/fixtures/torch-h200`;
//! - [`agent_stream`]: an agent's gRPC stream to a collector, by hand;
//! - [`readings`]: a process's host reading at a request boundary;
//! - [`postgres`]: a throwaway PostgreSQL cluster on a Unix socket;
//! - [`cli`]: the `oomscope` binary beside the test, its queries as JSON;
//! - [`host_v2`]: the GPU machine's cgroup-v2 files as a fake tree;
//! - [`store_rows`]: what a collector's SQLite file holds, read directly.

pub mod agent_stream;
pub mod certs;
pub mod cgroups;
pub mod cli;
pub mod collector_process;
pub mod host_v2;
pub mod ports;
pub mod postgres;
pub mod readings;
pub mod store_rows;
pub mod torch_h200;

pub use cgroups::TestCgroup;
pub use collector_process::CollectorProcess;
pub use ports::free_port;

/// Removes oomscope's variables (`OOMSCOPE_COLLECTOR`, `_SPOOL`, `_DB`,
/// `_NAME`, ...) from what `c` inherits, but the log filter: a launched
/// process reaches the test's own collector, given on its command line, or
/// none; never a collector or spool of the person running the tests.
pub fn isolate(c: &mut std::process::Command) -> &mut std::process::Command {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("OOMSCOPE_") && key != "OOMSCOPE_LOG" {
            c.env_remove(&key);
        }
    }
    c
}
