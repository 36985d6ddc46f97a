//! The serde derives (`--features serde`): messages with nested oneofs, maps
//! and proto3 `optional` fields survive serde_json, in the shape the proto3
//! JSON mapping gives them (proto field names, oneof members by their own
//! name), and missing fields take their proto defaults.
#![cfg(feature = "serde")]

use oomscope_proto::v1 as pb;
use serde_json::json;

fn oom_message() -> pb::AgentMessage {
    pb::AgentMessage {
        seq: 7,
        body: Some(pb::agent_message::Body::Event(pb::Event {
            time_ns: 1_700_000_000_000_000_000,
            kind: Some(pb::event::Kind::Oom(pb::Oom {
                device: 1,
                requested_bytes: 2 << 30,
                observer: Some(pb::OomObserver {
                    device: 1,
                    alloc: 2 << 30,
                    device_allocated: 80 << 30,
                    device_free: 1 << 20,
                }),
                error_type: "OutOfMemoryError".into(),
                stats: Some(pb::AllocatorStats {
                    device: 1,
                    reserved_bytes: 79 << 30,
                    raw: [("num_ooms".to_string(), 3), ("max_split_size".into(), -1)].into(),
                    ..Default::default()
                }),
                context: Some(pb::RequestContext {
                    phase: "decode".into(),
                    numbers: [("temperature".to_string(), 0.7)].into(),
                    labels: [("model".to_string(), "llama".to_string())].into(),
                    ..Default::default()
                }),
                ..Default::default()
            })),
        })),
    }
}

#[test]
fn nested_oneofs_maps_and_optionals_round_trip() {
    let child_exit = pb::AgentMessage {
        seq: 8,
        body: Some(pb::agent_message::Body::Event(pb::Event {
            time_ns: 5,
            kind: Some(pb::event::Kind::ChildExit(pb::ChildExit {
                pid: 42,
                exit_code: None,
                signal: Some(9),
                after: Some(pb::HostCounters {
                    cgroup: vec![pb::CgroupLevel {
                        path: "/app".into(),
                        swap_limit_bytes: Some(0),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            })),
        })),
    };
    for m in [oom_message(), child_exit, pb::AgentMessage::default()] {
        let text = serde_json::to_string(&m).unwrap();
        let back: pb::AgentMessage = serde_json::from_str(&text).unwrap();
        assert_eq!(back, m, "{text}");
    }
}

#[test]
fn oneof_members_sit_in_their_message_by_field_name() {
    let v = serde_json::to_value(oom_message()).unwrap();
    let oom = &v["event"]["oom"];
    assert_eq!(v["seq"], 7);
    assert_eq!(v["event"]["time_ns"], 1_700_000_000_000_000_000i64);
    assert_eq!(oom["observer"]["device_allocated"], 80u64 << 30);
    assert_eq!(
        oom["stats"]["raw"],
        json!({"num_ooms": 3, "max_split_size": -1})
    );
    assert_eq!(oom["context"]["labels"]["model"], "llama");
    assert_eq!(oom["snapshot"], json!(null));
    let d = serde_json::to_value(pb::Directive {
        kind: Some(pb::directive::Kind::RunHeapCensus(pb::RunHeapCensus {
            time_budget_ms: 50,
        })),
    })
    .unwrap();
    assert_eq!(d, json!({"run_heap_census": {"time_budget_ms": 50}}));
}

#[test]
fn missing_fields_take_proto_defaults() {
    let m: pb::AgentMessage =
        serde_json::from_value(json!({"event": {"child_exit": {"pid": 3}}})).unwrap();
    let Some(pb::agent_message::Body::Event(e)) = m.body else {
        panic!("{m:?}")
    };
    let Some(pb::event::Kind::ChildExit(c)) = e.kind else {
        panic!("{e:?}")
    };
    assert_eq!(
        (m.seq, e.time_ns, c.pid, c.exit_code, c.signal),
        (0, 0, 3, None, None)
    );
    let empty: pb::Event = serde_json::from_value(json!({})).unwrap();
    assert_eq!(empty, pb::Event::default());
}

#[test]
fn enum_fields_read_and_write_their_lowercase_names() {
    let p = pb::GpuProcessUsage {
        pid: 5,
        view: pb::PidView::Unresolved as i32,
        ..Default::default()
    };
    let v = serde_json::to_value(p).unwrap();
    assert_eq!(v["view"], "unresolved");
    assert_eq!(serde_json::from_value::<pb::GpuProcessUsage>(v).unwrap(), p);
    // The proto name and the number read too; a number this build does not
    // name (a newer peer's) stays a number both ways.
    for (input, view) in [(json!("PID_VIEW_OWN"), 1), (json!(2), 2), (json!(9), 9)] {
        let back: pb::GpuProcessUsage = serde_json::from_value(json!({ "view": input })).unwrap();
        assert_eq!(back.view, view, "{input}");
    }
    let newer = pb::GpuProcessUsage {
        view: 9,
        ..Default::default()
    };
    assert_eq!(serde_json::to_value(newer).unwrap()["view"], 9);
    assert!(serde_json::from_value::<pb::GpuProcessUsage>(json!({"view": "sideways"})).is_err());
}

#[test]
fn maps_print_in_key_order_and_whole_numbers_as_integers() {
    let c = pb::Cause {
        kind: "leak".into(),
        metrics: [
            ("slope_bytes_per_s".to_string(), 1.5),
            ("growth_bytes".into(), (3u64 << 30) as f64),
            ("nan".into(), f64::NAN),
            ("alpha".into(), -2.0),
        ]
        .into(),
        ..Default::default()
    };
    let text = serde_json::to_string(&c).unwrap();
    assert!(
        text.contains(
            r#""metrics":{"alpha":-2,"growth_bytes":3221225472,"slope_bytes_per_s":1.5}"#
        ),
        "{text}"
    );
    let back: pb::Cause = serde_json::from_str(&text).unwrap();
    assert_eq!(back.metrics["growth_bytes"], (3u64 << 30) as f64);
    assert!(!back.metrics.contains_key("nan"));
}

#[test]
fn the_capacity_estimate_is_an_object_or_null() {
    let mut d = pb::Diagnosis {
        capacity: r#"{"safe_sequences": 3, "bytes_per_token": 131072}"#.into(),
        ..Default::default()
    };
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(v["capacity"]["bytes_per_token"], 131072);
    let back: pb::Diagnosis = serde_json::from_value(v).unwrap();
    let again: serde_json::Value = serde_json::from_str(&back.capacity).unwrap();
    assert_eq!(again["safe_sequences"], 3);
    for text in ["", "not json", "[1]"] {
        d.capacity = text.into();
        let v = serde_json::to_value(&d).unwrap();
        assert!(v["capacity"].is_null(), "{text:?}: {v}");
        assert_eq!(
            serde_json::from_value::<pb::Diagnosis>(v).unwrap().capacity,
            ""
        );
    }
}
