//! Compiles only: the agent's pool over a device of the application's cudarc.

pub fn pool(
    ordinal: usize,
) -> Result<
    oomscope_agent_cuda::TrackingPool<oomscope_agent_cuda::Cuda>,
    oomscope_agent_cuda::DeviceError,
> {
    // A cudarc type of candle's build and the agent's in one signature:
    // one cudarc crate, not two.
    let _: fn(&oomscope_agent_cuda::Cuda) -> &std::sync::Arc<cudarc::driver::CudaContext> =
        oomscope_agent_cuda::Cuda::context;
    oomscope_agent_cuda::Cuda::open(ordinal).map(oomscope_agent_cuda::TrackingPool::new)
}
