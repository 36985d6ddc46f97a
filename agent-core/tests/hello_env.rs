//! The Hello's CUDA device variables, read from this process's environment.
//! One test in its own binary: it changes the environment, which no other
//! thread may read meanwhile.

use oomscope_agent_core::agent::{Identity, CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES};
use oomscope_agent_core::readers::gpu::GpuReader;
use oomscope_agent_core::readers::{HostPaths, HostReader};

fn hello() -> oomscope_agent_core::pb::Hello {
    let reader = HostReader::with_gpu(HostPaths::system(), std::process::id(), GpuReader::absent());
    Identity {
        name: "svc".into(),
        role: "worker".into(),
        rank: 0,
        runtime: "pytorch".into(),
    }
    .hello(&reader)
}

#[test]
fn the_hello_carries_cuda_device_variables_as_set_unset_or_empty() {
    std::env::set_var(CUDA_VISIBLE_DEVICES, "3,GPU-8f0c2a1e,MIG-5d1e");
    std::env::set_var(CUDA_DEVICE_ORDER, "PCI_BUS_ID");
    let h = hello();
    assert_eq!(
        h.cuda_visible_devices.as_deref(),
        Some("3,GPU-8f0c2a1e,MIG-5d1e")
    );
    assert_eq!(h.cuda_device_order.as_deref(), Some("PCI_BUS_ID"));

    // Unset: absent, never "".
    std::env::remove_var(CUDA_VISIBLE_DEVICES);
    std::env::remove_var(CUDA_DEVICE_ORDER);
    let h = hello();
    assert_eq!(h.cuda_visible_devices, None);
    assert_eq!(h.cuda_device_order, None);

    // Set but empty hides every device: kept as empty, not absent.
    std::env::set_var(CUDA_VISIBLE_DEVICES, "");
    let h = hello();
    assert_eq!(h.cuda_visible_devices.as_deref(), Some(""));
    assert_eq!(h.cuda_device_order, None);
}
