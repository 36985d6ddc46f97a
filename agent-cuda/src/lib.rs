//! oomscope's agent for Rust inference binaries: a caching device allocator
//! in PyTorch's mould ([`TrackingPool`]) over cudarc or a simulated device,
//! that knows what every live block is for, and reports its stats, snapshot
//! summaries and OOM events through agent-core's reporter in the same shapes
//! as the PyTorch agent ([`CudaAgent`]).
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

pub use agent::{AgentConfig, CudaAgent};
pub use cuda::{libcuda_present, Cuda};
pub use device::{ContextScope, DeviceError, DeviceInfo, DeviceMemory};
pub use pool::{OomError, Pool, PoolError, StreamId, TrackedSlice, TrackingPool, UntrackedPool};
pub use simulated::Simulated;
pub use tag::Tag;
