//! NVML on a machine that has an NVIDIA GPU; skipped (with a note) elsewhere.
//! Run on the GPU machine: the readings must be the driver's real numbers.

use oomscope_agent_core::probe::gpu::GpuProbe;
use oomscope_agent_core::probe::{processes, HostPaths};

fn has_nvidia_device() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

#[test]
fn nvml_reads_each_device() {
    if !has_nvidia_device() {
        eprintln!("skipping: no NVIDIA device here");
        return;
    }
    let gpu = GpuProbe::open();
    assert!(
        gpu.is_present(),
        "NVML should open where /dev/nvidiactl exists"
    );
    let devices = gpu.read();
    assert!(!devices.is_empty());
    for (i, d) in devices.iter().enumerate() {
        eprintln!(
            "gpu {} {} {} total={} free={} used={} processes={:?}",
            d.index, d.uuid, d.name, d.total_bytes, d.free_bytes, d.used_bytes, d.processes
        );
        assert_eq!(d.index, i as i32);
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

    let list = processes::list(&HostPaths::system(), &gpu, 5);
    let on_gpus: usize = devices.iter().map(|d| d.processes.len()).sum();
    assert_eq!(list.gpu.len(), on_gpus);
}
