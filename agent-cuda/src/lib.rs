//! oomscope's agent for Rust inference binaries ([`Agent`]): one per
//! process, with or without a GPU, it reports host memory, requests
//! (`let _r = agent.request(id, prompt_tokens)`), phases and, for each
//! attached [`TrackingPool`] (a caching device allocator in PyTorch's
//! mould over cudarc or a simulated device, that knows what every live
//! block is for), its counters, snapshot summaries and OOM events, in the
//! same shapes as the PyTorch agent. See README.md.
//!
//! Nothing here panics on a missing GPU: [`Cuda::open`] checks for libcuda
//! first and reports the device absent; an OOM is a typed error.

pub mod agent;
pub mod cuda;
pub mod device;
pub mod pool;
pub mod simulated;
pub mod tag;

pub use oomscope_agent_core::pb;

pub use agent::{Agent, AgentConfig, CudaAgent, Phase, Request, StartError};
pub use cuda::{libcuda_present, Cuda};
pub use device::{ContextScope, DeviceError, DeviceInfo, DeviceMemory};
pub use pool::{OomError, Pool, PoolError, StreamId, TrackedSlice, TrackingPool, UntrackedPool};
pub use simulated::Simulated;
pub use tag::Tag;

/// The README's examples, compiled (and the KV one run) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
