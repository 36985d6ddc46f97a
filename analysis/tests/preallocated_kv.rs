//! Runtimes that preallocate their KV cache as one pool at start-up (vLLM,
//! SGLang, llama.cpp): the reservation that does not fit, the activation
//! peak beside the pool, memory taken after the pool was sized, a full pool
//! (no failure), and fixes in the runtime's own settings with values
//! computed from the measured figures. The numbers follow the vLLM 0.32 CPU
//! runs of /work/shared/design.md (a 2.71 GiB peak, the Worker killed during
//! the KV `torch.zeros` under a limit 500 MiB below it).

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const API_PID: u32 = 5001;
const ENGINE_PID: u32 = 5002;
const WORKER_PID: u32 = 5003;
const CG: &str = "/oomcap/vllm";

fn argv(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

fn gib(x: f64) -> u64 {
    (x * GIB as f64) as u64
}

/// Every fix has a retest; none suggests killing a process.
fn sound(d: &pb::Diagnosis) {
    for f in &d.fixes {
        assert!(!f.retest.is_empty(), "{f:?}");
        assert!(!f.action.to_lowercase().contains("kill"), "{f:?}");
    }
}

/// `oomscope run`'s Hello for `vllm serve` with `env` recorded as labels.
fn vllm_supervisor(command: &str, env: &[(&str, &str)]) -> pb::Hello {
    let mut h = hello();
    h.command = argv(command);
    for (k, v) in env {
        h.labels.insert(format!("env.{k}"), v.to_string());
    }
    h
}

fn proc_info(pid: u32, title: &str, rss: u64) -> pb::ProcessInfo {
    pb::ProcessInfo {
        pid,
        title: title.into(),
        rss_bytes: rss,
        ..Default::default()
    }
}

/// The supervisor's samples of a vLLM CPU start-up under a cgroup limit:
/// the cgroup's usage at each reading (GiB); the Worker holds what the API
/// server (1.0 GiB) and the engine core (0.5 GiB) do not.
fn startup_samples(limit: u64, usage_gib: &[f64]) -> Vec<pb::Sample> {
    usage_gib
        .iter()
        .enumerate()
        .map(|(i, &u)| {
            let usage = gib(u);
            let api = gib(1.0).min(usage);
            let engine = gib(0.5).min(usage - api);
            pb::Sample {
                time_ns: T0 + i as i64 * SEC / 4,
                cgroup: vec![v2(CG, limit, usage, usage, V2Events::default())],
                system: Some(system(7, 12 * GIB)),
                tree: vec![
                    proc_info(API_PID, "python3", api),
                    proc_info(ENGINE_PID, "VLLM::EngineCore", engine),
                    proc_info(WORKER_PID, "VLLM::Worker", usage - api - engine),
                ],
                tree_rss_bytes: usage,
                ..Default::default()
            }
        })
        .collect()
}

/// The kernel killed VLLM::Worker at the limit, and the API server exited 1.
fn startup_kill(hello: pb::Hello, limit: u64, usage_gib: &[f64]) -> Evidence {
    let samples = startup_samples(limit, usage_gib);
    let kill_ns = samples.last().unwrap().time_ns + SEC / 8;
    let levels = |u| vec![v2(CG, limit, u, u, V2Events::default())];
    let kill = pb::KernelOomKill {
        pid: WORKER_PID,
        task: "VLLM::Worker".into(),
        constraint: "CONSTRAINT_MEMCG".into(),
        oom_memcg: CG.into(),
        task_memcg: CG.into(),
        anon_rss_bytes: gib(1.1),
        memcg_usage_bytes: limit,
        memcg_limit_bytes: limit,
        ..Default::default()
    };
    let exit = pb::ChildExit {
        pid: API_PID,
        exit_code: Some(1),
        stderr_tail: "(EngineCore pid=5002) ERROR Worker proc VllmWorker-0 died unexpectedly (exit code: -9)\nRuntimeError: Engine core initialization failed.\n".into(),
        before: Some(counters(T0, levels(gib(0.1)), system(7, 12 * GIB))),
        after: Some(counters(kill_ns + SEC, levels(gib(0.0)), system(7, 12 * GIB))),
        runtime_ns: (kill_ns + SEC - T0) as u64,
        ..Default::default()
    };
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello),
        samples,
        events: vec![
            pb::Event {
                time_ns: kill_ns,
                kind: Some(Kind::KernelOomKill(kill)),
            },
            pb::Event {
                time_ns: kill_ns + SEC,
                kind: Some(Kind::ChildExit(exit)),
            },
        ],
        incident: incident("oom", kill_ns),
    }
}

/// Settled at 1.6 GiB (weights, the engine, the API server), then the KV
/// pool's `torch.zeros` climbs to the limit.
const STARTUP: [f64; 10] = [0.3, 0.8, 1.2, 1.5, 1.6, 1.6005, 1.601, 1.8, 2.0, 2.2];

#[test]
fn a_start_up_kill_of_the_worker_proposes_the_kv_space_that_fits() {
    let limit = gib(2.21);
    let e = startup_kill(
        vllm_supervisor(
            "/opt/vllm/bin/vllm serve /models/tiny-llama --load-format dummy --port 8000",
            &[("VLLM_CPU_KVCACHE_SPACE", "1")],
        ),
        limit,
        &STARTUP,
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert_eq!(d.causes[0].kind, "kv_reservation", "{:#?}", d.causes);
    let c = &d.causes[0];
    assert_eq!(metric(c, "limit_bytes"), limit as f64);
    assert_eq!(metric(c, "rest_bytes"), gib(1.601) as f64);
    assert_eq!(metric(c, "kv_pool_bytes"), GIB as f64);
    // (2.21 − 1.6 − the 256 MiB warm-up after the pool) × 0.9 = 0.32 GiB,
    // rounded down to 0.1 GiB.
    assert_eq!(metric(c, "proposed_kv_bytes"), gib(0.3) as f64);
    has(
        &c.evidence,
        "VLLM::Worker (pid 5003) while vLLM was starting",
    );
    has(
        &c.evidence,
        "VLLM_CPU_KVCACHE_SPACE=1 asks for a KV pool of 1.0 GiB",
    );
    has(&c.evidence, "over the 2.2 GiB limit");
    let first = &d.fixes[0];
    assert_eq!(first.risk, "low");
    assert!(
        first
            .action
            .contains("`--kv-cache-memory-bytes 322122547` instead of `VLLM_CPU_KVCACHE_SPACE`, which takes whole GiB (now 1; in GiB)"),
        "{:#?}",
        d.fixes
    );
    assert!(first.retest.starts_with("restart vLLM with the new value"));
    // Keeping the pool means a larger limit: (1.6 + 1.0) / 0.9.
    assert!(
        d.fixes.iter().any(|f| f.action.starts_with(
            "Or keep the pool (1.0 GiB) and raise the memory limit to at least 2.9 GiB"
        )),
        "{:#?}",
        d.fixes
    );
    let risks: Vec<&str> = d.fixes.iter().map(|f| f.risk.as_str()).collect();
    let mut sorted = risks.clone();
    sorted.sort_by_key(|r| ["low", "medium", "high"].iter().position(|x| x == r));
    assert_eq!(risks, sorted, "least risky first");
    assert_eq!(d.victim.as_ref().map(|v| v.pid), Some(WORKER_PID));
    sound(&d);
}

#[test]
fn the_kv_size_flag_is_proposed_in_bytes_where_it_was_used() {
    let e = startup_kill(
        vllm_supervisor(
            "vllm serve /models/tiny-llama --kv-cache-memory-bytes 1073741824",
            &[],
        ),
        gib(2.21),
        &STARTUP,
    );
    let d = diagnose(&e);
    assert!(
        d.fixes[0]
            .action
            .contains("`--kv-cache-memory-bytes 322122547` (now 1073741824; in bytes)"),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn a_pool_with_no_room_left_says_it_does_not_fit() {
    // The rest already held 1.45 GiB of a 1.5 GiB limit.
    let e = startup_kill(
        vllm_supervisor("vllm serve /m", &[("VLLM_CPU_KVCACHE_SPACE", "1")]),
        gib(1.5),
        &[0.5, 1.0, 1.45, 1.4505, 1.47, 1.49],
    );
    let d = diagnose(&e);
    let c = cause(&d, "kv_reservation");
    assert_eq!(metric(c, "proposed_kv_bytes"), 0.0);
    assert!(
        d.fixes
            .iter()
            .any(|f| f.action.starts_with("The KV pool does not fit at all") && f.risk == "medium"),
        "{:#?}",
        d.fixes
    );
    assert!(!d
        .fixes
        .iter()
        .any(|f| f.action.contains("VLLM_CPU_KVCACHE_SPACE=0")));
}

#[test]
fn llama_cpp_is_one_process_and_its_pool_is_sized_by_context() {
    let mut e = startup_kill(
        vllm_supervisor(
            "./llama-server -m model.gguf -c 32768 -np 4 --port 8080",
            &[],
        ),
        gib(2.21),
        &STARTUP,
    );
    for s in &mut e.samples {
        s.tree.clear();
    }
    for ev in &mut e.events {
        match &mut ev.kind {
            Some(Kind::KernelOomKill(k)) => k.task = "llama-server".into(),
            Some(Kind::ChildExit(x)) => {
                x.pid = WORKER_PID;
                x.exit_code = None;
                x.signal = Some(9);
            }
            _ => {}
        }
    }
    let d = diagnose(&e);
    let c = cause(&d, "kv_reservation");
    assert_eq!(metric(c, "proposed_kv_bytes"), gib(0.3) as f64);
    assert!(
        d.fixes[0]
            .action
            .starts_with("Lower the KV reservation to what fits, 307.2 MiB (")
            && d.fixes[0]
                .action
                .ends_with("`-c` (now 32768), `-np` (now 4), `--cache-type-k` (not set)"),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn a_kill_after_requests_were_served_is_not_the_reservation() {
    let mut e = startup_kill(
        vllm_supervisor("vllm serve /m", &[("VLLM_CPU_KVCACHE_SPACE", "1")]),
        gib(2.21),
        &STARTUP,
    );
    e.events.insert(
        0,
        pb::Event {
            time_ns: T0 + SEC / 2,
            kind: Some(Kind::Request(pb::RequestBoundary {
                start: true,
                ..Default::default()
            })),
        },
    );
    let d = diagnose(&e);
    assert!(
        d.causes.iter().all(|c| c.kind != "kv_reservation"),
        "{:#?}",
        d.causes
    );
    // The generic cgroup fix names vLLM's own settings.
    assert!(
        d.fixes.iter().any(|f| f.action
            == "Cap concurrency so the peak stays under the limit: `--max-num-seqs` (not set), `--max-num-batched-tokens` (not set), `--max-model-len` (not set)"),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn the_kv_text_proposes_a_value_below_the_memory_available() {
    let (before, after) = {
        let levels = vec![v1(
            "/oomtest/child",
            V1_UNLIMITED,
            200 * MIB,
            210 * MIB,
            0,
            0,
        )];
        (
            counters(T0, levels.clone(), system(7, 12 * GIB)),
            counters(T0 + 3 * SEC, levels, system(7, 12 * GIB)),
        )
    };
    let stderr = "(Worker pid=114) ERROR ValueError: Available memory on node 0 (20.88/23.54 GiB) on kv cache allocation is less than requested memory for kv (40.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.\n";
    let mut e = supervised(
        exit(Some(1), None, stderr, before, after, None),
        "exit_oom_text",
    );
    let h = e.hello.as_mut().unwrap();
    h.command = argv("vllm serve /models/tiny-llama");
    h.labels
        .insert("env.VLLM_CPU_KVCACHE_SPACE".into(), "40".into());
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"));
    let c = cause(&d, "kv_reservation");
    assert_eq!(metric(c, "available_bytes"), gib(20.88) as f64);
    assert_eq!(metric(c, "requested_bytes"), (40 * GIB) as f64);
    // 20.88 × 0.9 = 18.79, rounded down to 0.1 GiB.
    assert!((metric(c, "proposed_kv_bytes") - 18.7 * GIB as f64).abs() < 2.0);
    assert!(
        d.fixes[0]
            .action
            .starts_with("Lower the KV reservation to what fits: `VLLM_CPU_KVCACHE_SPACE=18` (now 40; in GiB): below the 20.9 GiB available"),
        "{:#?}",
        d.fixes
    );
    // The table's words stay on offer.
    assert!(d.fixes.iter().any(|f| f
        .action
        .starts_with("Lower the KV reservation (VLLM_CPU_KVCACHE_SPACE")));
    sound(&d);
}

#[test]
fn vllms_free_memory_text_proposes_the_free_share() {
    let levels = vec![v1(
        "/oomtest/child",
        V1_UNLIMITED,
        200 * MIB,
        210 * MIB,
        0,
        0,
    )];
    let stderr = "ValueError: Free memory on device (6.9/8.0 GiB) on startup is less than desired GPU memory utilization (0.9, 7.2 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.\n";
    let mut e = supervised(
        exit(
            Some(1),
            None,
            stderr,
            counters(T0, levels.clone(), system(7, 12 * GIB)),
            counters(T0 + 3 * SEC, levels, system(7, 12 * GIB)),
            None,
        ),
        "exit_oom_text",
    );
    e.hello.as_mut().unwrap().command = argv("vllm serve /m --gpu-memory-utilization 0.9");
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    // 6.9 / 8.0 × 0.9 = 0.776.
    assert!(
        d.fixes[0].action.starts_with(
            "Lower the memory share to what is free: `--gpu-memory-utilization 0.77` (now 0.9)"
        ),
        "{:#?}",
        d.fixes
    );
}

/// A vLLM worker's agent on an 80 GiB GPU: 16 GiB of weights, a 54 GiB
/// pool, `--gpu-memory-utilization 0.9`; a batch of 64 sequences asks for
/// 2 GiB more with 6 GiB of activations live; 2.5 GiB outside PyTorch.
fn activation_oom(command: &str) -> Evidence {
    let mut h = hello();
    h.role = "worker".into();
    h.runtime = "pytorch".into();
    h.command = argv(command);
    h.gpus.push(pb::GpuPlacement {
        index: 0,
        total_bytes: 80 * GIB,
        ..Default::default()
    });
    let ctx = |running: u64, done: u64| pb::RequestContext {
        active_sequences: running,
        active_tokens: running * 512,
        requests_done: done,
        weight_bytes: 16 * GIB,
        kv_cache_capacity_bytes: 54 * GIB,
        ..Default::default()
    };
    let sample = |i: i64, allocated: u64, running: u64, done: u64| pb::Sample {
        time_ns: T0 + i * SEC,
        allocator: vec![pb::AllocatorStats {
            allocated_bytes: allocated,
            reserved_bytes: allocated + GIB,
            driver_total_bytes: 80 * GIB,
            driver_free_bytes: 80 * GIB - allocated - GIB - gib(2.5),
            ..Default::default()
        }],
        context: Some(ctx(running, done)),
        ..Default::default()
    };
    let oom = pb::Oom {
        device: 0,
        requested_bytes: 2 * GIB,
        error_type: "torch.OutOfMemoryError".into(),
        // The process's own use of the device, as PyTorch reads it from NVML:
        // 79.5 GiB in use − 77 GiB reserved = 2.5 GiB outside PyTorch.
        error_text: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which 512.00 MiB is free. Including non-PyTorch memory, this process has 79.50 GiB memory in use. Of the allocated memory 76.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.".into(),
        stats: Some(pb::AllocatorStats {
            allocated_bytes: 76 * GIB,
            reserved_bytes: 77 * GIB,
            driver_total_bytes: 80 * GIB,
            driver_free_bytes: gib(0.5),
            ..Default::default()
        }),
        context: Some(ctx(64, 40)),
        ..Default::default()
    };
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(h),
        samples: vec![
            sample(0, 70 * GIB, 0, 0),
            sample(1, 72 * GIB, 16, 10),
            sample(2, 70 * GIB, 0, 30),
            sample(3, 74 * GIB, 48, 38),
        ],
        events: vec![pb::Event {
            time_ns: T0 + 4 * SEC,
            kind: Some(Kind::Oom(oom)),
        }],
        incident: incident("oom", T0 + 4 * SEC),
    }
}

#[test]
fn an_activation_peak_beside_the_pool_proposes_a_lower_memory_share() {
    let e = activation_oom(
        "/venv/bin/vllm serve /models/llama --gpu-memory-utilization 0.9 --max-num-seqs 64",
    );
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    let c = cause(&d, "activation_headroom");
    // 80 − 16 − 54 − 2.5 = 7.5 GiB of headroom; 6 live + 2 asked = 8 GiB needed.
    assert_eq!(metric(c, "headroom_bytes"), gib(7.5) as f64);
    assert_eq!(metric(c, "activation_peak_bytes"), (8 * GIB) as f64);
    assert_eq!(metric(c, "kv_pool_bytes"), (54 * GIB) as f64);
    assert_eq!(metric(c, "non_torch_bytes"), gib(2.5) as f64);
    assert_eq!(metric(c, "active_sequences"), 64.0);
    // 0.9 − (8 × 1.2 − 7.5) / 80 = 0.874, rounded down.
    assert_eq!(metric(c, "proposed_memory_fraction"), 0.87);
    has(
        &c.evidence,
        "the batch at the failure: 64 running sequences, 32768 tokens",
    );
    let f = d
        .fixes
        .iter()
        .find(|f| {
            f.action
                .contains("`--gpu-memory-utilization 0.87` (now 0.9)")
        })
        .unwrap_or_else(|| panic!("{:#?}", d.fixes));
    assert_eq!(f.risk, "low");
    assert!(d
        .fixes
        .iter()
        .any(|f| f.action.contains("`--max-num-seqs` (now 64)")));
    sound(&d);
}

#[test]
fn without_the_setting_on_the_command_line_vllms_default_is_the_base() {
    let e = activation_oom("/venv/bin/vllm serve /models/llama");
    let d = diagnose(&e);
    let c = cause(&d, "activation_headroom");
    assert_eq!(metric(c, "memory_fraction"), 0.9);
    assert!(
        d.fixes.iter().any(|f| f
            .action
            .contains("`--gpu-memory-utilization 0.87` (not set: vLLM's default 0.9)")),
        "{:#?}",
        d.fixes
    );
}

/// The supervisor's view of vLLM on GPU 0 (80 GiB): its Worker settles at
/// 70 GiB, then another process grows to 12 GiB, and a CUDA OOM ends it.
#[test]
fn memory_another_process_took_after_the_pool_was_sized_is_named() {
    let sample = |i: i64, worker: u64, other: u64| pb::Sample {
        time_ns: T0 + i * SEC,
        gpus: vec![pb::GpuDevice {
            index: 0,
            total_bytes: 80 * GIB,
            used_bytes: worker + other,
            free_bytes: 80 * GIB - worker - other,
            processes: [(WORKER_PID, worker), (7000, other)]
                .into_iter()
                .filter(|(_, b)| *b > 0)
                .map(|(pid, used_bytes)| pb::GpuProcessUsage {
                    pid,
                    used_bytes: Some(used_bytes),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        tree: vec![
            proc_info(API_PID, "python3", GIB),
            proc_info(WORKER_PID, "VLLM::Worker", 2 * GIB),
        ],
        tree_rss_bytes: 3 * GIB,
        ..Default::default()
    };
    let levels = vec![v1(
        "/oomtest/child",
        V1_UNLIMITED,
        200 * MIB,
        210 * MIB,
        0,
        0,
    )];
    let stderr = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which 1.00 GiB is free.\n";
    let mut h = vllm_supervisor(
        "vllm serve /models/llama --gpu-memory-utilization 0.9",
        &[("CUDA_VISIBLE_DEVICES", "0")],
    );
    h.gpus.push(pb::GpuPlacement {
        index: 0,
        total_bytes: 80 * GIB,
        ..Default::default()
    });
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(h),
        samples: vec![
            sample(0, 20 * GIB, 0),
            sample(1, 70 * GIB, 0),
            sample(2, 70 * GIB, 4 * GIB),
            sample(3, 70 * GIB, 9 * GIB),
        ],
        events: vec![pb::Event {
            time_ns: T0 + 4 * SEC,
            kind: Some(Kind::ChildExit(pb::ChildExit {
                pid: API_PID,
                exit_code: Some(1),
                stderr_tail: stderr.into(),
                before: Some(counters(T0, levels.clone(), system(7, 12 * GIB))),
                after: Some(counters(T0 + 4 * SEC, levels, system(7, 12 * GIB))),
                runtime_ns: 5 * SEC as u64,
                ..Default::default()
            })),
        }],
        incident: incident("exit_oom_text", T0 + 4 * SEC),
    };
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"), "{:#?}", d.evidence);
    let c = cause(&d, "taken_after_profiling");
    assert_eq!(metric(c, "taken_bytes"), (9 * GIB) as f64);
    assert_eq!(metric(c, "others_at_profile_bytes"), 0.0);
    assert_eq!(c.processes.len(), 1);
    assert_eq!(c.processes[0].pid, 7000);
    // 0.9 − 9 × 1.2 / 80 = 0.765.
    assert!(
        d.fixes.iter().any(|f| f
            .action
            .contains("`--gpu-memory-utilization 0.76` (now 0.9)")),
        "{:#?}",
        d.fixes
    );
    assert!(d
        .fixes
        .iter()
        .any(|f| f.action.contains("(`CUDA_VISIBLE_DEVICES` now 0)")));
    sound(&d);
}

/// The vLLM plugin's context in the API server, one sample 200 ms apart per
/// reading of (KV usage, running, waiting, the preemption counter).
fn pool_server(command: &str, readings: &[(f64, u64, u64, f64)]) -> Evidence {
    let mut h = hello();
    h.role = "api_server".into();
    h.runtime = "vllm".into();
    h.command = argv(command);
    let sample = |i: i64, usage: f64, running: u64, waiting: u64, preempted: f64| {
        let mut numbers = std::collections::HashMap::new();
        numbers.insert("kv_cache_usage".to_string(), usage);
        numbers.insert("preemptions".to_string(), preempted);
        numbers.insert("vllm.num_gpu_blocks".to_string(), 40.0);
        numbers.insert("vllm.block_size".to_string(), 16.0);
        numbers.insert("vllm.max_num_seqs".to_string(), 256.0);
        pb::Sample {
            time_ns: T0 + i * SEC / 5,
            context: Some(pb::RequestContext {
                phase: "periodic".into(),
                active_sequences: running,
                queued: waiting,
                kv_cache_capacity_bytes: 40 * 16 * 64 * 1024,
                kv_cache_bytes: (usage * (40 * 16 * 64 * 1024) as f64) as u64,
                numbers,
                ..Default::default()
            }),
            ..Default::default()
        }
    };
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(h),
        samples: readings
            .iter()
            .enumerate()
            .map(|(i, &(u, r, w, p))| sample(i as i64, u, r, w, p))
            .collect(),
        events: vec![],
        incident: None,
    }
}

/// Under load: the pool fills, 157 requests wait and running ones are
/// preempted. Nothing fails.
fn saturated_server(command: &str) -> Evidence {
    pool_server(
        command,
        &[
            (0.1, 4, 0, 0.0),
            (0.6, 20, 0, 0.0),
            (0.97, 35, 120, 3.0),
            (1.0, 35, 157, 9.0),
            (0.99, 34, 150, 14.0),
            (0.98, 36, 90, 14.0),
        ],
    )
}

const FULL_NOTHING_WAITING: &str = "KV pool full (usage 100 %) with nothing waiting or preempted";

#[test]
fn a_full_pool_on_a_healthy_server_is_a_capacity_bound_not_an_oom() {
    let d = diagnose(&saturated_server(
        "/venv/bin/vllm serve /models/tiny-llama --num-gpu-blocks-override 40 --max-num-seqs 256 --port 8000",
    ));
    assert_eq!(d.domain, None, "nothing failed");
    assert!(d.victim.is_none());
    let c = cause(&d, "kv_pool_saturation");
    assert_eq!(metric(c, "kv_cache_usage"), 1.0);
    assert_eq!(metric(c, "waiting"), 157.0);
    assert_eq!(metric(c, "running"), 35.0);
    assert_eq!(metric(c, "preemptions"), 14.0);
    assert_eq!(metric(c, "full_readings"), 4.0);
    assert_eq!(metric(c, "kv_pool_tokens"), 640.0);
    assert_eq!(metric(c, "max_sequences"), 256.0);
    has(
        &c.evidence,
        "vLLM's KV pool was 100% full with up to 157 requests waiting (35 running)",
    );
    has(&c.evidence, "14 preemptions");
    has(&c.evidence, "not an out-of-memory failure");
    has(&c.evidence, "KV-bound: 35 sequences ran of the 256");
    assert!(
        d.evidence
            .iter()
            .all(|l| !l.starts_with(FULL_NOTHING_WAITING)),
        "a pool that made requests wait is a cause, not a bare fact: {:?}",
        d.evidence
    );
    assert_eq!(
        d.fixes[0].action,
        "Cap the sequences at what the pool holds: `--max-num-seqs 35` (now 256), the running count when the pool was full, so requests wait in the queue instead of being preempted and recomputed"
    );
    assert!(
        d.fixes.iter().any(|f| f
            .action
            .contains("`--kv-cache-dtype fp8` (not set; vLLM resolved")
            || f.action.contains("`--kv-cache-dtype fp8` (not set)")),
        "{:#?}",
        d.fixes
    );
    sound(&d);
}

#[test]
fn a_last_reading_repeated_while_idle_counts_once() {
    let mut e = saturated_server("vllm serve /m");
    // The plugin reports nothing when idle: later samples repeat the last context.
    let last = e.samples.last().unwrap().clone();
    for i in 1..=20 {
        let mut s = last.clone();
        s.time_ns += i * SEC;
        e.samples.push(s);
    }
    let c = diagnose(&e)
        .causes
        .into_iter()
        .find(|c| c.kind == "kv_pool_saturation")
        .unwrap();
    assert_eq!(metric(&c, "full_readings"), 4.0);
    assert!((metric(&c, "full_seconds") - 0.6).abs() < 1e-9);
}

#[test]
fn the_plugins_resolved_value_stands_in_for_a_default() {
    let d = diagnose(&saturated_server("/venv/bin/vllm serve /models/tiny-llama"));
    assert!(
        d.fixes[0]
            .action
            .contains("`--max-num-seqs 35` (not set; vLLM resolved 256)"),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn a_pool_that_fills_once_without_waiting_is_no_verdict() {
    let mut e = saturated_server("vllm serve /m");
    for s in &mut e.samples {
        let c = s.context.as_mut().unwrap();
        c.queued = 0;
        c.numbers.insert("preemptions".into(), 0.0);
    }
    let d = diagnose(&e);
    assert!(d.causes.iter().all(|c| c.kind != "kv_pool_saturation"));
}

/// The user's retest: `--max-num-seqs 5` applied, the pool runs full with
/// 3 to 5 sequences and nothing waits or is preempted (the counter stays at 0).
#[test]
fn a_full_pool_with_nothing_waiting_or_preempted_is_a_fact_not_a_cause() {
    let d = diagnose(&pool_server(
        "vllm serve /m --max-num-seqs 5",
        &[
            (0.3, 2, 0, 0.0),
            (0.95, 3, 0, 0.0),
            (1.0, 5, 0, 0.0),
            (0.97, 4, 0, 0.0),
            (0.99, 3, 0, 0.0),
        ],
    ));
    assert!(
        d.causes.iter().all(|c| c.kind != "kv_pool_saturation"),
        "{:?}",
        d.causes
    );
    assert!(d.fixes.is_empty(), "no cause, no fix: {:#?}", d.fixes);
    has(
        &d.evidence,
        "KV pool full (usage 100 %) with nothing waiting or preempted: vLLM ran every request it was given (5 at most at once, in 4 full readings)",
    );
}

/// A counter that falls is a restarted runtime counting from zero, not
/// preemptions: the old count (5) must not read as 5 preemptions now.
#[test]
fn a_preemption_counter_that_restarts_is_no_preemption() {
    let d = diagnose(&pool_server(
        "vllm serve /m --max-num-seqs 5",
        &[
            (0.95, 5, 0, 5.0),
            (1.0, 5, 0, 5.0),
            (0.2, 1, 0, 0.0),
            (0.96, 3, 0, 0.0),
            (1.0, 3, 0, 0.0),
        ],
    ));
    assert!(
        d.causes.iter().all(|c| c.kind != "kv_pool_saturation"),
        "{:?}",
        d.causes
    );
    assert!(d.fixes.iter().all(|f| !f.action.contains("--max-num-seqs")));
    has(&d.evidence, FULL_NOTHING_WAITING);
}

/// Preempted requests are the pool's bound though none waits: the cause
/// stands, sized from the readings that preempted.
#[test]
fn preemptions_without_waiting_keep_the_capacity_cause() {
    let d = diagnose(&pool_server(
        "vllm serve /m --max-num-seqs 5",
        &[
            (0.5, 2, 0, 0.0),
            (1.0, 3, 0, 2.0),
            (0.98, 3, 0, 5.0),
            (0.99, 4, 0, 5.0),
        ],
    ));
    let c = cause(&d, "kv_pool_saturation");
    assert_eq!(metric(c, "preemptions"), 5.0);
    assert_eq!(metric(c, "waiting"), 0.0);
    assert_eq!(metric(c, "full_readings"), 2.0);
    assert_eq!(metric(c, "running"), 3.0);
    has(&c.evidence, "5 preemptions in the window");
    assert!(
        d.fixes
            .iter()
            .any(|f| f.action.contains("`--max-num-seqs 3` (now 5)")),
        "{:#?}",
        d.fixes
    );
    assert!(d
        .evidence
        .iter()
        .all(|l| !l.starts_with(FULL_NOTHING_WAITING)));
}

/// vLLM's CPU backend on a 16 GiB host: its tree settles at 6 GiB with a
/// 4 GiB pool, then another process takes 3 GiB and the kernel's global
/// OOM killer takes the Worker.
#[test]
fn host_memory_taken_after_the_pool_was_sized_proposes_a_smaller_pool() {
    let sample = |i: i64, tree: u64, others: u64| pb::Sample {
        time_ns: T0 + i * SEC,
        system: Some(system(7, 16 * GIB - tree - others)),
        tree: vec![proc_info(WORKER_PID, "VLLM::Worker", tree)],
        tree_rss_bytes: tree,
        ..Default::default()
    };
    let levels = vec![v1(
        "/oomtest/child",
        V1_UNLIMITED,
        200 * MIB,
        210 * MIB,
        0,
        0,
    )];
    let kill = pb::KernelOomKill {
        pid: WORKER_PID,
        task: "VLLM::Worker".into(),
        constraint: "CONSTRAINT_NONE".into(),
        anon_rss_bytes: 5 * GIB,
        ..Default::default()
    };
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(vllm_supervisor(
            "vllm serve /models/llama",
            &[("VLLM_CPU_KVCACHE_SPACE", "4")],
        )),
        samples: vec![
            sample(0, 2 * GIB, 2 * GIB),
            sample(1, 6 * GIB, 2 * GIB),
            sample(2, 6 * GIB, 3 * GIB),
            sample(3, 6 * GIB + 100 * MIB, 5 * GIB),
        ],
        events: vec![
            pb::Event {
                time_ns: T0 + 4 * SEC,
                kind: Some(Kind::KernelOomKill(kill)),
            },
            pb::Event {
                time_ns: T0 + 4 * SEC + SEC / 2,
                kind: Some(Kind::ChildExit(pb::ChildExit {
                    pid: API_PID,
                    exit_code: Some(1),
                    before: Some(counters(T0, levels.clone(), system(7, 12 * GIB))),
                    after: Some(counters(T0 + 5 * SEC, levels, system(8, 12 * GIB))),
                    runtime_ns: 5 * SEC as u64,
                    ..Default::default()
                })),
            },
        ],
        incident: incident("oom", T0 + 4 * SEC),
    };
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    let c = cause(&d, "taken_after_profiling");
    // Others held 2 GiB when the tree settled and 5 GiB at the end.
    assert_eq!(metric(c, "taken_bytes"), (3 * GIB) as f64);
    assert_eq!(metric(c, "own_bytes"), (6 * GIB + 100 * MIB) as f64);
    // 4 − 3 × 1.2 = 0.4.
    assert!(
        d.fixes
            .iter()
            .any(|f| f.action.contains("`--kv-cache-memory-bytes 429496730` instead of `VLLM_CPU_KVCACHE_SPACE`, which takes whole GiB (now 4)")),
        "{:#?}",
        d.fixes
    );
    sound(&d);
}

/// A tensor-parallel GPU worker (rank 1 of 2) whose plugin reported its own
/// share of the pool: joined with the API server's readings, its timeline
/// shows the saturation, sized by its own shard, not the instance's pool.
#[test]
fn a_gpu_worker_joined_with_the_api_server_sees_the_saturation_on_its_shard() {
    let api = saturated_server(
        "/venv/bin/vllm serve /models/tiny-llama --tensor-parallel-size 2 --port 8000",
    );
    let instance_pool = 40 * 16 * 64 * 1024u64;
    let shard = instance_pool / 2;
    let mut h = hello();
    h.role = "worker".into();
    h.runtime = "vllm".into();
    h.pid = WORKER_PID;
    let worker_sample = |i: i64| {
        let mut numbers = std::collections::HashMap::new();
        numbers.insert("vllm.kv_pool_bytes".to_string(), shard as f64);
        numbers.insert("vllm.num_gpu_blocks".to_string(), 40.0);
        numbers.insert("vllm.block_size".to_string(), 16.0);
        pb::TimedSample {
            seq: i as u64,
            // Just after each API server reading.
            sample: Some(pb::Sample {
                time_ns: T0 + i * SEC / 5 + SEC / 20,
                context: Some(pb::RequestContext {
                    numbers,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    };
    let mut samples: Vec<pb::TimedSample> =
        (0..api.samples.len() as i64).map(worker_sample).collect();
    let theirs: Vec<pb::TimedSample> = api
        .samples
        .iter()
        .map(|s| pb::TimedSample {
            sample: Some(s.clone()),
            ..Default::default()
        })
        .collect();
    oomscope_analysis::join::join_context(&mut samples, &theirs);
    let at_full = samples[3]
        .sample
        .as_ref()
        .unwrap()
        .context
        .as_ref()
        .unwrap();
    assert_eq!(
        at_full.kv_cache_capacity_bytes, shard,
        "the worker's own shard"
    );
    assert_eq!(at_full.kv_cache_bytes, shard, "100 % of the shard");
    assert_eq!(at_full.queued, 157);
    let worker = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(h),
        samples: samples.into_iter().filter_map(|s| s.sample).collect(),
        events: vec![],
        incident: None,
    };
    let d = diagnose(&worker);
    let c = cause(&d, "kv_pool_saturation");
    assert_eq!(metric(c, "waiting"), 157.0);
    assert_eq!(metric(c, "running"), 35.0);
    assert_eq!(metric(c, "preemptions"), 14.0);
    assert_eq!(metric(c, "kv_pool_bytes"), shard as f64);
}

/// One llama.cpp process (the server binary or the Python bindings'
/// server) killed filling its KV pool at start-up, its stderr ending with
/// what llama.cpp logs as it allocates the pool (before filling it).
fn llama_startup_kill(command: &str, task: &str, stderr: &str) -> Evidence {
    let mut e = startup_kill(vllm_supervisor(command, &[]), gib(2.21), &STARTUP);
    for s in &mut e.samples {
        s.tree.clear();
    }
    for ev in &mut e.events {
        match &mut ev.kind {
            Some(Kind::KernelOomKill(k)) => k.task = task.into(),
            Some(Kind::ChildExit(x)) => {
                x.pid = WORKER_PID;
                x.exit_code = None;
                x.signal = Some(9);
                x.stderr_tail = stderr.into();
            }
            _ => {}
        }
    }
    e
}

const LLAMA_LOG: &str = "print_info: n_layer          = 32\nllama_context: n_ctx         = 32768\nllama_kv_cache_unified:        CPU KV buffer size =  4096.00 MiB\n";

/// 32768 tokens took the 4 GiB pool llama.cpp logged: the context that fits
/// is 32768 × proposed / 4 GiB, rounded down to 256 tokens.
fn expected_context(c: &pb::Cause) -> u64 {
    let tokens = 32768.0 * metric(c, "proposed_kv_bytes") / (4.0 * GIB as f64);
    (tokens / 256.0).floor() as u64 * 256
}

#[test]
fn a_python_m_llama_cpp_server_gets_its_context_computed_in_its_own_flag() {
    let e = llama_startup_kill(
        "/venv/bin/python3 -m llama_cpp.server --model /models/q4.gguf --n_ctx 32768 --port 8000",
        "python3",
        LLAMA_LOG,
    );
    let d = diagnose(&e);
    let c = cause(&d, "kv_reservation");
    // The room left under the 2.21 GiB limit above the 1.6 GiB held before the climb.
    assert_eq!(metric(c, "proposed_kv_bytes"), gib(0.3) as f64);
    let want = expected_context(c);
    assert_eq!(want, 2304);
    let first = &d.fixes[0];
    assert!(
        first.action.starts_with(&format!(
            "Lower the KV reservation to what fits: `--n_ctx {want}` (now 32768; the 4.0 GiB pool llama-cpp-python logged scales with it): the 2.2 GiB cgroup limit less the 1.6 GiB"
        )),
        "{:#?}",
        d.fixes
    );
    assert!(first
        .retest
        .starts_with("restart llama-cpp-python with the new value"));
    // The interpreter's `-m` is the program, in no fix.
    assert!(
        d.fixes.iter().all(|f| !f.action.contains("`-m")),
        "{:#?}",
        d.fixes
    );
    sound(&d);
}

#[test]
fn each_llama_cpp_spelling_is_proposed_as_typed_and_no_value_is_guessed() {
    // The server binary with its short flag: the same figures, its own spelling.
    let e = llama_startup_kill(
        "./llama-server -m model.gguf -c 32768 --port 8080",
        "llama-server",
        LLAMA_LOG,
    );
    let d = diagnose(&e);
    let want = expected_context(cause(&d, "kv_reservation"));
    assert!(
        d.fixes[0].action.starts_with(&format!(
            "Lower the KV reservation to what fits: `-c {want}` (now 32768;"
        )),
        "{:#?}",
        d.fixes
    );
    // `--n-ctx=` for the bindings' server.
    let e = llama_startup_kill(
        "python -m llama_cpp.server --model m.gguf --n-ctx=32768",
        "python",
        LLAMA_LOG,
    );
    let d = diagnose(&e);
    assert!(
        d.fixes[0]
            .action
            .contains(&format!("`--n-ctx {want}` (now 32768;")),
        "{:#?}",
        d.fixes
    );
    // Without the pool's size in the log, the setting is named, never valued.
    let e = llama_startup_kill(
        "python -m llama_cpp.server --model m.gguf --n_ctx 32768",
        "python",
        "print_info: n_layer          = 32\n",
    );
    let d = diagnose(&e);
    assert!(
        d.fixes[0]
            .action
            .starts_with("Lower the KV reservation to what fits, 307.2 MiB (")
            && d.fixes[0].action.contains("`--n_ctx` (now 32768)"),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn the_victims_command_line_is_the_newest_read_while_it_lived() {
    let mut e = llama_startup_kill(
        "python3 -m llama_cpp.server --model m.gguf --n_ctx 32768",
        "python3",
        LLAMA_LOG,
    );
    let n = e.samples.len();
    for (i, s) in e.samples.iter_mut().enumerate() {
        // An older command line, the one in force, then the kernel's name
        // only: read as the process died, its command line was gone.
        let command = match i {
            0 => "python3 -m llama_cpp.server --model m.gguf --n_ctx 16384".to_string(),
            _ if i + 1 < n => {
                "python3 -m llama_cpp.server --model m.gguf --n_ctx 32768".to_string()
            }
            _ => "[python3]".to_string(),
        };
        s.tree = vec![pb::ProcessInfo {
            pid: WORKER_PID,
            title: "python3".into(),
            command,
            rss_bytes: s.tree_rss_bytes,
            ..Default::default()
        }];
    }
    let d = diagnose(&e);
    let v = d.victim.as_ref().unwrap();
    assert_eq!(v.pid, WORKER_PID);
    assert_eq!(
        v.command,
        "python3 -m llama_cpp.server --model m.gguf --n_ctx 32768"
    );
    assert_eq!(v.title, "python3");
}
