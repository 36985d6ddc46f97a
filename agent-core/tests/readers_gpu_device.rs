//! NVML on a machine that has an NVIDIA GPU; skipped (with a note) elsewhere.
//! Run on the GPU machine: the readings must be the driver's real numbers.

use oomscope_agent_core::pb;
use oomscope_agent_core::readers::gpu::GpuReader;
use oomscope_agent_core::readers::{HostPaths, HostReader};

fn has_nvidia_device() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

#[test]
fn nvml_reads_each_device() {
    if !has_nvidia_device() {
        eprintln!("skipping: no NVIDIA device here");
        return;
    }
    let gpu = GpuReader::open();
    assert!(
        gpu.is_present(),
        "NVML should open where /dev/nvidiactl exists"
    );
    let devices = gpu.read();
    assert!(!devices.is_empty());
    for d in &devices {
        eprintln!(
            "gpu {} {} {} pci={} parent={:?} unreadable={:?} total={} free={} used={} processes={:?}",
            d.index,
            d.uuid,
            d.name,
            d.pci_bus_id,
            d.parent_uuid,
            d.unreadable,
            d.total_bytes,
            d.free_bytes,
            d.used_bytes,
            d.processes
        );
        assert!(d.unreadable.is_empty(), "{}", d.unreadable);
        assert!(!d.pci_bus_id.is_empty());
        assert!(
            d.uuid.starts_with("GPU-") || d.uuid.starts_with("MIG-"),
            "{}",
            d.uuid
        );
        assert!(!d.name.is_empty());
        assert!(d.total_bytes > 1 << 30);
        assert!(d.free_bytes <= d.total_bytes && d.used_bytes <= d.total_bytes);
    }
    let placements = gpu.placements();
    assert_eq!(placements.len(), devices.len());
    assert_eq!(placements[0].total_bytes, devices[0].total_bytes);
    assert_eq!(placements[0].uuid, devices[0].uuid);
    assert_eq!(placements[0].pci_bus_id, devices[0].pci_bus_id);

    let host = HostReader::with_gpu(HostPaths::system(), std::process::id(), gpu);
    let list = host.process_list(5);
    for p in &list.gpu {
        eprintln!("process {} on {} view {:?}", p.pid, p.device_uuid, p.view());
        assert!(devices.iter().any(|d| d.uuid == p.device_uuid));
        assert_ne!(p.view(), pb::PidView::Unspecified);
    }
}
