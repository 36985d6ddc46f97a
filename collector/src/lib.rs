//! The `oomscope` binary's parts: the collector (ingest, store, queries), the
//! supervisor (`oomscope run`), the replayer and the query CLI.

pub mod capture;
pub mod cli;
pub mod compare;
pub mod fleet;
pub mod incidents;
pub mod probe;
pub mod query;
pub mod report;
pub mod server;
pub mod store;
pub mod supervise;

pub use oomscope_proto::v1 as pb;
