//! The GPU reader over a scripted NVML (tests/support/fake_nvml.rs): MIG
//! layouts, refusals, older drivers, what a sample costs, and how NVML's
//! pids are seen from a faked /proc.

#[path = "support/fake_nvml.rs"]
mod fake_nvml;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use fake_nvml::{FakeDevice, FakeNvml};
use oomscope_agent_core::pb;
use oomscope_agent_core::readers::gpu::{GpuReader, MemoryInfo, NvmlError};
use oomscope_agent_core::readers::pid_views::{PidViews, HOST_PID_NAMESPACE};
use oomscope_agent_core::readers::{HostPaths, HostReader};

const GIB: u64 = 1 << 30;

fn reader(fake: &FakeNvml) -> GpuReader {
    GpuReader::with_api(Box::new(fake.clone()))
}

fn mig_instance(uuid: &str, total: u64, used: u64) -> FakeDevice {
    FakeDevice {
        name: "NVIDIA A100-SXM4-80GB MIG 1g.10gb".into(),
        pci_bus_id: String::new(),
        ..FakeDevice::gpu(uuid, total, used)
    }
}

#[test]
fn each_mig_instance_is_a_device_and_a_refusal_is_listed_unreadable() {
    let whole = FakeDevice::gpu("GPU-whole", 80 * GIB, 5 * GIB);
    let mig = FakeDevice {
        mig: Some(vec![
            Some(mig_instance("MIG-a", 10 * GIB, 9 * GIB).with_processes(&[(4001, None)])),
            None,
            Some(mig_instance("MIG-b", 20 * GIB, 2 * GIB).with_processes(&[(4002, Some(2 * GIB))])),
            // A slot NVML will not hand out.
            Some(mig_instance("MIG-c", 10 * GIB, 0).refusing("device", || NvmlError::NoPermission)),
        ]),
        ..FakeDevice::gpu("GPU-mig", 80 * GIB, 11 * GIB)
    };
    // MIG on, but the parent refuses to list its instances.
    let refused_parent = FakeDevice {
        mig: Some(vec![Some(mig_instance("MIG-hidden", 10 * GIB, 0))]),
        ..FakeDevice::gpu("GPU-refusing", 80 * GIB, 0)
    }
    .refusing("max_mig_devices", || NvmlError::NoPermission);
    let lost = FakeDevice::gpu("GPU-lost", 80 * GIB, 0).refusing("device", || NvmlError::GpuLost);
    let fake = FakeNvml::new(vec![whole, mig, refused_parent, lost]);
    let gpu = reader(&fake);
    assert!(gpu.is_present());

    let memory_reads = fake.calls("memory_info_v2");
    let devices = gpu.read();
    assert_eq!(
        fake.calls("memory_info_v2") - memory_reads,
        3,
        "refused devices are not read"
    );
    let ids: Vec<(&str, &str, i32)> = devices
        .iter()
        .map(|d| (d.uuid.as_str(), d.parent_uuid.as_str(), d.index))
        .collect();
    assert_eq!(
        ids,
        [
            ("GPU-whole", "", 0),
            ("MIG-a", "GPU-mig", 1),
            ("MIG-b", "GPU-mig", 1),
            ("", "GPU-mig", 1),
            ("GPU-refusing", "", 2),
            ("", "", 3),
        ]
    );
    // An instance's figures are its own, never its GPU's.
    let a = &devices[1];
    assert_eq!(
        (a.total_bytes, a.used_bytes, a.free_bytes),
        (10 * GIB, 9 * GIB, GIB)
    );
    assert_eq!(a.unreadable, "");
    assert_eq!(a.name, "NVIDIA A100-SXM4-80GB MIG 1g.10gb");
    // Instances share their GPU's PCI address.
    let mig_pci = FakeDevice::gpu("GPU-mig", 1, 0).pci_bus_id;
    assert_eq!(a.pci_bus_id, mig_pci);
    assert_eq!(devices[2].pci_bus_id, mig_pci);
    assert_eq!(a.processes[0].pid, 4001);
    assert_eq!(a.processes[0].used_bytes, None, "unknown, never 0");
    assert_eq!(devices[2].processes[0].used_bytes, Some(2 * GIB));
    // The refused slot, the parent that refused its instances and the lost
    // GPU are listed, unreadable, with no figures.
    for (d, why) in [
        (&devices[3], "NoPermission"),
        (&devices[4], "NoPermission"),
        (&devices[5], "GpuLost"),
    ] {
        assert_eq!(d.unreadable, why, "{d:?}");
        assert_eq!((d.total_bytes, d.free_bytes, d.used_bytes), (0, 0, 0));
        assert!(d.processes.is_empty());
    }
    assert_eq!(devices[4].name, "NVIDIA H100 80GB HBM3");

    // The Hello's placements: identities and totals from open, without the
    // refused devices, which have nothing to place.
    let calls = fake.total_calls();
    let placed: Vec<(String, String, String, u64)> = gpu
        .placements()
        .into_iter()
        .map(|p| (p.uuid, p.parent_uuid, p.pci_bus_id, p.total_bytes))
        .collect();
    assert_eq!(fake.total_calls(), calls, "placements make no NVML call");
    let whole_pci = FakeDevice::gpu("GPU-whole", 1, 0).pci_bus_id;
    assert_eq!(
        placed,
        [
            ("GPU-whole".into(), "".into(), whole_pci, 80 * GIB),
            ("MIG-a".into(), "GPU-mig".into(), mig_pci.clone(), 10 * GIB),
            ("MIG-b".into(), "GPU-mig".into(), mig_pci, 20 * GIB),
        ]
    );
}

#[test]
fn a_mig_gpu_without_instances_is_still_read_whole() {
    let empty = FakeDevice {
        mig: Some(vec![None, None]),
        ..FakeDevice::gpu("GPU-empty", 80 * GIB, GIB)
    };
    let devices = reader(&FakeNvml::new(vec![empty])).read();
    assert_eq!(devices.len(), 1);
    assert_eq!(
        (
            devices[0].uuid.as_str(),
            devices[0].total_bytes,
            devices[0].used_bytes
        ),
        ("GPU-empty", 80 * GIB, GIB)
    );
}

#[test]
fn a_device_refusing_its_memory_is_unreadable_and_its_processes_still_read() {
    let d = FakeDevice::gpu("GPU-0", 80 * GIB, 70 * GIB)
        .with_processes(&[(77, None), (78, Some(GIB))])
        .refusing("memory_info_v2", || NvmlError::NotSupported);
    let devices = reader(&FakeNvml::new(vec![d])).read();
    assert_eq!(devices[0].unreadable, "NotSupported");
    assert_eq!(devices[0].total_bytes, 0);
    let usage: Vec<(u32, Option<u64>)> = devices[0]
        .processes
        .iter()
        .map(|p| (p.pid, p.used_bytes))
        .collect();
    assert_eq!(usage, [(77, None), (78, Some(GIB))]);
}

#[test]
fn an_older_driver_is_read_through_the_older_calls() {
    let gpus = vec![
        FakeDevice::gpu("GPU-0", 40 * GIB, 30 * GIB).with_processes(&[(900, Some(30 * GIB))]),
        FakeDevice::gpu("GPU-1", 40 * GIB, GIB),
    ];
    // No _v3 process call (NVML's own answer) and no _v2 memory call (the
    // library lacks the symbol), as on drivers before both.
    let fake = FakeNvml::with_missing(
        gpus,
        &[
            ("compute_processes_v3", || NvmlError::FunctionNotFound),
            ("memory_info_v2", || {
                NvmlError::FailedToLoadSymbol("nvmlDeviceGetMemoryInfo_v2".into())
            }),
        ],
    );
    let gpu = reader(&fake);
    const SAMPLES: usize = 5;
    let mut last = Vec::new();
    for _ in 0..SAMPLES {
        last = gpu.read();
    }
    assert_eq!(last.len(), 2, "no device skipped");
    assert_eq!(
        (
            last[0].total_bytes,
            last[0].used_bytes,
            last[0].unreadable.as_str()
        ),
        (40 * GIB, 30 * GIB, "")
    );
    assert_eq!(last[0].processes[0].used_bytes, Some(30 * GIB));
    // The newer call is tried once; once it is known missing, only the
    // older one is made.
    assert_eq!(fake.calls("compute_processes_v3"), 1);
    assert_eq!(fake.calls("compute_processes_v2"), 2 * SAMPLES);
    assert_eq!(fake.calls("memory_info_v2"), 1);
    // Once per device at open (its total), then once per device per sample.
    assert_eq!(fake.calls("memory_info_v1"), 2 + 2 * SAMPLES);
}

#[test]
fn static_facts_are_read_once_and_a_sample_costs_two_calls_per_device() {
    let gpus = vec![
        FakeDevice::gpu("GPU-0", 80 * GIB, GIB),
        FakeDevice {
            mig: Some(vec![
                Some(mig_instance("MIG-0", 10 * GIB, 0)),
                Some(mig_instance("MIG-1", 10 * GIB, 0)),
            ]),
            ..FakeDevice::gpu("GPU-1", 80 * GIB, 0)
        },
    ];
    let fake = FakeNvml::new(gpus);
    let gpu = reader(&fake);
    let at_open = fake.total_calls();
    const SAMPLES: usize = 10;
    for i in 0..SAMPLES {
        let used = (i as u64 + 1) * GIB;
        fake.set_memory(
            "GPU-0",
            MemoryInfo {
                total: 80 * GIB,
                free: 80 * GIB - used,
                used,
            },
        );
        let devices = gpu.read();
        assert_eq!(devices.len(), 3);
        assert_eq!(devices[0].used_bytes, used, "memory is read fresh");
    }
    // Three devices (a GPU and two MIG instances): memory and processes each.
    assert_eq!(fake.total_calls() - at_open, 2 * 3 * SAMPLES);
    for once in ["uuid", "name", "mig_enabled", "device_by_index"] {
        let per_device = match once {
            "uuid" | "name" => 4, // two GPUs and two instances
            _ => 2,
        };
        assert_eq!(fake.calls(once), per_device, "{once}");
    }
    assert_eq!(fake.calls("pci_bus_id"), 2, "instances share their GPU's");
    assert_eq!(fake.calls("max_mig_devices"), 1);
    assert_eq!(fake.calls("mig_device_by_index"), 2);
    assert_eq!(fake.calls("compute_processes_v3"), 3 * SAMPLES);
}

#[test]
fn without_nvml_or_devices_the_probe_is_absent() {
    let none = reader(&FakeNvml::new(Vec::new()));
    assert!(!none.is_present());
    assert!(none.read().is_empty());
    assert!(none.placements().is_empty());
}

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

/// Fake pids stay above the kernel's largest pid_max (2^22), so that the
/// test process's own pid (also a root of "ours") is never one of them.
const ME: u32 = 5_000_100;
const CHILD: u32 = 5_000_101;
const GRANDCHILD: u32 = 5_000_102;
const NEIGHBOUR: u32 = 5_000_200;
const ELSEWHERE: u32 = 5_000_300;

/// A /proc with pid 1, us, our child and grandchild, and a neighbour, in
/// the PID namespace `ns` names.
fn fake_proc(ns: &str) -> (tempfile::TempDir, HostPaths) {
    let tmp = tempfile::tempdir().unwrap();
    let proc_root = tmp.path().join("proc");
    for (pid, ppid, name) in [
        (1, 0, "init"),
        (ME, 1, "server"),
        (CHILD, ME, "worker"),
        (GRANDCHILD, CHILD, "worker"),
        (NEIGHBOUR, 1, "other-job"),
    ] {
        let dir = proc_root.join(pid.to_string());
        write(
            &dir.join("stat"),
            &format!("{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194304 0 0"),
        );
        write(
            &dir.join("status"),
            &format!("Name:\t{name}\nUid:\t3999999\t3999999\t3999999\t3999999\nVmRSS:\t 2048 kB\n"),
        );
        write(&dir.join("cmdline"), &format!("{name}\0--serve\0"));
    }
    fs::create_dir_all(proc_root.join("self/ns")).unwrap();
    symlink(ns, proc_root.join("self/ns/pid")).unwrap();
    let paths = HostPaths {
        proc_root,
        cgroup_root: tmp.path().join("sys/fs/cgroup"),
    };
    (tmp, paths)
}

fn views(gpus: &[pb::GpuDevice]) -> Vec<(u32, pb::PidView)> {
    gpus.iter()
        .flat_map(|d| d.processes.iter().map(|p| (p.pid, p.view())))
        .collect()
}

fn gpu_with_every_kind_of_pid() -> FakeNvml {
    FakeNvml::new(vec![FakeDevice::gpu("GPU-0", 80 * GIB, 40 * GIB)
        .with_processes(&[
            (ME, Some(10 * GIB)),
            (GRANDCHILD, Some(10 * GIB)),
            (NEIGHBOUR, Some(10 * GIB)),
            (ELSEWHERE, None),
        ])])
}

#[test]
fn pids_are_own_visible_or_unresolved_in_the_host_namespace() {
    let (_tmp, paths) = fake_proc(HOST_PID_NAMESPACE);
    let fake = gpu_with_every_kind_of_pid();
    let host = HostReader::with_gpu(paths, ME, reader(&fake));
    let s = host.sample();
    assert_eq!(
        views(&s.gpus),
        [
            (ME, pb::PidView::Own),
            (GRANDCHILD, pb::PidView::Own),
            (NEIGHBOUR, pb::PidView::Visible),
            (ELSEWHERE, pb::PidView::Unresolved),
        ]
    );

    let list = host.process_list(3);
    let gpu: Vec<(u32, pb::PidView, &str, &str, Option<u64>)> = list
        .gpu
        .iter()
        .map(|p| {
            (
                p.pid,
                p.view(),
                p.device_uuid.as_str(),
                p.command.as_str(),
                p.used_bytes,
            )
        })
        .collect();
    assert_eq!(
        gpu,
        [
            (
                ME,
                pb::PidView::Own,
                "GPU-0",
                "server --serve",
                Some(10 * GIB)
            ),
            (
                GRANDCHILD,
                pb::PidView::Own,
                "GPU-0",
                "worker --serve",
                Some(10 * GIB)
            ),
            (
                NEIGHBOUR,
                pb::PidView::Visible,
                "GPU-0",
                "other-job --serve",
                Some(10 * GIB)
            ),
            (ELSEWHERE, pb::PidView::Unresolved, "GPU-0", "", None),
        ]
    );
    // The host passwd (not faked) has no such user: the uid is shown.
    assert_eq!(list.gpu[2].user, "3999999");
}

#[test]
fn in_a_pid_namespace_of_our_own_no_pid_is_resolved() {
    // A container's namespace: even our own number is not NVML's.
    let (_tmp, paths) = fake_proc("pid:[4026532713]");
    let host = HostReader::with_gpu(paths.clone(), ME, reader(&gpu_with_every_kind_of_pid()));
    assert!(views(&host.sample().gpus)
        .iter()
        .all(|(_, v)| *v == pb::PidView::Unresolved));
    // Neither described: the numbers would name our container's processes.
    let list = host.process_list(3);
    assert!(list
        .gpu
        .iter()
        .all(|p| p.command.is_empty() && p.user.is_empty()));
    assert!(!PidViews::new(&paths, &[ME]).in_host_namespace());
}

#[test]
fn an_unreadable_namespace_resolves_nothing() {
    let (_tmp, paths) = fake_proc(HOST_PID_NAMESPACE);
    fs::remove_file(paths.proc_root.join("self/ns/pid")).unwrap();
    let views = PidViews::new(&paths, &[ME]);
    assert!(!views.in_host_namespace());
    assert_eq!(views.view(ME), pb::PidView::Unresolved);
}

#[test]
fn a_pid_view_is_worked_out_once_while_nvml_lists_it() {
    let (_tmp, paths) = fake_proc(HOST_PID_NAMESPACE);
    let views = PidViews::new(&paths, &[ME]);
    let mut gpus = vec![pb::GpuDevice {
        processes: vec![pb::GpuProcessUsage {
            pid: NEIGHBOUR,
            ..Default::default()
        }],
        ..Default::default()
    }];
    views.fill(&mut gpus);
    assert_eq!(gpus[0].processes[0].view(), pb::PidView::Visible);
    // The neighbour's /proc entry goes; its view stays while NVML lists it...
    fs::remove_dir_all(paths.proc_root.join(NEIGHBOUR.to_string())).unwrap();
    views.fill(&mut gpus);
    assert_eq!(gpus[0].processes[0].view(), pb::PidView::Visible);
    // ...and is worked out again once NVML stopped listing it in between.
    views.fill(&mut []);
    views.fill(&mut gpus);
    assert_eq!(gpus[0].processes[0].view(), pb::PidView::Unresolved);
}

#[test]
fn a_boundary_sample_reads_no_nvml() {
    let (_tmp, paths) = fake_proc(HOST_PID_NAMESPACE);
    let fake = gpu_with_every_kind_of_pid();
    let host = HostReader::with_gpu(paths, ME, reader(&fake));
    let full = host.sample();
    assert_eq!(full.gpus.len(), 1);
    let before = fake.total_calls();
    for _ in 0..50 {
        let b = host.boundary_sample(&full.cgroup);
        assert!(b.gpus.is_empty());
        assert!(b.process.is_some(), "the process is still read");
    }
    assert_eq!(fake.total_calls(), before);
    assert_eq!(host.sample().gpus.len(), 1);
    assert_eq!(fake.total_calls(), before + 2);
}

#[test]
fn a_boundarys_own_device_reading_is_one_process_list_call_per_gpu_we_are_on() {
    let (_tmp, paths) = fake_proc(HOST_PID_NAMESPACE);
    // GPU-0 lists us (and a child, and others); GPU-1 only a neighbour.
    let fake = FakeNvml::new(vec![
        FakeDevice::gpu("GPU-0", 80 * GIB, 40 * GIB).with_processes(&[
            (ME, Some(10 * GIB)),
            (GRANDCHILD, Some(GIB)),
            (NEIGHBOUR, Some(10 * GIB)),
            (ELSEWHERE, Some(GIB)),
        ]),
        FakeDevice::gpu("GPU-1", 80 * GIB, 10 * GIB).with_processes(&[(NEIGHBOUR, Some(GIB))]),
    ]);
    let host = HostReader::with_gpu(paths, ME, reader(&fake));
    let last = host.sample().gpus;
    fake.set_processes(
        "GPU-0",
        &[
            (ME, Some(12 * GIB)),
            (GRANDCHILD, Some(GIB)),
            (NEIGHBOUR, Some(10 * GIB)),
        ],
    );
    let before = fake.total_calls();
    let own = host.own_gpu_processes(&last);
    // Only GPU-0's list was read: no memory call, nothing of GPU-1.
    assert_eq!(fake.total_calls(), before + 1);
    let got: Vec<(u32, Option<u64>, &str, pb::PidView)> = own
        .iter()
        .map(|p| (p.pid, p.used_bytes, p.device_uuid.as_str(), p.view()))
        .collect();
    assert_eq!(
        got,
        [
            (ME, Some(12 * GIB), "GPU-0", pb::PidView::Own),
            (GRANDCHILD, Some(GIB), "GPU-0", pb::PidView::Own),
        ],
        "only our tree's entries, read now"
    );
    // On no GPU of ours (the newest periodic reading listed none): no call.
    let elsewhere: Vec<pb::GpuDevice> = last.into_iter().skip(1).collect();
    let before = fake.total_calls();
    assert!(host.own_gpu_processes(&elsewhere).is_empty());
    assert_eq!(fake.total_calls(), before);
}

#[test]
fn a_refused_process_list_is_unknown_not_empty() {
    let gpus = vec![
        FakeDevice::gpu("GPU-0", 80 * GIB, 60 * GIB)
            .with_processes(&[(900, Some(30 * GIB))])
            .refusing("compute_processes_v3", || NvmlError::NoPermission),
        FakeDevice::gpu("GPU-1", 80 * GIB, 0),
    ];
    let fake = FakeNvml::new(gpus);
    let read = reader(&fake).read();
    assert_eq!(read[0].processes_unreadable, "NoPermission");
    assert!(read[0].processes.is_empty());
    assert_eq!(
        read[0].used_bytes,
        60 * GIB,
        "the device's own figures stand"
    );
    assert_eq!(
        read[1].processes_unreadable, "",
        "an empty list it did give"
    );
}
