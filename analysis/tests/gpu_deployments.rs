//! The analysis on synthetic evidence shaped like the GPU deployments users
//! run: one row per deployment. Each row is built like the real thing (NVML's
//! device list with UUIDs, PyTorch's own OOM text in the exact form of the
//! H200 captures in tests/fixtures/torch-h200 with only the numbers and the
//! ordinal changed, NVML's process lists) and asserts the domain, the failing
//! device by UUID, the first cause with its key numbers, and that no process
//! is blamed that is not to blame.
//!
//! To add a deployment, add a `Row` to `rows()` with a builder of its evidence.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind, PidView};
use oomscope_analysis::{diagnose, Evidence};

/// One deployment and what its verdict must say.
struct Row {
    name: &'static str,
    evidence: fn() -> Evidence,
    /// The failing device's uuid (GPU-… or MIG-…).
    uuid: &'static str,
    /// The first cause's kind and its key metrics (value, within 0.1 %).
    first: &'static str,
    metrics: &'static [(&'static str, f64)],
    /// Pids that hold memory somewhere in the evidence but are not to blame.
    innocent: &'static [u32],
    /// Anything else the row must show.
    check: fn(&pb::Diagnosis),
}

/// A row whose first cause is fragmentation: 6 GiB cached but split, the
/// request (and the cached bytes) in `metrics`.
fn split_cache(
    name: &'static str,
    evidence: fn() -> Evidence,
    uuid: &'static str,
    metrics: &'static [(&'static str, f64)],
    innocent: &'static [u32],
    check: fn(&pb::Diagnosis),
) -> Row {
    Row {
        name,
        evidence,
        uuid,
        first: "fragmentation",
        metrics,
        innocent,
        check,
    }
}

const SPLIT_2_GIB: &[(&str, f64)] = &[
    ("request_bytes", 2.0 * GIB_F),
    ("reserved_unallocated_bytes", 6.0 * GIB_F),
];
const SPLIT_1_5_GIB: &[(&str, f64)] = &[
    ("request_bytes", 1.5 * GIB_F),
    ("reserved_unallocated_bytes", 6.0 * GIB_F),
];

fn rows() -> Vec<Row> {
    vec![
        split_cache(
            "CUDA_VISIBLE_DEVICES=3, by index",
            || visible_devices_3(Some("3")),
            H100_UUIDS[3],
            SPLIT_2_GIB,
            &[9999],
            |d| {
                has(
                    &d.evidence,
                    "CUDA_VISIBLE_DEVICES=3 makes ordinal 0 the GPU at index 3: NVML GPU 3",
                );
                has(
                    &d.evidence,
                    "NVML GPU 3 (NVIDIA H100 80GB HBM3): used 78.1 GiB",
                );
                assert!(d.device.as_ref().unwrap().certain);
            },
        ),
        split_cache(
            "CUDA_VISIBLE_DEVICES=GPU-…, by uuid",
            || visible_devices_3(Some(H100_UUIDS[3])),
            H100_UUIDS[3],
            SPLIT_2_GIB,
            &[9999],
            |d| {
                let dev = d.device.as_ref().unwrap();
                assert_eq!((dev.ordinal, dev.nvml_index), (Some(0), Some(3)));
            },
        ),
        split_cache(
            "a container: NVML reports host pids (the agent marks them unresolved)",
            || container(PidView::Unresolved, true),
            H100_UUIDS[0],
            SPLIT_1_5_GIB,
            &[CONTAINER_HOST_PID],
            container_says_why,
        ),
        split_cache(
            "a container, read by an older agent (PyTorch's text tells the namespace)",
            || container(PidView::Unspecified, false),
            H100_UUIDS[0],
            SPLIT_1_5_GIB,
            &[CONTAINER_HOST_PID],
            container_says_why,
        ),
        split_cache(
            "\"GPU 2 has a total capacity\" under oomscope run, a 50 GiB job on GPU 0",
            supervised_gpu_2,
            H100_UUIDS[2],
            SPLIT_2_GIB,
            &[5000],
            |d| {
                has(&d.evidence, "the error text is on ordinal 2");
                has(&d.evidence, "NVML lists the process on this GPU alone");
            },
        ),
        Row {
            name: "two containers on one GPU: the neighbour only seen from another namespace",
            evidence: two_containers,
            uuid: H100_UUIDS[0],
            first: "other_process",
            metrics: &[("other_bytes", 38.0 * GIB_F)],
            innocent: &[CONTAINER_HOST_PID],
            check: |d| {
                let c = &d.causes[0];
                assert_eq!(c.processes.len(), 1);
                assert_eq!(c.processes[0].pid, NEIGHBOUR_HOST_PID);
                assert!(c.confidence <= 0.5, "{}", c.confidence);
                has(
                    &c.evidence,
                    "pid 2718281 (in another PID namespace, not resolvable here) holds 38.0 GiB",
                );
                // Named, never to be killed or stopped from here.
                for f in &d.fixes {
                    let a = f.action.to_lowercase();
                    assert!(!a.contains("kill") && !a.contains("stop"), "{}", f.action);
                }
                has(
                    &d.evidence,
                    "pid 2718281 (38.0 GiB) is not this process by its own 40.0 GiB (reserved by PyTorch): another process",
                );
            },
        },
        Row {
            name: "a MIG instance of 9.5 GiB, a neighbour in another slice",
            evidence: mig_slice,
            uuid: MIG_OURS,
            first: "weights_too_large",
            metrics: &[
                // The instance's own total, never the parent's 80 GiB.
                ("limit_bytes", MIG_TOTAL as f64),
                ("model_bytes", 14.0 * GIB_F),
            ],
            innocent: &[MIG_NEIGHBOUR],
            check: |d| {
                let dev = d.device.as_ref().unwrap();
                assert_eq!(dev.parent_uuid, A100_UUID);
                assert_eq!(dev.total_bytes, Some(MIG_TOTAL));
                assert!(d.causes.iter().all(|c| c.kind != "other_process"));
            },
        },
        Row {
            name:
                "a MIG slice read through the driver API: its uuid written GPU-<the instance's hex>",
            evidence: mig_slice_driver_api,
            uuid: MIG_OURS,
            first: "weights_too_large",
            metrics: &[("limit_bytes", MIG_TOTAL as f64)],
            innocent: &[MIG_NEIGHBOUR],
            check: |d| {
                let dev = d.device.as_ref().unwrap();
                assert_eq!(
                    dev.parent_uuid, A100_UUID,
                    "joined with NVML's MIG instance"
                );
                assert_eq!(dev.total_bytes, Some(MIG_TOTAL));
            },
        },
        Row {
            name: "per-process memory unavailable: the neighbour's bytes from the device's used",
            evidence: usage_unavailable,
            uuid: A100_UUID,
            first: "other_process",
            metrics: &[
                // 79.5 GiB used on the device less this process's 36 GiB reserved.
                ("other_bytes", 43.5 * GIB_F),
            ],
            innocent: &[AGENT_PID],
            check: |d| {
                let c = &d.causes[0];
                assert_eq!(c.processes.len(), 1);
                assert_eq!(c.processes[0].pid, 8888);
                assert!(
                    c.confidence <= 0.6,
                    "derived bytes weigh less: {}",
                    c.confidence
                );
                has(&c.evidence, "pid 8888 holds about 43.5 GiB");
                has(&c.evidence, "NVML gives no per-process usage for pid 8888");
                has(&d.evidence, "pid 8888 (usage not given by NVML)");
            },
        },
    ]
}

#[test]
fn each_deployment_gets_its_device_domain_and_first_cause() {
    for row in &rows() {
        let e = (row.evidence)();
        let d = diagnose(&e);
        let ctx = format!("{}: {:#?}\n{:#?}", row.name, d.evidence, d.causes);
        assert_eq!(d.domain.as_deref(), Some("gpu_vram"), "{ctx}");
        let dev = d
            .device
            .as_ref()
            .unwrap_or_else(|| panic!("no device: {ctx}"));
        assert_eq!(dev.uuid, row.uuid, "{ctx}");
        let first = d
            .causes
            .first()
            .unwrap_or_else(|| panic!("no cause: {ctx}"));
        assert_eq!(first.kind, row.first, "{ctx}");
        for (name, want) in row.metrics {
            let got = *first
                .metrics
                .get(*name)
                .unwrap_or_else(|| panic!("{}: no {name} in {:?}", row.name, first.metrics));
            assert!(
                (got - want).abs() <= want.abs() * 1e-3,
                "{}: {name} {got} != {want}",
                row.name
            );
        }
        for pid in row.innocent {
            assert_not_blamed(&d, *pid, row.name);
        }
        // Unknown usage is never written as 0 bytes.
        for line in all_lines(&d) {
            assert!(!line.contains(" 0 B"), "{}: {line}", row.name);
        }
        (row.check)(&d);
        // `diagnose --json` carries the device.
        let j = to_json(&d);
        assert_eq!(j["device"]["uuid"], row.uuid, "{}", row.name);
    }
}

/// Without the variable and without the process on NVML's list, ordinal 0
/// of four GPUs is no one device: unknown, and no one there is blamed.
#[test]
fn an_ordinal_that_nothing_ties_to_a_device_stays_unknown() {
    let mut e = visible_devices_3(None);
    for s in &mut e.samples {
        for g in &mut s.gpus {
            g.processes.retain(|p| p.pid != AGENT_PID);
        }
    }
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    let dev = d
        .device
        .as_ref()
        .expect("the failing ordinal is still a device");
    assert_eq!((dev.uuid.as_str(), dev.ordinal), ("", Some(0)));
    has(
        &d.evidence,
        "no CUDA_VISIBLE_DEVICES was recorded and 4 GPUs are in sight: ordinal 0 is not tied to one",
    );
    assert_not_blamed(&d, 9999, "unmapped");
    assert!(all_lines(&d).all(|l| !l.contains("NVML GPU 0")));
}

/// CUDA's default order is NVML's PCI order only for alike GPUs: over an
/// H100 and an L40S the tie of an index entry is an assumption, said so,
/// and a neighbour there is named with less weight.
#[test]
fn an_index_over_unlike_gpus_is_an_uncertain_tie() {
    let mut e = visible_devices_3(Some("3"));
    let l40s = |g: &mut pb::GpuDevice| {
        if g.index == 1 {
            g.name = "NVIDIA L40S".into();
            g.total_bytes = 48 * GIB;
        }
    };
    e.samples
        .iter_mut()
        .for_each(|s| s.gpus.iter_mut().for_each(l40s));
    let d = diagnose(&e);
    let dev = d.device.as_ref().unwrap();
    assert_eq!(dev.uuid, H100_UUIDS[3]);
    assert!(!dev.certain);
    has(
        &d.evidence,
        "uncertain: CUDA's default FASTEST_FIRST order may differ",
    );
    // With CUDA_DEVICE_ORDER=PCI_BUS_ID it is NVML's order, certainly.
    e.hello.as_mut().unwrap().cuda_device_order = Some("PCI_BUS_ID".into());
    assert!(diagnose(&e).device.unwrap().certain);
}

/// A device NVML could not read stays in the list: its figures are unknown.
#[test]
fn an_unreadable_device_is_said_not_dropped() {
    let mut e = visible_devices_3(Some("3"));
    for s in &mut e.samples {
        let g = &mut s.gpus[3];
        g.unreadable = "GpuLost".into();
        g.processes.clear();
        (g.total_bytes, g.used_bytes, g.free_bytes) = (0, 0, 0);
    }
    let d = diagnose(&e);
    assert_eq!(d.device.as_ref().unwrap().uuid, H100_UUIDS[3]);
    has(
        &d.evidence,
        "NVML could not read GPU-c2d4e6f8-0a1b-4c3d-9e8f-7a6b5c4d3e2f (NVIDIA H100 80GB HBM3) (GpuLost): its memory figures are unknown",
    );
    assert_not_blamed(&d, 9999, "unreadable");
}

#[test]
fn a_refused_process_list_is_said_unknown_not_taken_for_none() {
    let mut e = visible_devices_3(Some("3"));
    for s in &mut e.samples {
        let g = &mut s.gpus[3];
        g.processes.clear();
        g.processes_unreadable = "NoPermission".into();
    }
    let d = diagnose(&e);
    assert_eq!(d.device.as_ref().unwrap().uuid, H100_UUIDS[3]);
    has(
        &d.evidence,
        "NVML GPU 3 (NVIDIA H100 80GB HBM3): used 78.1 GiB",
    );
    has(
        &d.evidence,
        "NVML refused its process list (NoPermission): who else holds memory there is unknown",
    );
}

// ---- the deployments ----

const GIB_F: f64 = GIB as f64;
const AGENT_PID: u32 = 4321;
const H100: &str = "NVIDIA H100 80GB HBM3";
/// nvidia-smi's 81559 MiB.
const H100_NVML_TOTAL: u64 = 81_559 * MIB;
const H100_UUIDS: [&str; 4] = [
    "GPU-68e78067-40bf-94a2-6927-1b2d520e0103",
    "GPU-3b1c2a9e-7d4f-5e60-8a1b-2c3d4e5f6a71",
    "GPU-9f0e8d7c-6b5a-4938-2716-05f4e3d2c1b0",
    "GPU-c2d4e6f8-0a1b-4c3d-9e8f-7a6b5c4d3e2f",
];
const A100: &str = "NVIDIA A100-SXM4-80GB";
const A100_UUID: &str = "GPU-5e2a6c1d-8b7f-4e3a-9c0d-1f2e3a4b5c6d";
const MIG_OURS: &str = "MIG-5c89d4e2-1f3a-5b6c-8d7e-9f0a1b2c3d4e";
const MIG_OTHER: &str = "MIG-a1b2c3d4-e5f6-5a7b-8c9d-0e1f2a3b4c5d";
/// A 1g.10gb instance: nvidia-smi's 9728 MiB.
const MIG_TOTAL: u64 = 9_728 * MIB;
const MIG_NEIGHBOUR: u32 = 8123;
const CONTAINER_HOST_PID: u32 = 3_141_592;

fn gib(x: f64) -> u64 {
    (x * GIB_F).round() as u64
}

/// An NVML reading of one device.
fn nvml(index: i32, uuid: &str, name: &str, total: u64, used: u64) -> pb::GpuDevice {
    pb::GpuDevice {
        index,
        uuid: uuid.into(),
        name: name.into(),
        total_bytes: total,
        used_bytes: used,
        free_bytes: total - used,
        ..Default::default()
    }
}

fn on(mut g: pb::GpuDevice, procs: &[(u32, Option<u64>, PidView)]) -> pb::GpuDevice {
    g.processes = procs
        .iter()
        .map(|&(pid, used_bytes, view)| pb::GpuProcessUsage {
            pid,
            used_bytes,
            view: view as i32,
        })
        .collect();
    g
}

/// The Hello's placements as an NVML-reading agent announces them.
fn placements(gpus: &[pb::GpuDevice]) -> Vec<pb::GpuPlacement> {
    gpus.iter()
        .map(|g| pb::GpuPlacement {
            index: g.index,
            uuid: g.uuid.clone(),
            name: g.name.clone(),
            total_bytes: g.total_bytes,
            parent_uuid: g.parent_uuid.clone(),
            ..Default::default()
        })
        .collect()
}

/// An in-process agent's Hello in a PyTorch server.
fn server_hello(pid: u32, cuda_visible_devices: Option<&str>, gpus: &[pb::GpuDevice]) -> pb::Hello {
    pb::Hello {
        agent_id: "agent-3c9e".into(),
        name: "llm-server".into(),
        host: "gpu-07".into(),
        pid,
        role: "server".into(),
        runtime: "pytorch".into(),
        gpus: placements(gpus),
        cuda_visible_devices: cuda_visible_devices.map(str::to_string),
        ..Default::default()
    }
}

/// PyTorch's size format (c10's format_size): two decimals; NVML's
/// "not available" (all ones) prints as 17179869184.00 GiB.
fn size(b: Option<u64>) -> String {
    let b = b.unwrap_or(u64::MAX);
    match b {
        0..=1024 => format!("{b} bytes"),
        1025..=1_048_576 => format!("{:.2} KiB", b as f64 / 1024.0),
        1_048_577..=1_073_741_824 => format!("{:.2} MiB", b as f64 / 1_048_576.0),
        _ => format!("{:.2} GiB", b as f64 / 1_073_741_824.0),
    }
}

/// Who PyTorch's message names: itself ("this process") or another pid.
enum Named {
    This(Option<u64>),
    Pid(u32, Option<u64>),
}

/// PyTorch's CUDA OOM message, in the exact form of the H200 captures.
struct TorchOom {
    ordinal: i32,
    requested: u64,
    total: u64,
    free: u64,
    processes: Vec<Named>,
    allocated: u64,
    unallocated: u64,
}

impl TorchOom {
    fn text(&self) -> String {
        let procs: String = self
            .processes
            .iter()
            .map(|p| match p {
                Named::This(b) => format!(
                    "Including non-PyTorch memory, this process has {} memory in use. ",
                    size(*b)
                ),
                Named::Pid(pid, b) => format!("Process {pid} has {} memory in use. ", size(*b)),
            })
            .collect();
        format!(
            "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. {procs}Of the allocated memory {} is allocated by PyTorch, and {} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)",
            size(Some(self.requested)),
            self.ordinal,
            size(Some(self.total)),
            size(Some(self.free)),
            size(Some(self.allocated)),
            size(Some(self.unallocated)),
        )
    }

    /// The in-process agent's OOM event: the observer's figures, the
    /// allocator's stats at the failure, the exception's text.
    fn event(&self, time_ns: i64, uuid: &str) -> pb::Event {
        let stats = pb::AllocatorStats {
            device: self.ordinal,
            device_uuid: uuid.into(),
            allocated_bytes: self.allocated,
            reserved_bytes: self.allocated + self.unallocated,
            driver_total_bytes: self.total,
            driver_free_bytes: self.free,
            ..Default::default()
        };
        pb::Event {
            time_ns,
            kind: Some(Kind::Oom(pb::Oom {
                device: self.ordinal,
                device_uuid: uuid.into(),
                requested_bytes: self.requested,
                error_type: "torch.OutOfMemoryError".into(),
                error_text: self.text(),
                stats: Some(stats),
                ..Default::default()
            })),
        }
    }
}

/// The agent's allocator reading of its ordinal, in one sample with NVML's.
fn sample(i: i64, gpus: Vec<pb::GpuDevice>, allocator: Vec<pb::AllocatorStats>) -> pb::Sample {
    pb::Sample {
        time_ns: T0 + i * SEC,
        gpus,
        allocator,
        ..Default::default()
    }
}

/// Three readings alike before the failure: NVML's and the allocator's.
fn steady(gpus: Vec<pb::GpuDevice>, allocator: pb::AllocatorStats) -> Vec<pb::Sample> {
    (0..3)
        .map(|i| sample(i, gpus.clone(), vec![allocator.clone()]))
        .collect()
}

fn reading(
    ordinal: i32,
    uuid: &str,
    allocated: u64,
    reserved: u64,
    total: u64,
) -> pb::AllocatorStats {
    pb::AllocatorStats {
        device: ordinal,
        device_uuid: uuid.into(),
        allocated_bytes: allocated,
        reserved_bytes: reserved,
        driver_total_bytes: total,
        ..Default::default()
    }
}

fn in_process(hello: pb::Hello, samples: Vec<pb::Sample>, oom: pb::Event) -> Evidence {
    let t = oom.time_ns;
    Evidence {
        hello: Some(hello),
        samples,
        events: vec![oom],
        incident: incident("oom", t),
        ..Default::default()
    }
}

/// An H100's OOM with 6 GiB cached but split: 2 GiB asked, 71.5 GiB live,
/// this process holding `ours` in NVML's count.
fn split_cache_oom(ordinal: i32, ours: u64) -> TorchOom {
    TorchOom {
        ordinal,
        requested: 2 * GIB,
        total: gib(79.19),
        free: gib(1.0625),
        processes: vec![Named::This(Some(ours))],
        allocated: gib(71.5),
        unallocated: 6 * GIB,
    }
}

/// Four H100s; another user's job (pid 9999) holds 60 GiB on NVML GPU 0;
/// this server runs on NVML GPU 3 as its ordinal 0 (the agent could not
/// read the device's uuid) and fails with 6 GiB cached but split.
fn visible_devices_3(env: Option<&str>) -> Evidence {
    let ours = gib(78.125);
    let gpus = vec![
        on(
            nvml(0, H100_UUIDS[0], H100, H100_NVML_TOTAL, gib(60.5)),
            &[(9999, Some(60 * GIB), PidView::Visible)],
        ),
        nvml(1, H100_UUIDS[1], H100, H100_NVML_TOTAL, gib(0.5)),
        nvml(2, H100_UUIDS[2], H100, H100_NVML_TOTAL, gib(0.5)),
        on(
            nvml(3, H100_UUIDS[3], H100, H100_NVML_TOTAL, ours),
            &[(AGENT_PID, Some(ours), PidView::Own)],
        ),
    ];
    let oom = split_cache_oom(0, ours);
    let samples = steady(
        gpus.clone(),
        reading(0, "", gib(71.5), gib(77.5), gib(79.19)),
    );
    in_process(
        server_hello(AGENT_PID, env, &gpus),
        samples,
        oom.event(T0 + 3 * SEC, ""),
    )
}

/// A container on one H100: the server is pid 7 in its namespace, NVML
/// reports its host pid 3141592 with its 78.99 GiB, and PyTorch's text,
/// not finding its own pid among NVML's, names it as another process.
fn container(view: PidView, agent_reads_uuid: bool) -> Evidence {
    let ours = gib(78.99);
    let uuid = if agent_reads_uuid { H100_UUIDS[0] } else { "" };
    let gpu = on(
        nvml(0, H100_UUIDS[0], H100, H100_NVML_TOTAL, gib(79.2)),
        &[(CONTAINER_HOST_PID, Some(ours), view)],
    );
    let oom = TorchOom {
        ordinal: 0,
        requested: gib(1.5),
        total: gib(79.19),
        free: 180 * MIB,
        processes: vec![Named::Pid(CONTAINER_HOST_PID, Some(ours))],
        allocated: gib(72.3),
        unallocated: 6 * GIB,
    };
    let samples = steady(
        vec![gpu.clone()],
        reading(0, uuid, gib(72.3), gib(78.3), gib(79.19)),
    );
    in_process(
        server_hello(7, None, std::slice::from_ref(&gpu)),
        samples,
        oom.event(T0 + 3 * SEC, uuid),
    )
}

const NEIGHBOUR_HOST_PID: u32 = 2_718_281;

/// Two containers share one H100: this server (pid 7 inside, 3141592 on
/// the host) holds 40.5 GiB, another container's job (2718281) 38 GiB; the
/// agent can resolve neither host pid.
fn two_containers() -> Evidence {
    let ours = gib(40.5);
    let gpu = on(
        nvml(0, H100_UUIDS[0], H100, H100_NVML_TOTAL, gib(79.0)),
        &[
            (CONTAINER_HOST_PID, Some(ours), PidView::Unresolved),
            (NEIGHBOUR_HOST_PID, Some(38 * GIB), PidView::Unresolved),
        ],
    );
    let oom = TorchOom {
        ordinal: 0,
        requested: 2 * GIB,
        total: gib(79.19),
        free: 190 * MIB,
        processes: vec![
            Named::Pid(CONTAINER_HOST_PID, Some(ours)),
            Named::Pid(NEIGHBOUR_HOST_PID, Some(38 * GIB)),
        ],
        allocated: 39 * GIB,
        unallocated: GIB,
    };
    let samples = steady(
        vec![gpu.clone()],
        reading(0, H100_UUIDS[0], 39 * GIB, 40 * GIB, gib(79.19)),
    );
    in_process(
        server_hello(7, None, std::slice::from_ref(&gpu)),
        samples,
        oom.event(T0 + 3 * SEC, H100_UUIDS[0]),
    )
}

fn container_says_why(d: &pb::Diagnosis) {
    assert!(d.causes.iter().all(|c| c.kind != "other_process"));
    has(
        &d.evidence,
        "NVML's pids are not resolvable in this process's PID namespace",
    );
    has(
        &d.evidence,
        "pid 3141592 (79.0 GiB) matches this process's own 78.3 GiB (reserved by PyTorch): it is this process",
    );
}

/// `oomscope run` over a worker on four H100s: only its stderr tells the
/// failure ("GPU 2 has a total capacity"); NVML, read by the supervisor,
/// lists the child on GPU 2 and a 50 GiB job (pid 5000) on GPU 0.
fn supervised_gpu_2() -> Evidence {
    let ours = gib(78.125);
    let gpus = vec![
        on(
            nvml(0, H100_UUIDS[0], H100, H100_NVML_TOTAL, gib(50.5)),
            &[(5000, Some(50 * GIB), PidView::Unspecified)],
        ),
        nvml(1, H100_UUIDS[1], H100, H100_NVML_TOTAL, gib(0.5)),
        on(
            nvml(2, H100_UUIDS[2], H100, H100_NVML_TOTAL, ours),
            &[(CHILD_PID, Some(ours), PidView::Unspecified)],
        ),
        nvml(3, H100_UUIDS[3], H100, H100_NVML_TOTAL, gib(0.5)),
    ];
    let text = split_cache_oom(2, ours).text();
    let stderr = format!(
        "Traceback (most recent call last):\n  File \"/app/train.py\", line 88, in <module>\n    logits = model(batch)\ntorch.OutOfMemoryError: {text}\n"
    );
    let (before, after) = (
        counters(T0, vec![], system(3, 12 * GIB)),
        counters(T0 + 3 * SEC, vec![], system(3, 12 * GIB)),
    );
    let mut e = supervised(
        exit(Some(1), None, &stderr, before, after, None),
        "exit_oom_text",
    );
    let mut h = e.hello.take().unwrap();
    h.gpus = placements(&gpus);
    e.hello = Some(h);
    e.samples = (0..3).map(|i| sample(i, gpus.clone(), vec![])).collect();
    e
}

/// An A100 split into MIG instances: the server loads a 14 GiB model into
/// its 1g.10gb slice (9.5 GiB) and fails; another tenant's process (pid
/// 8123) fills the other slice. NVML gives no per-process usage under MIG.
fn mig_slice() -> Evidence {
    let parent = nvml(0, A100_UUID, A100, 80 * GIB, gib(17.4));
    let slice = |uuid: &str, used: u64, pid: u32| {
        let mut g = on(
            nvml(
                0,
                uuid,
                "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
                MIG_TOTAL,
                used,
            ),
            &[(pid, None, PidView::Visible)],
        );
        g.parent_uuid = A100_UUID.into();
        g
    };
    let mut ours = slice(MIG_OURS, gib(8.9), AGENT_PID);
    ours.processes[0].view = PidView::Own as i32;
    let gpus = vec![parent, ours, slice(MIG_OTHER, gib(8.5), MIG_NEIGHBOUR)];
    let cuda_total = gib(9.5);
    let oom = TorchOom {
        ordinal: 0,
        requested: GIB,
        total: cuda_total,
        free: 712 * MIB,
        // PyTorch asks NVML about the parent GPU: every slice's process,
        // none with a usage.
        processes: vec![Named::Pid(MIG_NEIGHBOUR, None), Named::This(None)],
        allocated: gib(8.3125),
        unallocated: 6 * MIB,
    };
    let load_ctx = |loaded: u64| pb::RequestContext {
        phase: "load".into(),
        loaded_bytes: loaded,
        ..Default::default()
    };
    let samples: Vec<pb::Sample> = [4 * GIB, 8 * GIB]
        .iter()
        .enumerate()
        .map(|(i, &loaded)| {
            let mut s = sample(
                i as i64 + 1,
                gpus.clone(),
                vec![reading(0, MIG_OURS, loaded, loaded, cuda_total)],
            );
            s.context = Some(load_ctx(loaded));
            s
        })
        .collect();
    let load_start = pb::Event {
        time_ns: T0,
        kind: Some(Kind::Phase(pb::Phase {
            name: "load".into(),
            start: true,
            model: Some(pb::Model {
                name: "meta-llama/Llama-2-7b-hf".into(),
                dtype: "float16".into(),
                bytes: 14 * GIB,
                ..Default::default()
            }),
            ..Default::default()
        })),
    };
    let mut e = in_process(
        server_hello(AGENT_PID, Some(MIG_OURS), &gpus),
        samples,
        oom.event(T0 + 3 * SEC, MIG_OURS),
    );
    e.events.insert(0, load_start);
    e
}

/// The same slice as a Rust binary's agent reads it: cuDeviceGetUuid_v2
/// gives the instance's 16 bytes, which it writes with the "GPU-" prefix
/// (the driver API does not say the device is a MIG instance).
fn mig_slice_driver_api() -> Evidence {
    let as_driver = MIG_OURS.replacen("MIG-", "GPU-", 1);
    let mut e = mig_slice();
    for p in e.hello.iter_mut().flat_map(|h| h.gpus.iter_mut()) {
        if p.uuid == MIG_OURS {
            p.uuid.clone_from(&as_driver);
            p.parent_uuid.clear();
        }
    }
    for a in e.samples.iter_mut().flat_map(|s| s.allocator.iter_mut()) {
        a.device_uuid.clone_from(&as_driver);
    }
    for ev in &mut e.events {
        if let Some(Kind::Oom(o)) = &mut ev.kind {
            o.device_uuid.clone_from(&as_driver);
            if let Some(st) = o.stats.as_mut() {
                st.device_uuid.clone_from(&as_driver);
            }
        }
    }
    e
}

/// One A100 shared with pid 8888, NVML giving neither process's usage (a
/// driver that answers "not available"): 79.5 GiB used of the device, this
/// process's allocator holds 36 GiB, so about 43.5 GiB is the neighbour's.
fn usage_unavailable() -> Evidence {
    let gpu = on(
        nvml(0, A100_UUID, A100, 80 * GIB, gib(79.5)),
        &[
            (AGENT_PID, None, PidView::Own),
            (8888, None, PidView::Visible),
        ],
    );
    let oom = TorchOom {
        ordinal: 0,
        requested: 4 * GIB,
        total: gib(79.25),
        free: 500 * MIB,
        processes: vec![Named::This(None), Named::Pid(8888, None)],
        allocated: gib(35.5),
        unallocated: 512 * MIB,
    };
    let samples = steady(
        vec![gpu.clone()],
        reading(0, A100_UUID, gib(35.5), 36 * GIB, gib(79.25)),
    );
    in_process(
        server_hello(AGENT_PID, None, std::slice::from_ref(&gpu)),
        samples,
        oom.event(T0 + 3 * SEC, A100_UUID),
    )
}

// ---- checks ----

fn all_lines(d: &pb::Diagnosis) -> impl Iterator<Item = &String> {
    d.evidence
        .iter()
        .chain(d.causes.iter().flat_map(|c| c.evidence.iter()))
        .chain(d.fixes.iter().map(|f| &f.action))
}

/// No cause names the pid, no line says it holds memory, no fix asks about it.
fn assert_not_blamed(d: &pb::Diagnosis, pid: u32, row: &str) {
    for c in &d.causes {
        assert!(
            c.processes.iter().all(|p| p.pid != pid),
            "{row}: {} names pid {pid}: {:#?}",
            c.kind,
            c.processes
        );
    }
    let holds = format!("pid {pid} holds");
    let of_pid = format!("pid {pid}");
    for line in all_lines(d) {
        assert!(!line.contains(&holds), "{row}: {line}");
        assert!(
            !(line.contains("Ask the owners") && line.contains(&of_pid)),
            "{row}: {line}"
        );
    }
}
