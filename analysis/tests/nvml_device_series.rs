//! A process's device memory with no allocator reading (a candle program:
//! its tensors go through cudarc, not a pool the agent reads), as NVML
//! lists it per process: the Rust agent's periodic samples carry the whole
//! reading (`gpus`), its request-end readings this process's entries
//! (`gpu_processes`, the newest end of each boundary message). Growth per
//! request there is a `leak` with its bytes per request; flat memory, or
//! another process's growth, or an entry whose pid nobody could resolve,
//! is none. The figures and identity are the H200 capture's
//! (tests/fixtures/torch-h200/driver_and_nvml.json): its uuid, total, and
//! the two processes NVML listed with their usage.

use oomscope_analysis::pb;
use oomscope_analysis::request_readings::expand_all;
use oomscope_analysis::{diagnose, Evidence};
use oomscope_testkit::readings::page_jitter;
use oomscope_testkit::torch_h200;

const MIB: u64 = 1 << 20;
const LEAK: u64 = 2 * MIB;
const REQUESTS: u64 = 150;
/// Ends per boundary message: 100 requests/s at 20 messages a second.
const ENDS_PER_MESSAGE: u64 = 5;
/// A periodic sample every this many requests (1 s at 100 requests/s).
const PERIODIC_EVERY: u64 = 100;
const REQUEST_NS: i64 = 10_000_000;

/// What the H200 capture read: the GPU, this process and another.
struct H200 {
    uuid: String,
    name: String,
    total: u64,
    own_pid: u32,
    own: u64,
    other_pid: u32,
    other: u64,
}

fn h200() -> H200 {
    let c = torch_h200::read(&torch_h200::file("driver_and_nvml.json"));
    let own_pid = c["self_pid"].as_u64().unwrap() as u32;
    let other_pid = c["holder_pid"].as_u64().unwrap() as u32;
    let procs = c["nvml_compute_procs"].as_array().unwrap();
    let used = |pid: u32| {
        procs
            .iter()
            .find(|p| p["pid"] == pid)
            .and_then(|p| p["usedGpuMemory"].as_u64())
            .unwrap()
    };
    // nvidia-smi's CSV names the uuid: "0, GPU-…, NVIDIA H200, …".
    let csv = c["nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,memory.free,memory.reserved --format=csv"]
        .as_str()
        .unwrap();
    let row: Vec<&str> = csv.lines().nth(1).unwrap().split(", ").collect();
    H200 {
        uuid: row[1].into(),
        name: c["nvml_name"].as_str().unwrap().into(),
        total: c["nvml_memory_v2"]["total"].as_u64().unwrap(),
        own_pid,
        own: used(own_pid),
        other_pid,
        other: used(other_pid),
    }
}

/// How this process's NVML entries read.
#[derive(Clone, Copy)]
enum View {
    /// The agent resolved the pid to itself.
    Own,
    /// A container's pid namespace: NVML's pid means nothing here.
    Unresolved,
    /// An older agent or a replay: no view, the pid compared by number.
    Unspecified,
}

/// The Rust agent's messages over `REQUESTS` requests, expanded as the
/// collector stores them. After request `i` this process holds `own(i)`
/// on the GPU and the other process `other(i)`; its RSS is flat.
fn evidence(view: View, own: impl Fn(u64) -> u64, other: impl Fn(u64) -> u64) -> Evidence {
    evidence_with_rss(view, own, other, |i| 900 * MIB + page_jitter(i))
}

/// [`evidence`] with this RSS after request `i`.
fn evidence_with_rss(
    view: View,
    own: impl Fn(u64) -> u64,
    other: impl Fn(u64) -> u64,
    rss: impl Fn(u64) -> u64,
) -> Evidence {
    let g = h200();
    let own_view = match view {
        View::Own => pb::PidView::Own,
        View::Unresolved => pb::PidView::Unresolved,
        View::Unspecified => pb::PidView::Unspecified,
    } as i32;
    let other_view = match view {
        View::Unspecified => pb::PidView::Unspecified,
        View::Own => pb::PidView::Visible,
        View::Unresolved => pb::PidView::Unresolved,
    } as i32;
    let mine = |i: u64| pb::GpuProcess {
        device: 0,
        pid: g.own_pid,
        used_bytes: Some(own(i)),
        view: own_view,
        device_uuid: g.uuid.clone(),
        ..Default::default()
    };
    let time = |i: u64| 1_000_000_000 + i as i64 * REQUEST_NS;
    let process = |i: u64| pb::ProcessMemory {
        pid: g.own_pid,
        vm_rss_bytes: rss(i),
        ..Default::default()
    };
    let end_context = |i: u64| pb::RequestContext {
        phase: "after_request".into(),
        requests_done: i,
        ..Default::default()
    };
    let boundary = |i: u64, start: bool| pb::RequestBoundary {
        request_id: i.to_string(),
        start,
        prompt_tokens: 32,
        ..Default::default()
    };
    let mut samples = Vec::new();
    for i in (0..=REQUESTS).step_by(PERIODIC_EVERY as usize) {
        samples.push(pb::Sample {
            time_ns: time(i) + 1,
            process: Some(process(i)),
            gpus: vec![pb::GpuDevice {
                index: 0,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                total_bytes: g.total,
                used_bytes: own(i) + other(i),
                free_bytes: g.total - own(i) - other(i),
                processes: vec![
                    pb::GpuProcessUsage {
                        pid: g.own_pid,
                        used_bytes: Some(own(i)),
                        view: own_view,
                    },
                    pb::GpuProcessUsage {
                        pid: g.other_pid,
                        used_bytes: Some(other(i)),
                        view: other_view,
                    },
                ],
                ..Default::default()
            }],
            context: Some(pb::RequestContext {
                requests_done: i,
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    // Boundary messages: the newest end is the message (its context and
    // this process's NVML entries); the others ride in it.
    for last in (ENDS_PER_MESSAGE..=REQUESTS).step_by(ENDS_PER_MESSAGE as usize) {
        let mut readings = Vec::new();
        for i in last + 1 - ENDS_PER_MESSAGE..=last {
            readings.push(pb::RequestReading {
                time_ns: time(i) - REQUEST_NS / 2,
                boundary: Some(boundary(i, true)),
                ..Default::default()
            });
            readings.push(pb::RequestReading {
                time_ns: time(i),
                boundary: Some(boundary(i, false)),
                rss_bytes: rss(i),
                context: (i != last).then(|| end_context(i)),
                ..Default::default()
            });
        }
        samples.push(pb::Sample {
            time_ns: time(last),
            process: Some(process(last)),
            context: Some(end_context(last)),
            gpu_processes: vec![mine(last)],
            requests: Some(pb::RequestReadings {
                readings,
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    samples.sort_by_key(|s| s.time_ns);
    let mut events = Vec::new();
    expand_all(&mut samples, &mut events);
    Evidence {
        hello: Some(pb::Hello {
            agent_id: "candle".into(),
            name: "candle".into(),
            pid: g.own_pid,
            runtime: "rust".into(),
            gpus: vec![pb::GpuPlacement {
                index: 0,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                total_bytes: g.total,
                ..Default::default()
            }],
            ..Default::default()
        }),
        samples,
        events,
        ..Default::default()
    }
}

fn kinds(d: &pb::Diagnosis) -> Vec<&str> {
    d.causes.iter().map(|c| c.kind.as_str()).collect()
}

fn leak_of(d: &pb::Diagnosis) -> &pb::Cause {
    d.causes
        .iter()
        .find(|c| c.kind == "leak")
        .unwrap_or_else(|| panic!("no leak: {:#?}", d.causes))
}

#[test]
fn device_memory_growing_per_request_is_a_leak_with_its_bytes_per_request() {
    let g = h200();
    let e = evidence(
        View::Own,
        |i| g.own + LEAK * i + page_jitter(i),
        |_| g.other,
    );
    let d = diagnose(&e);
    let c = leak_of(&d);
    let per_request = c.metrics["bytes_per_request"];
    assert!(
        (per_request - LEAK as f64).abs() < 0.01 * LEAK as f64,
        "{per_request} B/request against {LEAK}: {c:#?}"
    );
    // Read from the request ends (one a message) and the periodic samples.
    let seen = c.metrics["requests_seen"];
    assert!(seen >= (REQUESTS - ENDS_PER_MESSAGE) as f64, "{c:#?}");
    assert_eq!(
        c.metrics["device_used_bytes"],
        (g.own + LEAK * REQUESTS + page_jitter(REQUESTS)) as f64
    );
    let text = c.evidence.join("\n");
    // Its runway is against the H200's total.
    assert!(
        c.evidence[0].starts_with("runway:") && text.contains("140.4 GiB"),
        "{text}"
    );
    assert!(
        text.contains("this process's device memory (NVML)"),
        "{text}"
    );
    assert!(text.contains("candle"), "a Rust program's words: {text}");
    for foreign in [
        "tracemalloc",
        "PYTORCH_CUDA_ALLOC_CONF",
        "live tensors: empty_cache",
    ] {
        assert!(!text.contains(foreign), "{foreign}: {text}");
    }
}

#[test]
fn an_older_agents_entries_count_by_the_processs_pid() {
    let g = h200();
    let e = evidence(View::Unspecified, |i| g.own + LEAK * i, |_| g.other);
    let per_request = leak_of(&diagnose(&e)).metrics["bytes_per_request"];
    assert!((per_request - LEAK as f64).abs() < 0.01 * LEAK as f64);
}

#[test]
fn flat_device_memory_is_no_leak() {
    let g = h200();
    // A KV block that comes and goes: 0 to 2 MiB over the loaded figure.
    let e = evidence(View::Own, |i| g.own + (i % 3) * MIB, |_| g.other);
    let d = diagnose(&e);
    assert!(!kinds(&d).contains(&"leak"), "{:#?}", d.causes);
}

#[test]
fn another_processs_growth_on_the_gpu_is_not_this_ones_leak() {
    let g = h200();
    let e = evidence(View::Own, |_| g.own, |i| g.other + 8 * MIB * i);
    let d = diagnose(&e);
    assert!(!kinds(&d).contains(&"leak"), "{:#?}", d.causes);
}

#[test]
fn an_entry_no_one_could_resolve_is_no_ones_leak() {
    // In a container NVML's pids are the host's: growth under a pid the
    // agent could not resolve is not known to be this process's.
    let g = h200();
    let e = evidence(View::Unresolved, |i| g.own + LEAK * i, |_| g.other);
    let d = diagnose(&e);
    assert!(!kinds(&d).contains(&"leak"), "{:#?}", d.causes);
}

#[test]
fn a_host_leak_says_what_nvml_saw_of_the_device() {
    let g = h200();
    let e = evidence_with_rss(View::Own, |_| g.own, |_| g.other, |i| 900 * MIB + LEAK * i);
    let d = diagnose(&e);
    assert!(!kinds(&d).contains(&"leak"), "{:#?}", d.causes);
    let c = d
        .causes
        .iter()
        .find(|c| c.kind == "host_growth")
        .unwrap_or_else(|| panic!("no host_growth: {:#?}", d.causes));
    let per_request = c.metrics["bytes_per_request"];
    assert!(
        (per_request - LEAK as f64).abs() < 0.01 * LEAK as f64,
        "{c:#?}"
    );
    let text = c.evidence.join("\n");
    assert!(
        text.contains("this process's device memory (NVML) between requests stayed flat"),
        "{text}"
    );
    assert!(!text.contains("no device allocator readings"), "{text}");
}
