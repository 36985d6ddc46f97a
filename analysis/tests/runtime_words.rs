//! Fixes in the words of the runtime that produced the evidence, read
//! from its Hello: the Rust agent with a `TrackingPool` gets the pool's
//! API, a Rust process without a device a Rust remedy, a CPU-only Python
//! process Python's tools but no allocator remedy, PyTorch its own
//! settings. Each case checks the verdict and its figure first.

use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// What the Rust agent's and the Python agent's Hellos say.
#[derive(Clone, Copy)]
enum Agent {
    RustHostOnly,
    RustTrackingPool,
    PythonCpu,
    PythonCuda,
}

fn hello(agent: Agent) -> pb::Hello {
    let gpu = || pb::GpuPlacement {
        total_bytes: 12 * GIB,
        ..Default::default()
    };
    let (runtime, gpus, backend) = match agent {
        Agent::RustHostOnly => ("rust", vec![], None),
        Agent::RustTrackingPool => ("cudarc", vec![gpu()], Some("oomscope-pool")),
        Agent::PythonCpu => ("pytorch", vec![], None),
        Agent::PythonCuda => ("pytorch", vec![gpu()], Some("native")),
    };
    pb::Hello {
        agent_id: "a".into(),
        name: "a".into(),
        runtime: runtime.into(),
        gpus,
        allocator_settings: backend.map(|b| pb::AllocatorSettings {
            backend: b.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A reading after request `i`: RSS, and the allocator's live bytes where
/// the agent reads one.
fn after_request(i: u64, rss: u64, allocated: Option<u64>) -> pb::Sample {
    pb::Sample {
        time_ns: i as i64 * 100_000_000,
        allocator: allocated
            .map(|a| pb::AllocatorStats {
                allocated_bytes: a,
                allocated_peak_bytes: a,
                reserved_bytes: a,
                ..Default::default()
            })
            .into_iter()
            .collect(),
        process: Some(pb::ProcessMemory {
            pid: 7,
            vm_rss_bytes: rss,
            ..Default::default()
        }),
        context: Some(pb::RequestContext {
            phase: "after_request".into(),
            requests_done: i,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// 150 requests leaking 2 MiB each on the host; the device flat where read.
fn host_leak(agent: Agent) -> Evidence {
    let device = matches!(agent, Agent::RustTrackingPool | Agent::PythonCuda);
    let mut samples: Vec<pb::Sample> = (1..=150u64)
        .map(|i| after_request(i, GIB + 2 * MIB * i, device.then_some(GIB)))
        .collect();
    samples.last_mut().unwrap().system = Some(pb::SystemMemory {
        mem_total_bytes: 64 * GIB,
        ..Default::default()
    });
    Evidence {
        hello: Some(hello(agent)),
        samples,
        ..Default::default()
    }
}

/// 100 requests each keeping 4 MiB of device blocks.
fn device_leak(agent: Agent) -> Evidence {
    Evidence {
        hello: Some(hello(agent)),
        samples: (1..=100u64)
            .map(|i| after_request(i, GIB, Some(GIB + 4 * MIB * i)))
            .collect(),
        ..Default::default()
    }
}

fn cause<'a>(d: &'a pb::Diagnosis, kind: &str) -> &'a pb::Cause {
    d.causes
        .iter()
        .find(|c| c.kind == kind)
        .unwrap_or_else(|| panic!("no {kind}: {:#?}", d.causes))
}

/// Every word a user reads: the fixes and the causes' evidence.
fn words(d: &pb::Diagnosis) -> String {
    let fixes = d.fixes.iter().map(|f| {
        format!(
            "{} | {} | {}",
            f.action,
            f.retest,
            f.caveat.clone().unwrap_or_default()
        )
    });
    let evidence = d.causes.iter().flat_map(|c| c.evidence.iter().cloned());
    fixes.chain(evidence).collect::<Vec<_>>().join("\n")
}

const PYTHON: &[&str] = &["tracemalloc", "heap census", "Python", "gc.collect"];
const PYTORCH: &[&str] = &[
    "PYTORCH_CUDA_ALLOC_CONF",
    "expandable_segments",
    "max_split_size_mb",
    "torch.",
    "empty_cache is not",
];
const ALLOCATOR: &[&str] = &["empty_cache", "snapshot", "live blocks", "allocator state"];

fn none_of(text: &str, banned: &[&str], what: &str) {
    for b in banned {
        assert!(!text.contains(b), "{what}: {b:?} in\n{text}");
    }
}

#[test]
fn a_host_leak_in_a_rust_process_without_a_device_gets_a_rust_remedy() {
    let d = diagnose(&host_leak(Agent::RustHostOnly));
    let c = cause(&d, "host_growth");
    assert_eq!(c.metrics["bytes_per_request"], (2 * MIB) as f64);
    let text = words(&d);
    assert!(
        text.contains("heaptrack") && text.contains("dhat"),
        "{text}"
    );
    assert!(text.contains("a cache without a bound"), "{text}");
    none_of(&text, PYTHON, "a Python remedy for a Rust process");
    none_of(&text, PYTORCH, "a PyTorch remedy for a Rust process");
    none_of(&text, ALLOCATOR, "an allocator remedy without a device");
}

#[test]
fn a_host_leak_in_a_cpu_only_python_process_gets_python_tools_and_no_allocator_remedy() {
    let d = diagnose(&host_leak(Agent::PythonCpu));
    let c = cause(&d, "host_growth");
    assert_eq!(c.metrics["bytes_per_request"], (2 * MIB) as f64);
    let text = words(&d);
    assert!(text.contains("tracemalloc"), "{text}");
    none_of(&text, PYTORCH, "a PyTorch allocator remedy without a GPU");
    none_of(&text, ALLOCATOR, "an allocator remedy without a GPU");
    none_of(&text, &["heaptrack", "dhat"], "a Rust remedy for Python");
}

#[test]
fn a_device_leak_in_a_tracking_pool_names_the_pools_api() {
    let d = diagnose(&device_leak(Agent::RustTrackingPool));
    let c = cause(&d, "leak");
    assert_eq!(c.metrics["bytes_per_request"], (4 * MIB) as f64);
    let text = words(&d);
    assert!(text.contains("TrackingPool::snapshot()"), "{text}");
    assert!(text.contains("live TrackingPool blocks"), "{text}");
    assert!(
        text.contains("TrackingPool::empty_cache() is not a capacity plan"),
        "{text}"
    );
    none_of(&text, PYTORCH, "a PyTorch remedy for a TrackingPool");
    none_of(&text, PYTHON, "a Python remedy for a Rust process");
}

#[test]
fn a_device_leak_under_pytorch_keeps_pytorchs_words() {
    let d = diagnose(&device_leak(Agent::PythonCuda));
    let c = cause(&d, "leak");
    assert_eq!(c.metrics["bytes_per_request"], (4 * MIB) as f64);
    let text = words(&d);
    assert!(
        text.contains("allocation sites of live blocks (snapshot)"),
        "{text}"
    );
    assert!(
        text.contains("empty_cache is not a capacity plan"),
        "{text}"
    );
    none_of(
        &text,
        &["TrackingPool", "heaptrack", "dhat"],
        "Rust words for PyTorch",
    );
}

/// A device OOM with far more reserved-but-free than the request: the
/// allocator's cache is split.
fn fragmented_oom(agent: Agent) -> Evidence {
    let stats = pb::AllocatorStats {
        allocated_bytes: 8 * GIB,
        reserved_bytes: 11 * GIB,
        inactive_split_bytes: 3 * GIB,
        num_alloc_retries: 1,
        ..Default::default()
    };
    let mut samples: Vec<pb::Sample> = (1..=5u64)
        .map(|i| after_request(i, GIB, Some(8 * GIB)))
        .collect();
    samples
        .iter_mut()
        .for_each(|s| s.allocator[0].reserved_bytes = 11 * GIB);
    Evidence {
        hello: Some(hello(agent)),
        samples,
        events: vec![pb::Event {
            time_ns: 600_000_000,
            kind: Some(Kind::Oom(pb::Oom {
                requested_bytes: 640 * MIB,
                stats: Some(stats),
                driver_error: 2,
                error_text: "CUDA out of memory. Tried to allocate 640.00 MiB".into(),
                ..Default::default()
            })),
        }],
        ..Default::default()
    }
}

#[test]
fn fragmentation_in_a_tracking_pool_names_the_pools_mechanics_not_pytorchs_settings() {
    let d = diagnose(&fragmented_oom(Agent::RustTrackingPool));
    let c = cause(&d, "fragmentation");
    assert_eq!(c.metrics["request_bytes"], (640 * MIB) as f64);
    assert_eq!(c.metrics["reserved_unallocated_bytes"], (3 * GIB) as f64);
    let text = words(&d);
    let fixes: Vec<&str> = d.fixes.iter().map(|f| f.action.as_str()).collect();
    assert!(
        fixes
            .iter()
            .any(|f| f.contains("TrackingPool::empty_cache()")),
        "{fixes:#?}"
    );
    assert!(
        fixes.iter().any(|f| f.contains("one fixed KV block size")),
        "{fixes:#?}"
    );
    let fix_text = d
        .fixes
        .iter()
        .map(|f| format!("{} {:?}", f.action, f.caveat))
        .collect::<String>();
    none_of(
        &fix_text,
        PYTORCH,
        "PyTorch's allocator settings for a TrackingPool",
    );
    eprintln!("{text}");
    // The same failure under PyTorch gets PyTorch's settings.
    let d = diagnose(&fragmented_oom(Agent::PythonCuda));
    cause(&d, "fragmentation");
    assert!(
        d.fixes.iter().any(|f| f
            .action
            .contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")),
        "{:#?}",
        d.fixes
    );
}
