//! GPU memory PyTorch's caching allocator does not explain, and allocators
//! other than the native one, on evidence shaped like the deployments that
//! show them: memory outside PyTorch (per process, never the device's use
//! minus reserved), cudaMallocAsync's own message and missing counters, no
//! NVML with vLLM's KV text (and the same text from vLLM's CPU build), and a
//! CUDA graph's private pool. One row each; every row checks the domain, the
//! first cause with its numbers, and that nobody else is blamed.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const OWN_PID: u32 = 4200;
/// Another user's job, on another GPU or beside us: never to blame here.
const NEIGHBOUR_PID: u32 = 9999;
const GPU0: &str = "GPU-5e0b6c3a-0f7a-4d5e-9a51-0c2c1c6f9e01";
const GPU1: &str = "GPU-8d1f2e4b-7a6c-4b3d-8e2f-1a9b0c7d6e02";

fn gib(x: f64) -> u64 {
    (x * GIB as f64).round() as u64
}

/// PyTorch's native message, as torch 2.11 prints it (the H200 captures'
/// shape), with these figures in its two-decimal units.
fn native_text(
    request: &str,
    total: &str,
    free: &str,
    this_process: Option<&str>,
    allocated: &str,
    unallocated: &str,
) -> String {
    let process = this_process.map_or(String::new(), |p| {
        format!("Including non-PyTorch memory, this process has {p} memory in use. ")
    });
    format!(
        "CUDA out of memory. Tried to allocate {request}. GPU 0 has a total capacity of {total} of which {free} is free. {process}Of the allocated memory {allocated} is allocated by PyTorch, and {unallocated} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    )
}

/// A PyTorch server's own agent on GPU 0 (80 GiB) of a two-GPU host.
fn server_hello() -> pb::Hello {
    let mut h = hello();
    h.pid = OWN_PID;
    h.role = "server".into();
    h.runtime = "pytorch".into();
    h.command = vec!["python3".into(), "serve.py".into()];
    h.versions = [("torch", "2.11.0"), ("cuda", "13.0")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    h.gpus.push(pb::GpuPlacement {
        index: 0,
        uuid: GPU0.into(),
        total_bytes: 80 * GIB,
        ordinal: Some(0),
        ..Default::default()
    });
    h
}

/// The native allocator's stats at a reading: a real memory_stats() has
/// segments wherever it has reserved bytes.
fn native_stats(allocated: u64, reserved: u64, free: u64) -> pb::AllocatorStats {
    pb::AllocatorStats {
        device: 0,
        device_uuid: GPU0.into(),
        allocated_bytes: allocated,
        reserved_bytes: reserved,
        segments: 40,
        driver_free_bytes: free,
        driver_total_bytes: 80 * GIB,
        raw: [("segment.all.current".to_string(), 40)].into(),
        ..Default::default()
    }
}

fn usage(pid: u32, used: u64, view: pb::PidView) -> pb::GpuProcessUsage {
    pb::GpuProcessUsage {
        pid,
        used_bytes: Some(used),
        view: view as i32,
    }
}

fn gpu(index: i32, uuid: &str, used: u64, processes: Vec<pb::GpuProcessUsage>) -> pb::GpuDevice {
    pb::GpuDevice {
        index,
        uuid: uuid.into(),
        name: "NVIDIA H100 80GB HBM3".into(),
        total_bytes: 80 * GIB,
        used_bytes: used,
        free_bytes: 80 * GIB - used,
        processes,
        ..Default::default()
    }
}

fn oom_at(t: i64, oom: pb::Oom, hello: pb::Hello, samples: Vec<pb::Sample>) -> Evidence {
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello),
        samples,
        events: vec![pb::Event {
            time_ns: t,
            kind: Some(Kind::Oom(oom)),
        }],
        incident: incident("oom", t),
    }
}

/// 6 GiB outside PyTorch on an 80 GiB GPU, in PyTorch's own words: 79.5 GiB
/// in use by the process, 73.5 GiB reserved (73 allocated); a 2 GiB request
/// meets 512 MiB free. Another user's 60 GiB job runs on GPU 1.
fn outside_in_the_text() -> Evidence {
    let t = T0 + 10 * SEC;
    let sample = pb::Sample {
        time_ns: t - SEC,
        gpus: vec![
            gpu(
                0,
                GPU0,
                gib(79.5),
                vec![usage(OWN_PID, gib(79.5), pb::PidView::Own)],
            ),
            gpu(
                1,
                GPU1,
                60 * GIB,
                vec![usage(NEIGHBOUR_PID, 60 * GIB, pb::PidView::Visible)],
            ),
        ],
        allocator: vec![native_stats(70 * GIB, gib(73.5), gib(0.5))],
        ..Default::default()
    };
    let oom = pb::Oom {
        device: 0,
        device_uuid: GPU0.into(),
        requested_bytes: 2 * GIB,
        observer: Some(pb::OomObserver {
            device: 0,
            alloc: 2 * GIB as i64,
            device_allocated: 80 * GIB as i64,
            device_free: gib(0.5) as i64,
        }),
        error_type: "torch.OutOfMemoryError".into(),
        error_text: native_text(
            "2.00 GiB",
            "80.00 GiB",
            "512.00 MiB",
            Some("79.50 GiB"),
            "73.00 GiB",
            "512.00 MiB",
        ),
        stats: Some(native_stats(73 * GIB, gib(73.5), gib(0.5))),
        ..Default::default()
    };
    oom_at(t, oom, server_hello(), vec![sample])
}

/// The same 6 GiB read from NVML, not from the text (PyTorch's message
/// without its per-process line): the process uses 77 GiB of GPU 0 with
/// 71 GiB reserved; a neighbour's 2.5 GiB on the same GPU is not ours, so
/// the device's use minus reserved (8.5 GiB) would overstate it.
fn outside_from_nvml() -> Evidence {
    let t = T0 + 10 * SEC;
    let sample = pb::Sample {
        time_ns: t - SEC,
        gpus: vec![gpu(
            0,
            GPU0,
            gib(79.5),
            vec![
                usage(OWN_PID, 77 * GIB, pb::PidView::Own),
                usage(NEIGHBOUR_PID, gib(2.5), pb::PidView::Visible),
            ],
        )],
        allocator: vec![native_stats(70 * GIB, 71 * GIB, gib(0.5))],
        ..Default::default()
    };
    let oom = pb::Oom {
        device: 0,
        device_uuid: GPU0.into(),
        requested_bytes: 2 * GIB,
        error_type: "torch.OutOfMemoryError".into(),
        error_text: native_text(
            "2.00 GiB",
            "80.00 GiB",
            "512.00 MiB",
            None,
            "70.50 GiB",
            "512.00 MiB",
        ),
        stats: Some(native_stats(gib(70.5), 71 * GIB, gib(0.5))),
        ..Default::default()
    };
    oom_at(t, oom, server_hello(), vec![sample])
}

/// cudaMallocAsync's message, as ComfyUI users post it (c10/cuda/
/// CUDAMallocAsyncAllocator.cpp: "Allocation on device … would exceed
/// allowed memory. (out of memory)\nCurrently allocated     : …\nRequested
/// : …\nDevice limit : …\nFree (according to CUDA): …"). The observer cannot
/// attach under that backend, so the event carries no request of its own;
/// its stats are what that backend keeps: allocated, active and the pool's
/// reserved bytes, every segment, split and retry counter at 0.
const ASYNC_TEXT: &str = "Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 9.43 GiB\nRequested               : 640.00 MiB\nDevice limit            : 11.59 GiB\nFree (according to CUDA): 7.12 MiB\nPyTorch limit (set by user-supplied memory fraction)\n                        : 17179869184.00 GiB";

fn async_stats(allocated: u64, pool: u64) -> pb::AllocatorStats {
    let raw = [
        ("allocated_bytes.all.current", allocated),
        ("active_bytes.all.current", allocated),
        ("reserved_bytes.all.current", pool),
        ("segment.all.current", 0),
        ("inactive_split_bytes.all.current", 0),
        ("num_alloc_retries", 0),
        ("num_device_alloc", 0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v as i64))
    .collect();
    pb::AllocatorStats {
        device: 0,
        allocated_bytes: allocated,
        active_bytes: allocated,
        reserved_bytes: pool,
        driver_free_bytes: gib(7.12 / 1024.0),
        driver_total_bytes: gib(11.59),
        raw,
        ..Default::default()
    }
}

/// The pool holds `pool` for 9.43 GiB handed out.
fn async_oom(pool: u64) -> Evidence {
    let t = T0 + 5 * SEC;
    let mut h = server_hello();
    h.gpus[0].total_bytes = gib(11.59);
    h.allocator_settings = Some(pb::AllocatorSettings {
        backend: "cudaMallocAsync".into(),
        alloc_conf: "backend:cudaMallocAsync".into(),
        ..Default::default()
    });
    let oom = pb::Oom {
        device: 0,
        error_type: "torch.OutOfMemoryError".into(),
        error_text: ASYNC_TEXT.into(),
        stats: Some(async_stats(gib(9.43), pool)),
        ..Default::default()
    };
    oom_at(t, oom, h, Vec::new())
}

const VLLM_NO_ROOM: &str = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.\n";

/// `oomscope run vllm serve …` where NVML cannot be read
/// (NVIDIA_DRIVER_CAPABILITIES=compute): no device reading at all, only
/// what the supervisor's Hello and the worker's say.
fn vllm_without_nvml(configure: impl Fn(&mut pb::Hello, &mut Vec<Evidence>)) -> Evidence {
    let levels = vec![v1(
        "/oomtest/child",
        V1_UNLIMITED,
        900 * MIB,
        950 * MIB,
        0,
        0,
    )];
    let mut h = hello();
    h.command = [
        "vllm",
        "serve",
        "/models/llama",
        "--gpu-memory-utilization",
        "0.9",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let mut members = Vec::new();
    configure(&mut h, &mut members);
    Evidence {
        members,
        ended: false,
        hello: Some(h),
        samples: Vec::new(),
        events: vec![exit(
            Some(1),
            None,
            VLLM_NO_ROOM,
            counters(T0, levels.clone(), system(3, 12 * GIB)),
            counters(T0 + 3 * SEC, levels, system(3, 12 * GIB)),
            None,
        )],
        incident: incident("exit_oom_text", T0 + 3 * SEC),
    }
}

/// A worker's agent (the vLLM plugin), pid 4300, with these versions.
fn worker(versions: &[(&str, &str)]) -> Evidence {
    let h = pb::Hello {
        pid: 4300,
        role: "worker".into(),
        runtime: "vllm".into(),
        versions: versions
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    Evidence {
        hello: Some(h),
        ..Default::default()
    }
}

/// A server that captured CUDA graphs: at the OOM its snapshot holds
/// 10 GiB reserved, of which a graph's private pool is 2 GiB with 1.5 GiB
/// free for its replays, and `general_free` free in the general pool.
fn graph_pool(general_free: u64) -> Evidence {
    let t = T0 + 10 * SEC;
    let reserved = 10 * GIB;
    let allocated = reserved - gib(1.5) - general_free;
    let snapshot = pb::SnapshotSummary {
        device: 0,
        segments: 12,
        reserved_bytes: reserved,
        allocated_bytes: allocated,
        largest_free_block_bytes: general_free / 2,
        private_pool_reserved_bytes: 2 * GIB,
        private_pool_free_bytes: gib(1.5),
        ..Default::default()
    };
    let mut h = server_hello();
    h.gpus[0].cap_bytes = 10 * GIB;
    let oom = pb::Oom {
        device: 0,
        device_uuid: GPU0.into(),
        requested_bytes: GIB,
        error_type: "torch.OutOfMemoryError".into(),
        stats: Some(native_stats(allocated, reserved, 60 * GIB)),
        snapshot: Some(snapshot),
        ..Default::default()
    };
    oom_at(t, oom, h, Vec::new())
}

struct Row {
    name: &'static str,
    evidence: Evidence,
    domain: &'static str,
    /// The first cause and the numbers behind it; None where nothing explains it.
    first: Option<(&'static str, Vec<(&'static str, f64)>)>,
    /// Lines of the first cause's evidence or the verdict's.
    says: Vec<&'static str>,
    /// Causes that must not be concluded.
    not_causes: Vec<&'static str>,
    /// Fix actions that must be offered (fragments of them).
    fixes: Vec<&'static str>,
}

fn rows() -> Vec<Row> {
    vec![
        Row {
            name: "6 GiB outside PyTorch on an 80 GiB GPU, from PyTorch's text",
            evidence: outside_in_the_text(),
            domain: "gpu_vram",
            first: Some((
                "non_pytorch_memory",
                vec![
                    ("non_pytorch_bytes", (6 * GIB) as f64),
                    ("requested_bytes", (2 * GIB) as f64),
                    ("free_bytes", gib(0.5) as f64),
                    ("lacked_bytes", gib(1.5) as f64),
                    ("process_bytes", gib(79.5) as f64),
                    ("reserved_bytes", gib(73.5) as f64),
                ],
            )),
            says: vec![
                "this process held 6.0 GiB (6442450944 bytes) on GPU 0 (GPU-5e0b6c3a-0f7a-4d5e-9a51-0c2c1c6f9e01) outside PyTorch's caching allocator: 79.5 GiB in use by the process (PyTorch's message",
                "it lacked 1.5 GiB, less than the 6.0 GiB outside PyTorch",
            ],
            not_causes: vec!["fragmentation", "other_process"],
            fixes: vec!["capture fewer batch sizes", "`NCCL_BUFFSIZE`", "`CUBLAS_WORKSPACE_CONFIG`"],
        },
        Row {
            name: "6 GiB outside PyTorch, from NVML's reading of this process",
            evidence: outside_from_nvml(),
            domain: "gpu_vram",
            first: Some((
                "non_pytorch_memory",
                vec![
                    ("non_pytorch_bytes", (6 * GIB) as f64),
                    ("process_bytes", (77 * GIB) as f64),
                    ("reserved_bytes", (71 * GIB) as f64),
                    ("lacked_bytes", gib(1.5) as f64),
                ],
            )),
            says: vec!["77.0 GiB in use by the process (NVML's reading of pid 4200) − 71.0 GiB reserved by PyTorch"],
            not_causes: vec!["fragmentation", "other_process"],
            fixes: vec![],
        },
        Row {
            name: "cudaMallocAsync: its message, its pool, no counters",
            evidence: async_oom(gib(11.2)),
            domain: "gpu_vram",
            first: Some((
                "fragmentation",
                vec![
                    ("request_bytes", (640 * MIB) as f64),
                    ("reserved_unallocated_bytes", (gib(11.2) - gib(9.43)) as f64),
                    ("cuda_malloc_async", 1.0),
                ],
            )),
            says: vec![
                "1.8 GiB the cudaMallocAsync pool held (11.2 GiB reserved, 9.4 GiB allocated), more than the 640.0 MiB request",
                "backend:cudaMallocAsync keeps no segment, split or retry counters",
            ],
            not_causes: vec!["non_pytorch_memory", "other_process"],
            fixes: vec!["backend:cudaMallocAsync ignores expandable_segments and max_split_size_mb"],
        },
        Row {
            name: "no NVML, vLLM's KV text, CUDA_VISIBLE_DEVICES in the supervisor's Hello",
            evidence: vllm_without_nvml(|h, _| h.cuda_visible_devices = Some("0".into())),
            domain: "gpu_vram",
            first: Some(("kv_no_room", vec![])),
            says: vec!["no NVML reading; a GPU is in use: CUDA_VISIBLE_DEVICES=0"],
            not_causes: vec!["other_process"],
            fixes: vec!["raise gpu_memory_utilization where the device is not shared"],
        },
        Row {
            name: "no NVML, vLLM's KV text, the worker's agent placed its device through torch",
            evidence: vllm_without_nvml(|_, m| {
                let mut w = worker(&[("torch", "2.9.0+cu128"), ("cuda", "12.8")]);
                if let Some(h) = w.hello.as_mut() {
                    h.gpus.push(pb::GpuPlacement {
                        index: -1,
                        uuid: "GPU-5e3a1c9d-8f21-4b7e-a0c4-2d9f6b1e7a30".into(),
                        ordinal: Some(0),
                        ..Default::default()
                    });
                }
                m.push(w)
            }),
            domain: "gpu_vram",
            first: Some(("kv_no_room", vec![])),
            says: vec!["no NVML reading; a GPU is in use: the agent announced its GPUs (pid 4300, worker)"],
            not_causes: vec!["other_process"],
            fixes: vec![],
        },
        Row {
            name: "vLLM's CPU build: the same text is host RAM",
            evidence: vllm_without_nvml(|h, m| {
                h.labels.insert("env.VLLM_CPU_KVCACHE_SPACE".into(), "4".into());
                // CUDA's way of hiding every device is no device.
                h.labels.insert("env.CUDA_VISIBLE_DEVICES".into(), "-1".into());
                m.push(worker(&[("torch", "2.9.0+cpu")]));
            }),
            domain: "host_ram",
            first: Some(("kv_no_room", vec![])),
            says: vec![],
            not_causes: vec!["other_process"],
            fixes: vec![],
        },
        Row {
            name: "a CUDA graph's private pool beside a split general pool",
            evidence: graph_pool(gib(1.25)),
            domain: "gpu_vram",
            first: Some((
                "fragmentation",
                vec![
                    ("request_bytes", GIB as f64),
                    // The general pool's free bytes only, not the graph's 1.5 GiB.
                    ("reserved_unallocated_bytes", gib(1.25) as f64),
                    ("private_pool_free_bytes", gib(1.5) as f64),
                ],
            )),
            says: vec!["1.5 GiB more was free in private pools (CUDA graphs, MemPool): held for their owners, not fragmentation"],
            not_causes: vec!["non_pytorch_memory", "other_process"],
            fixes: vec![],
        },
        Row {
            name: "a CUDA graph's private pool is all the free space there is",
            evidence: graph_pool(gib(0.25)),
            domain: "gpu_vram",
            first: None,
            says: vec!["device OOM on GPU 0: requested 1.0 GiB"],
            not_causes: vec!["fragmentation", "non_pytorch_memory", "other_process"],
            fixes: vec![],
        },
    ]
}

#[test]
fn each_deployment_gets_its_domain_first_cause_and_no_wrong_blame() {
    for row in rows() {
        let name = row.name;
        let d = diagnose(&row.evidence);
        assert_eq!(
            d.domain.as_deref(),
            Some(row.domain),
            "{name}: {:#?}",
            d.evidence
        );
        match &row.first {
            Some((kind, metrics)) => {
                let c = d
                    .causes
                    .first()
                    .unwrap_or_else(|| panic!("{name}: no cause in {:#?}", d.evidence));
                assert_eq!(c.kind, *kind, "{name}: {:#?}", d.causes);
                for (metric, want) in metrics {
                    assert_eq!(
                        c.metrics.get(*metric),
                        Some(want),
                        "{name}: {metric} in {:?}",
                        c.metrics
                    );
                }
            }
            None => assert!(d.causes.is_empty(), "{name}: {:#?}", d.causes),
        }
        let lines: Vec<&String> = d
            .causes
            .iter()
            .take(1)
            .flat_map(|c| &c.evidence)
            .chain(&d.evidence)
            .collect();
        for line in &row.says {
            assert!(
                lines.iter().any(|l| l.contains(line)),
                "{name}: no {line:?} in {lines:#?}"
            );
        }
        for kind in &row.not_causes {
            assert!(
                d.causes.iter().all(|c| c.kind != *kind),
                "{name}: {kind} concluded: {:#?}",
                d.causes
            );
        }
        // Nobody is blamed who is not to blame: the neighbour is named nowhere.
        let neighbour = format!("pid {NEIGHBOUR_PID}");
        for c in &d.causes {
            assert!(
                c.processes.iter().all(|p| p.pid != NEIGHBOUR_PID),
                "{name}: {c:#?}"
            );
            assert!(
                c.evidence.iter().all(|l| !l.contains(&neighbour)),
                "{name}: {c:#?}"
            );
        }
        for fix in &row.fixes {
            assert!(
                d.fixes.iter().any(|f| f.action.contains(fix)),
                "{name}: no fix with {fix:?} in {:#?}",
                d.fixes
            );
        }
        for f in &d.fixes {
            assert!(!f.retest.is_empty(), "{name}: {f:?}");
        }
    }
}

#[test]
fn the_json_carries_the_bytes_outside_pytorch() {
    let json = to_json(&diagnose(&outside_in_the_text()));
    let metrics = &json["causes"][0]["metrics"];
    assert_eq!(json["causes"][0]["kind"], "non_pytorch_memory");
    assert_eq!(metrics["non_pytorch_bytes"], 6 * GIB);
    assert_eq!(metrics["requested_bytes"], 2 * GIB);
    assert_eq!(metrics["free_bytes"], gib(0.5));
}

#[test]
fn memory_outside_that_does_not_cover_the_shortfall_is_no_cause() {
    // 1 GiB outside PyTorch (80.00 in use, 79.00 reserved), a 2 GiB request
    // with 0 free: it lacked 2 GiB, more than what lies outside.
    let mut e = outside_in_the_text();
    if let Some(Kind::Oom(o)) = &mut e.events[0].kind {
        o.error_text = native_text(
            "2.00 GiB",
            "80.00 GiB",
            "0 bytes",
            Some("80.00 GiB"),
            "78.50 GiB",
            "512.00 MiB",
        );
        o.observer = None;
    }
    let d = diagnose(&e);
    assert!(
        d.causes.iter().all(|c| c.kind != "non_pytorch_memory"),
        "{:#?}",
        d.causes
    );
}

#[test]
fn a_contexts_worth_outside_is_a_fact_not_the_story() {
    // 0.5 GiB outside PyTorch (a bare context) covers a 256 MiB shortfall:
    // it explains the failure, but there is nothing to give back.
    let mut e = outside_in_the_text();
    if let Some(Kind::Oom(o)) = &mut e.events[0].kind {
        o.requested_bytes = 768 * MIB;
        o.observer = None;
        o.error_text = native_text(
            "768.00 MiB",
            "80.00 GiB",
            "512.00 MiB",
            Some("79.50 GiB"),
            "78.50 GiB",
            "512.00 MiB",
        );
    }
    let d = diagnose(&e);
    let c = d
        .causes
        .iter()
        .find(|c| c.kind == "non_pytorch_memory")
        .unwrap_or_else(|| panic!("{:#?}", d.causes));
    assert_eq!(c.metrics["non_pytorch_bytes"], (512 * MIB) as f64);
    assert_eq!(c.metrics["lacked_bytes"], (256 * MIB) as f64);
    assert!(c.confidence < 0.3, "{}", c.confidence);
    assert!(c
        .evidence
        .iter()
        .any(|l| l.contains("about a CUDA context's worth")));
    // Nothing to give back: no fix for it.
    assert!(
        d.fixes.iter().all(|f| !f.action.contains("NCCL_BUFFSIZE")),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn without_the_process_figure_nothing_is_measured() {
    // NVML lists this process on two GPUs and the OOM names no uuid: which
    // reading is the failing device's is unknown, so nothing is measured
    // (and the device's use minus reserved is never taken instead).
    let mut e = outside_from_nvml();
    if let Some(Kind::Oom(o)) = &mut e.events[0].kind {
        o.device_uuid.clear();
    }
    let s = &mut e.samples[0];
    s.gpus.push(gpu(
        1,
        GPU1,
        3 * GIB,
        vec![usage(OWN_PID, 3 * GIB, pb::PidView::Own)],
    ));
    let d = diagnose(&e);
    assert!(
        d.causes.iter().all(|c| c.kind != "non_pytorch_memory"),
        "{:#?}",
        d.causes
    );

    // An unresolved pid (another PID namespace) is not this process by number.
    let mut e = outside_from_nvml();
    e.samples[0].gpus[0].processes[0].view = pb::PidView::Unresolved as i32;
    let d = diagnose(&e);
    assert!(
        d.causes.iter().all(|c| c.kind != "non_pytorch_memory"),
        "{:#?}",
        d.causes
    );
}

#[test]
fn cuda_malloc_async_with_a_pool_too_small_concludes_no_fragmentation() {
    // The pool holds 0.3 GiB beside 9.43 GiB handed out: less than the
    // 640 MiB request, and the zero split and retry counters add nothing.
    let d = diagnose(&async_oom(gib(9.73)));
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    assert!(
        d.causes.iter().all(|c| c.kind != "fragmentation"),
        "{:#?}",
        d.causes
    );
    // The request comes from the message ("Requested : 640.00 MiB").
    assert_eq!(
        d.failure.as_ref().and_then(|f| f.requested_bytes),
        Some(640 * MIB)
    );
    assert!(
        d.evidence
            .iter()
            .any(|l| l.contains("Allocation on device 0 would exceed allowed memory")),
        "{:#?}",
        d.evidence
    );
}

#[test]
fn the_backend_is_recognised_from_its_stats_alone() {
    // No Hello settings, the native wording absent from the event: a
    // memory_stats() with bytes reserved and no segment is cudaMallocAsync's.
    let mut e = async_oom(gib(11.2));
    e.hello.as_mut().unwrap().allocator_settings = None;
    if let Some(Kind::Oom(o)) = &mut e.events[0].kind {
        o.requested_bytes = 640 * MIB;
        o.error_text.clear();
    }
    let d = diagnose(&e);
    let c = &d.causes[0];
    assert_eq!(c.kind, "fragmentation");
    assert_eq!(c.metrics.get("cuda_malloc_async"), Some(&1.0));
    assert!(
        !c.metrics.contains_key("inactive_split_bytes"),
        "{:?}",
        c.metrics
    );
    assert!(
        !c.metrics.contains_key("num_alloc_retries"),
        "{:?}",
        c.metrics
    );

    // The native allocator under expandable segments reads 0 segments too
    // (the H200 capture: segment.all.current 0, num_device_alloc 100), but
    // counts its device allocations: not that backend.
    if let Some(Kind::Oom(o)) = &mut e.events[0].kind {
        let stats = o.stats.as_mut().unwrap();
        stats.raw.insert("num_device_alloc".into(), 100);
        stats.num_device_alloc = 100;
    }
    let d = diagnose(&e);
    let c = &d.causes[0];
    assert_eq!(c.kind, "fragmentation");
    assert_eq!(c.metrics.get("cuda_malloc_async"), None, "{:?}", c.metrics);
    assert!(
        c.metrics.contains_key("inactive_split_bytes"),
        "{:?}",
        c.metrics
    );
}

#[test]
fn vllm_is_told_its_own_graph_settings() {
    let mut e = outside_in_the_text();
    let h = e.hello.as_mut().unwrap();
    h.command = [
        "vllm",
        "serve",
        "/models/llama",
        "--tensor-parallel-size",
        "2",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let d = diagnose(&e);
    let c = d
        .causes
        .iter()
        .find(|c| c.kind == "non_pytorch_memory")
        .unwrap_or_else(|| panic!("{:#?}", d.causes));
    assert_eq!(c.metrics["non_pytorch_bytes"], (6 * GIB) as f64);
    let graphs = d
        .fixes
        .iter()
        .find(|f| {
            f.action
                .starts_with("Capture CUDA graphs for fewer batch sizes")
        })
        .unwrap_or_else(|| panic!("{:#?}", d.fixes));
    assert!(
        graphs
            .action
            .contains("`--max-cudagraph-capture-size` (not set)")
            && graphs.action.contains("`--enforce-eager` (not set)"),
        "{}",
        graphs.action
    );
    assert!(
        graphs
            .retest
            .contains("was 6.0 GiB and must fall by more than the 1.5 GiB"),
        "{}",
        graphs.retest
    );

    // Already eager: there are no graphs to capture fewer of.
    e.hello
        .as_mut()
        .unwrap()
        .command
        .push("--enforce-eager".into());
    let d = diagnose(&e);
    assert!(d.causes.iter().any(|c| c.kind == "non_pytorch_memory"));
    assert!(
        d.fixes.iter().all(|f| !f.action.contains("CUDA graphs")),
        "{:#?}",
        d.fixes
    );
    assert!(d.fixes.iter().any(|f| f.action.contains("`NCCL_BUFFSIZE`")));
}
