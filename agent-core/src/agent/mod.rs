//! The skeleton every oomscope agent runs on: the supervisor (`oomscope
//! run`), the Python extension and the cudarc pool's agent. It owns what
//! they must agree on, so that they cannot drift apart:
//!
//! - `identity`: the Hello every agent opens with, and one agent-id scheme;
//! - `interval`: one sampling-interval rule (at least 10 ms), for the
//!   command line, the Python configuration and the collector's directives;
//! - `sampling`: one sampling loop (a clock that never bursts, directives,
//!   jobs from the request path, stop), into which each agent plugs its own
//!   readers through [`Readers`];
//! - `boundary_ring`: request begins and ends read on the request's thread
//!   into a bounded ring, sent by the sampler as one batch at its pace;
//! - `lineage`: what a forked child reports as, so that its evidence is not
//!   mixed with its parent's.

pub mod boundary_ring;
mod identity;
mod interval;
mod lineage;
mod sampling;

pub use identity::{agent_id, Identity, CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES, INSTANCE_ENV};
pub use interval::{check_interval, IntervalTooShort, MIN_SAMPLE_INTERVAL};
pub use lineage::{Lineage, PARENT_PID_LABEL};
pub use sampling::{Control, Flow, Readers, Sampler, SamplingLoop};
