//! The oomscope collector: it receives agents' streams (`AgentService`),
//! stores them durably before acking (`store`, embedded SQLite), records
//! incidents as evidence arrives (`incidents`, `fleet`), and answers
//! `QueryService` (`query_service`), fed by the ingest (`ingest`) with timelines and the analysis crate's verdicts.
//!
//! Its only consumer-facing surface is the two gRPC services: the CLI, the
//! probe and the Python agent's `oomscope.query` reach it through them.

pub mod accept;
pub mod auth;
pub mod correlate;
pub mod fleet;
pub mod inbound;
pub mod incidents;
pub mod ingest;
pub mod metrics;
pub mod query_service;
pub mod serve;
pub mod store;
pub mod verdict;
mod writer;

pub use oomscope_proto::v1 as pb;
