//! The `oomscope diagnose --json` shape, the `Diagnosis` message's serde
//! form (oomscope-proto's `serde` feature): every key present, with its type.

mod common;

use common::*;
use oomscope_analysis::{diagnose, pb};
use serde_json::Value;

const KEYS: [&str; 14] = [
    "device",
    "incident",
    "agent",
    "domain",
    "trigger",
    "causes",
    "fixes",
    "capacity",
    "evidence",
    "exit",
    "cgroup",
    "failure",
    "victim",
    "kernel_report",
];

const KERNEL_REPORT_KEYS: [&str; 16] = [
    "pid",
    "command",
    "anon_rss_bytes",
    "file_rss_bytes",
    "shmem_rss_bytes",
    "total_vm_bytes",
    "constraint",
    "oom_memcg",
    "task_memcg",
    "memcg_usage_bytes",
    "memcg_limit_bytes",
    "oom_score_adj",
    "order",
    "nodemask",
    "mems_allowed",
    "cpuset",
];

const DEVICE_KEYS: [&str; 8] = [
    "certain",
    "identified_by",
    "name",
    "nvml_index",
    "ordinal",
    "parent_uuid",
    "total_bytes",
    "uuid",
];

const FAILURE_KEYS: [&str; 13] = [
    "time_ns",
    "kind",
    "requested_bytes",
    "phase",
    "active_tokens",
    "active_sequences",
    "requests_done",
    "kv_cache_bytes",
    "error_text",
    "oom_device",
    "stats",
    "stats_from_ns",
    "expandable_segments",
];

fn check_top_level(j: &Value) {
    let obj = j.as_object().expect("an object");
    let mut got: Vec<&str> = obj.keys().map(String::as_str).collect();
    got.sort();
    let mut sorted = KEYS.to_vec();
    sorted.sort();
    assert_eq!(got, sorted, "exactly the documented keys");
    for k in ["incident", "agent", "domain", "trigger"] {
        assert!(j[k].is_string() || j[k].is_null(), "{k}: {}", j[k]);
    }
    assert!(j["causes"].is_array() && j["fixes"].is_array() && j["evidence"].is_array());
    assert!(j["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .all(Value::is_string));
    assert!(j["capacity"].is_object() || j["capacity"].is_null());
    for c in j["causes"].as_array().unwrap() {
        let mut keys: Vec<&String> = c.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            ["confidence", "evidence", "kind", "metrics", "processes"]
        );
        assert!(c["kind"].is_string() && c["confidence"].is_f64());
        assert!(c["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .all(Value::is_string));
        assert!(c["metrics"]
            .as_object()
            .unwrap()
            .values()
            .all(Value::is_number));
        for p in c["processes"].as_array().unwrap() {
            assert!(p["pid"].is_u64() && p["bytes"].is_u64());
            assert!(p["user"].is_string() || p["user"].is_null());
            assert!(p["command"].is_string() || p["command"].is_null());
            assert_eq!(p.as_object().unwrap().len(), 4);
        }
    }
    for f in j["fixes"].as_array().unwrap() {
        assert_eq!(f.as_object().unwrap().len(), 4);
        assert!(f["action"].is_string() && f["retest"].is_string());
        assert!(["low", "medium", "high"].contains(&f["risk"].as_str().unwrap()));
        assert!(f["caveat"].is_string() || f["caveat"].is_null());
    }
    if !j["exit"].is_null() {
        assert_eq!(j["exit"].as_object().unwrap().len(), 2);
        assert!(j["exit"]["code"].is_i64() || j["exit"]["code"].is_null());
        assert!(j["exit"]["signal"].is_i64() || j["exit"]["signal"].is_null());
    }
    if !j["cgroup"].is_null() {
        assert_eq!(j["cgroup"].as_object().unwrap().len(), 3);
        assert!(j["cgroup"]["path"].is_string() && j["cgroup"]["owner_level"].is_string());
        assert!(j["cgroup"]["limit_bytes"].is_u64());
    }
    if !j["victim"].is_null() {
        let v = j["victim"].as_object().unwrap();
        assert_eq!(v.len(), 4);
        assert!(j["victim"]["pid"].is_u64());
        let status = &j["victim"]["status"];
        assert!(status.is_null() || status.as_object().unwrap().len() == 2);
        assert!(j["victim"]["command"].is_string() && j["victim"]["title"].is_string());
    }
    if !j["kernel_report"].is_null() {
        let k = &j["kernel_report"];
        let mut keys: Vec<&str> = k.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        let mut want = KERNEL_REPORT_KEYS.to_vec();
        want.sort();
        assert_eq!(keys, want);
        assert!(k["order"].is_null() || k["order"].is_u64());
        for key in [
            "command",
            "constraint",
            "oom_memcg",
            "task_memcg",
            "nodemask",
            "mems_allowed",
            "cpuset",
        ] {
            assert!(k[key].is_string(), "{key}: {}", k[key]);
        }
        assert!(k["oom_score_adj"].is_i64());
        for key in KERNEL_REPORT_KEYS
            .iter()
            .filter(|key| key.ends_with("_bytes") || **key == "pid")
        {
            assert!(k[key].is_u64(), "{key}: {}", k[key]);
        }
    }
    if !j["device"].is_null() {
        let d = &j["device"];
        let mut keys: Vec<&str> = d.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, DEVICE_KEYS);
        for k in ["uuid", "name", "parent_uuid"] {
            assert!(d[k].is_string() || d[k].is_null(), "{k}: {}", d[k]);
        }
        for k in ["ordinal", "nvml_index"] {
            assert!(d[k].is_i64() || d[k].is_null(), "{k}: {}", d[k]);
        }
        assert!(d["total_bytes"].is_u64() || d["total_bytes"].is_null());
        assert!(d["identified_by"].is_string() && d["certain"].is_boolean());
    }
    if !j["failure"].is_null() {
        let f = &j["failure"];
        let mut keys: Vec<&str> = f.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        let mut want = FAILURE_KEYS.to_vec();
        want.sort();
        assert_eq!(keys, want);
        assert!(f["time_ns"].is_i64() && f["kind"].is_string());
        assert!(f["expandable_segments"].is_boolean());
        for k in ["phase", "error_text"] {
            assert!(f[k].is_string() || f[k].is_null(), "{k}: {}", f[k]);
        }
        for k in [
            "requested_bytes",
            "active_tokens",
            "active_sequences",
            "requests_done",
            "kv_cache_bytes",
        ] {
            assert!(f[k].is_u64() || f[k].is_null(), "{k}: {}", f[k]);
        }
        assert!(f["oom_device"].is_i64() || f["oom_device"].is_null());
        assert!(f["stats_from_ns"].is_i64() || f["stats_from_ns"].is_null());
        if !f["stats"].is_null() {
            // The allocator's reading whole; its headline numbers as numbers.
            for k in [
                "allocated_bytes",
                "reserved_bytes",
                "inactive_split_bytes",
                "num_alloc_retries",
                "driver_free_bytes",
                "driver_total_bytes",
            ] {
                assert!(f["stats"][k].is_u64(), "{k}: {}", f["stats"]);
            }
        }
    }
}

fn cgroup_kill() -> pb::Diagnosis {
    let own = "/oomtest/child";
    let before = counters(
        T0,
        vec![v1(own, 64 * MIB, MIB, 2 * MIB, 0, 0)],
        system(10, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![v1(own, 64 * MIB, 66_973_696, 67_108_864, 312, 1)],
        system(11, 12 * GIB),
    );
    diagnose(&supervised(
        exit(None, Some(9), "", before, after, None),
        "signal",
    ))
}

#[test]
fn a_cgroup_verdict_has_every_key_with_its_type() {
    let j = to_json(&cgroup_kill());
    check_top_level(&j);
    assert_eq!(j["incident"], "inc-1");
    assert_eq!(j["victim"]["pid"], CHILD_PID, "the child that died");
    assert_eq!(j["agent"], "oomtest");
    assert_eq!(j["domain"], "cgroup");
    // Something failed before any reading of the process: nothing grew first.
    assert_eq!(j["trigger"], "immediate");
    assert!(j["capacity"].is_null());
    assert_eq!(j["exit"], serde_json::json!({"code": null, "signal": 9}));
    assert_eq!(
        j["cgroup"],
        serde_json::json!({"path": "/oomtest/child", "limit_bytes": 67108864u64, "owner_level": "/oomtest/child"})
    );
    let c = &j["causes"][0];
    assert_eq!(c["kind"], "cgroup_limit");
    // Whole byte counts print as integers, not 67108864.0.
    assert!(c["metrics"]["limit_bytes"].is_u64(), "{}", c["metrics"]);
    assert_eq!(c["metrics"]["limit_bytes"].as_u64(), Some(67_108_864));
    assert!(j.to_string().contains("\"limit_bytes\":67108864,"));
    assert!(!j["fixes"].as_array().unwrap().is_empty());
    // A kill: the incident's facts, no allocator OOM behind them.
    assert_eq!(j["failure"]["kind"], "signal");
    assert_eq!(j["failure"]["time_ns"], T0 + 3 * SEC);
    assert!(j["failure"]["oom_device"].is_null() && j["failure"]["stats"].is_null());
    assert!(j["kernel_report"].is_null(), "no kernel record here");
}

#[test]
fn a_kernel_record_is_in_the_json_whole() {
    let (pid, anon) = (4242u32, 2u64 << 30);
    let mut e = supervised(
        exit(
            None,
            Some(9),
            "",
            counters(T0, vec![], system(10, 12 * GIB)),
            counters(T0 + 3 * SEC, vec![], system(11, 12 * GIB)),
            None,
        ),
        "signal",
    );
    e.events.push(pb::Event {
        time_ns: T0 + 3 * SEC,
        kind: Some(pb::event::Kind::KernelOomKill(pb::KernelOomKill {
            pid,
            task: "python3".into(),
            constraint: "CONSTRAINT_NONE".into(),
            anon_rss_bytes: anon,
            oom_score_adj: -100,
            ..Default::default()
        })),
    });
    let j = to_json(&diagnose(&e));
    check_top_level(&j);
    let k = &j["kernel_report"];
    assert_eq!(k["pid"], pid);
    assert_eq!(k["command"], "python3");
    assert_eq!(k["anon_rss_bytes"], anon);
    assert_eq!(k["oom_score_adj"], -100);
    assert_eq!(k["memcg_limit_bytes"], 0);
}

#[test]
fn a_device_oom_carries_its_failure() {
    let stats = pb::AllocatorStats {
        device: 1,
        allocated_bytes: 70 * GIB,
        reserved_bytes: 72 * GIB,
        driver_total_bytes: 80 * GIB,
        ..Default::default()
    };
    let context = pb::RequestContext {
        phase: "decode".into(),
        active_tokens: 4096,
        active_sequences: 8,
        requests_done: 120,
        ..Default::default()
    };
    let reading = pb::Sample {
        time_ns: T0,
        allocator: vec![stats.clone()],
        context: Some(context),
        ..Default::default()
    };
    // A replayed capture: the OOM carries the last reading's stats, no context.
    let oom = pb::Event {
        time_ns: T0 + SEC,
        kind: Some(pb::event::Kind::Oom(pb::Oom {
            device: 1,
            requested_bytes: 2 * GIB,
            error_type: "OutOfMemoryError".into(),
            error_text: "CUDA out of memory. Tried to allocate 2.00 GiB".into(),
            stats: Some(stats),
            ..Default::default()
        })),
    };
    let mut e = supervised(oom, "oom");
    e.samples.push(reading);
    let j = to_json(&diagnose(&e));
    check_top_level(&j);
    let f = &j["failure"];
    assert_eq!(f["kind"], "oom");
    assert_eq!(f["time_ns"], T0 + SEC);
    assert_eq!(f["requested_bytes"], 2 * GIB);
    assert_eq!(f["phase"], "decode");
    assert_eq!(f["active_tokens"], 4096);
    assert_eq!(f["active_sequences"], 8);
    assert_eq!(f["requests_done"], 120);
    assert!(f["kv_cache_bytes"].is_null(), "no KV bytes reported");
    assert_eq!(
        f["error_text"],
        "CUDA out of memory. Tried to allocate 2.00 GiB"
    );
    assert_eq!(f["oom_device"], 1);
    assert_eq!(f["stats"]["allocated_bytes"], 70 * GIB);
    assert_eq!(f["stats"]["reserved_bytes"], 72 * GIB);
    assert_eq!(f["stats_from_ns"], T0, "the stats are the last reading's");
    assert_eq!(f["expandable_segments"], false);
    // Ordinal 1, read by no NVML and tied to no uuid: the device is known by
    // its ordinal alone, its identity empty rather than guessed.
    let d = &j["device"];
    assert_eq!(d["ordinal"], 1);
    assert!(d["uuid"] == "" && d["nvml_index"].is_null());
    assert!(
        d["identified_by"]
            .as_str()
            .unwrap()
            .contains("the OOM event is on ordinal 1"),
        "{d}"
    );
}

#[test]
fn a_clean_exit_prints_nulls_not_missing_keys() {
    let own = "/oomtest/child";
    let levels = vec![v1(own, 64 * MIB, MIB, 2 * MIB, 0, 0)];
    let mut e = supervised(
        exit(
            Some(0),
            None,
            "",
            counters(T0, levels.clone(), system(1, GIB)),
            counters(T0, levels, system(1, GIB)),
            None,
        ),
        "signal",
    );
    e.incident = None;
    let j = to_json(&diagnose(&e));
    check_top_level(&j);
    assert!(j["incident"].is_null() && j["domain"].is_null() && j["cgroup"].is_null());
    assert!(j["failure"].is_null(), "no incident, no failure");
    assert_eq!(j["agent"], "oomtest");
    assert_eq!(j["exit"], serde_json::json!({"code": 0, "signal": null}));
    assert_eq!(j["causes"], serde_json::json!([]));
}

#[test]
fn capacity_and_fractional_metrics() {
    let mut d = cgroup_kill();
    d.capacity = r#"{"max_concurrent_sequences": 3, "bytes_per_token": 131072}"#.into();
    d.causes[0].metrics.insert("refaults_per_s".into(), 966.5);
    d.causes[0].metrics.insert("bad".into(), f64::NAN);
    let j = to_json(&d);
    check_top_level(&j);
    assert_eq!(j["capacity"]["bytes_per_token"], 131072);
    assert_eq!(
        j["causes"][0]["metrics"]["refaults_per_s"].as_f64(),
        Some(966.5)
    );
    assert!(
        j["causes"][0]["metrics"].get("bad").is_none(),
        "NaN is not a JSON number"
    );

    d.capacity = "not json".into();
    assert!(to_json(&d)["capacity"].is_null());
}
