//! Timeline causes the H200 captures do not exercise: host growth with a flat
//! GPU, a heap census naming the retained type, a GcCollection event, and
//! warm-up host growth that levels off.

use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn hello() -> pb::Hello {
    pb::Hello {
        agent_id: "a".into(),
        name: "a".into(),
        gpus: vec![pb::GpuPlacement {
            total_bytes: 80 * GIB,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn between(i: u64, allocated: u64, rss: u64) -> pb::Sample {
    pb::Sample {
        time_ns: i as i64 * 1_000_000_000,
        allocator: vec![pb::AllocatorStats {
            allocated_bytes: allocated,
            allocated_peak_bytes: allocated,
            reserved_bytes: allocated,
            ..Default::default()
        }],
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

fn system(total: u64) -> pb::SystemMemory {
    pb::SystemMemory {
        mem_total_bytes: total,
        ..Default::default()
    }
}

#[test]
fn host_rss_growth_with_a_flat_gpu_is_host_growth() {
    // 60 requests a second apart: past the warm-up window (the first 30 s).
    let mut samples: Vec<pb::Sample> = (1..=60u64)
        .map(|i| between(i, 2 * GIB, GIB + 8 * MIB * i))
        .collect();
    samples.last_mut().unwrap().system = Some(system(64 * GIB));
    let e = Evidence {
        hello: Some(hello()),
        samples,
        ..Default::default()
    };
    let d = diagnose(&e);
    let c = &d.causes[0];
    assert_eq!(c.kind, "host_growth", "{:?}", d.causes);
    assert_eq!(c.metrics["bytes_per_request"], (8 * MIB) as f64);
    let left = (64 * GIB - (GIB + 8 * MIB * 60)) as f64 / (8 * MIB) as f64;
    assert_eq!(c.metrics["requests_to_limit"], left.floor());
    assert!(!d.causes.iter().any(|c| c.kind == "leak"));
    assert!(d.domain.is_none());
    assert!(d.fixes.iter().all(|f| !f.retest.is_empty()));
}

#[test]
fn warm_up_host_growth_that_levels_off_is_not_host_growth() {
    let samples = (1..=40u64)
        .map(|i| between(i, 2 * GIB, GIB + 32 * MIB * i.min(8)))
        .collect();
    let e = Evidence {
        hello: Some(hello()),
        samples,
        ..Default::default()
    };
    assert!(diagnose(&e).causes.iter().all(|c| c.kind != "host_growth"));
}

fn census(t: i64, tensors: u64, dicts: u64) -> pb::Event {
    pb::Event {
        time_ns: t,
        kind: Some(Kind::HeapCensus(pb::HeapCensus {
            types: vec![
                pb::TypeCount {
                    type_name: "torch.Tensor[cuda:0]".into(),
                    count: tensors,
                    bytes: tensors * 8 * MIB,
                    ..Default::default()
                },
                pb::TypeCount {
                    type_name: "dict".into(),
                    count: dicts,
                    bytes: dicts * 1024,
                    ..Default::default()
                },
            ],
            referrer_chain: vec!["app.history".into(), "list".into()],
            ..Default::default()
        })),
    }
}

#[test]
fn a_leak_names_the_retained_python_type_from_the_heap_census() {
    let samples = (0..=20u64)
        .map(|i| between(i, GIB + 8 * MIB * i, GIB))
        .collect();
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: vec![census(500_000_000, 0, 100), census(20_500_000_000, 20, 140)],
        incident: None,
    };
    let d = diagnose(&e);
    let leak = d.causes.iter().find(|c| c.kind == "leak").expect("a leak");
    assert_eq!(leak.metrics["bytes_per_request"], (8 * MIB) as f64);
    assert_eq!(
        leak.metrics["retained_type_bytes_per_request"],
        (8 * MIB) as f64
    );
    let line = leak
        .evidence
        .iter()
        .find(|l| l.contains("Python heap"))
        .expect("a heap line");
    assert!(
        line.contains("torch.Tensor[cuda:0]") && line.contains("+1.0 objects"),
        "{line}"
    );
    assert!(line.contains("app.history -> list"), "{line}");
}

#[test]
fn growth_that_a_gc_collection_event_frees_is_gc_retained() {
    let mut samples: Vec<pb::Sample> = (0..=20u64)
        .map(|i| between(i, GIB + 16 * MIB * i, GIB))
        .collect();
    samples.push(between(21, GIB, GIB));
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: vec![pb::Event {
            time_ns: 20_500_000_000,
            kind: Some(Kind::Gc(pb::GcCollection {
                generation: 2,
                collected: 4000,
                ..Default::default()
            })),
        }],
        incident: None,
    };
    let d = diagnose(&e);
    assert_eq!(d.causes[0].kind, "gc_retained", "{:?}", d.causes);
    assert_eq!(d.causes[0].metrics["reclaimed_bytes"], (320 * MIB) as f64);
    assert!(d.causes.iter().all(|c| c.kind != "leak"));
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
}

/// A `device_map="auto"` process: its first GPU holds a flat 1 GiB, its
/// second grows 8 MiB a request until the allocation there fails. The
/// growth is read on the failing device, not on the first one read.
#[test]
fn growth_is_read_on_the_failing_device_not_the_first() {
    let samples: Vec<pb::Sample> = (0..=20u64)
        .map(|i| {
            let mut s = between(i, GIB, GIB);
            s.allocator[0].device_uuid = "GPU-aaaa0000".into();
            let mut second = s.allocator[0].clone();
            second.device = 1;
            second.device_uuid = "GPU-dddd3333".into();
            second.allocated_bytes = 2 * GIB + 8 * MIB * i;
            second.allocated_peak_bytes = second.allocated_bytes;
            second.reserved_bytes = second.allocated_bytes;
            s.allocator.push(second);
            s
        })
        .collect();
    let oom = pb::Event {
        time_ns: 20_500_000_000,
        kind: Some(Kind::Oom(pb::Oom {
            device: 1,
            device_uuid: "GPU-dddd3333".into(),
            requested_bytes: 64 * MIB,
            error_type: "OutOfMemoryError".into(),
            ..Default::default()
        })),
    };
    let e = Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello()),
        samples,
        events: vec![oom],
        incident: None,
    };
    let d = diagnose(&e);
    let leak = d
        .causes
        .iter()
        .find(|c| c.kind == "leak")
        .unwrap_or_else(|| panic!("a leak on the failing device: {:?}", d.causes));
    assert_eq!(leak.metrics["bytes_per_request"], (8 * MIB) as f64);
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
    let device = d.device.as_ref().expect("the failing device");
    assert_eq!(device.uuid, "GPU-dddd3333");
}
