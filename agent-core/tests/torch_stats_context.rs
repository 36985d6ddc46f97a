//! allocator_stats, request_context, allocator_settings and oom_event against
//! the real H200 captures in tests/fixtures/torch-h200 and hand-made edge cases.

use std::collections::BTreeMap;

use oomscope_agent_core::pb;
use oomscope_agent_core::torch;
use serde_json::{json, Map, Value};
use torch_h200::assert_context_key;

use oomscope_testkit::torch_h200;

fn timeline(v: &Value) -> &[Value] {
    v.get("timeline")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

#[test]
fn allocator_stats_match_every_fixture_sample() {
    let mut checked = 0;
    for (name, capture) in torch_h200::captures() {
        for (i, entry) in timeline(&capture).iter().enumerate() {
            let ms = entry["memory_stats"].as_object().unwrap();
            let stats = torch::allocator_stats_from_json(0, ms, entry.get("mem_get_info"));
            let want = |k: &str| ms[k].as_u64().unwrap_or_else(|| panic!("{name}[{i}] {k}"));
            let pairs = [
                (stats.allocated_bytes, "allocated_bytes.all.current"),
                (stats.allocated_peak_bytes, "allocated_bytes.all.peak"),
                (stats.reserved_bytes, "reserved_bytes.all.current"),
                (stats.reserved_peak_bytes, "reserved_bytes.all.peak"),
                (stats.active_bytes, "active_bytes.all.current"),
                (stats.active_peak_bytes, "active_bytes.all.peak"),
                (
                    stats.inactive_split_bytes,
                    "inactive_split_bytes.all.current",
                ),
                (
                    stats.inactive_split_peak_bytes,
                    "inactive_split_bytes.all.peak",
                ),
                (stats.requested_bytes, "requested_bytes.all.current"),
                (stats.requested_peak_bytes, "requested_bytes.all.peak"),
                (stats.num_alloc_retries, "num_alloc_retries"),
                (stats.num_ooms, "num_ooms"),
                (stats.num_device_alloc, "num_device_alloc"),
                (stats.num_device_free, "num_device_free"),
                (stats.segments, "segment.all.current"),
                (stats.segments_peak, "segment.all.peak"),
                (stats.allocations, "allocation.all.current"),
                (stats.inactive_split_blocks, "inactive_split.all.current"),
            ];
            for (got, key) in pairs {
                assert_eq!(got, want(key), "{name} timeline[{i}] {key}");
            }
            // Every key verbatim, max_split_size (-1) included.
            assert_eq!(stats.raw.len(), ms.len(), "{name}[{i}] raw keys");
            for (k, v) in ms {
                assert_eq!(stats.raw.get(k).copied(), v.as_i64(), "{name}[{i}] raw {k}");
            }
            assert_eq!(stats.raw["max_split_size"], -1);
            assert_eq!(
                stats.driver_free_bytes,
                entry["mem_get_info"]["free"].as_u64().unwrap()
            );
            assert_eq!(
                stats.driver_total_bytes,
                entry["mem_get_info"]["total"].as_u64().unwrap()
            );
            checked += 1;
        }
    }
    assert!(checked > 300, "only {checked} samples checked");
}

#[test]
fn allocator_stats_tolerate_odd_numbers() {
    let ms = json!({
        "allocated_bytes.all.current": 1048576.0,   // integral float: kept
        "reserved_bytes.all.current": 2.5,          // fraction: skipped
        "num_ooms": "three",                        // text: skipped
        "num_alloc_retries": -4,                    // negative: raw only
        "segment.all.current": 18446744073709551615u64, // above i64: skipped
        "max_split_size": 1.0e20,                   // out of i64 range: skipped
        "flag": true,
    });
    let stats =
        torch::allocator_stats_from_json(3, ms.as_object().unwrap(), Some(&json!({"free": "x"})));
    assert_eq!(stats.device, 3);
    assert_eq!(stats.allocated_bytes, 1 << 20);
    assert_eq!(stats.reserved_bytes, 0);
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.num_alloc_retries, 0);
    assert_eq!(stats.segments, 0);
    assert_eq!((stats.driver_free_bytes, stats.driver_total_bytes), (0, 0));
    let raw: BTreeMap<_, _> = stats.raw.into_iter().collect();
    assert_eq!(
        raw,
        BTreeMap::from([
            ("allocated_bytes.all.current".to_string(), 1 << 20),
            ("num_alloc_retries".to_string(), -4)
        ])
    );
    // The int-map form the Python extension uses gives the same shape.
    let ints = BTreeMap::from([("num_ooms".to_string(), 2i64)]);
    let stats = torch::allocator_stats(0, &ints, Some((5, 9)));
    assert_eq!(
        (
            stats.num_ooms,
            stats.driver_free_bytes,
            stats.driver_total_bytes
        ),
        (2, 5, 9)
    );
}

#[test]
fn every_fixture_context_key_lands_somewhere() {
    let mut keys = std::collections::BTreeSet::new();
    for (name, capture) in torch_h200::captures() {
        for (i, entry) in timeline(&capture).iter().enumerate() {
            let raw = entry["context"].as_object().unwrap();
            let ctx = torch::request_context(raw);
            for (k, v) in raw {
                assert_context_key(&ctx, k, v, &format!("{name}[{i}]"));
                keys.insert(k.clone());
            }
        }
    }
    // The fixtures exercise fields, numbers and labels alike.
    for k in [
        "phase",
        "kv_bytes",
        "active_tokens",
        "model",
        "model_bytes",
        "layers_loaded",
        "last_batch",
    ] {
        assert!(keys.contains(k), "no fixture has context key {k}");
    }
}

#[test]
fn request_context_fields_numbers_and_labels() {
    let raw = json!({
        "phase": "decode", "request_id": "r-17", "kv_bytes": 1879048192u64, "active_tokens": 14336,
        "batch_size": 4, "model": "llama-random", "hidden": 2048, "ratio": 0.5,
        "active_sequences": -1, "queued": "lots", "extra": {"a": [1, 2]}, "flag": true, "gone": null,
        "prompt_tokens": 12.0,
    });
    let raw = raw.as_object().unwrap();
    let ctx = torch::request_context(raw);
    assert_eq!(ctx.phase, "decode");
    assert_eq!(ctx.request_id, "r-17");
    assert_eq!(ctx.kv_cache_bytes, 1879048192);
    assert_eq!(ctx.active_tokens, 14336);
    assert_eq!(ctx.batch_size, 4);
    assert_eq!(ctx.prompt_tokens, 12);
    assert_eq!(ctx.labels["model"], "llama-random");
    assert_eq!(ctx.numbers["hidden"], 2048.0);
    assert_eq!(ctx.numbers["ratio"], 0.5);
    // Values a field cannot hold are kept, not dropped.
    assert_eq!(ctx.active_sequences, 0);
    assert_eq!(ctx.numbers["active_sequences"], -1.0);
    assert_eq!(ctx.labels["queued"], "lots");
    assert_eq!(ctx.labels["extra"], r#"{"a":[1,2]}"#);
    assert_eq!(ctx.labels["flag"], "true");
    assert_eq!(ctx.labels["gone"], "null");
    for (k, v) in raw {
        assert_context_key(&ctx, k, v, "hand-made");
    }
    assert_eq!(
        torch::request_context(&Map::new()),
        pb::RequestContext::default()
    );
}

#[test]
fn tried_to_allocate_reads_every_fixture_error_text() {
    let mut checked = 0;
    for (name, capture) in torch_h200::captures() {
        let (Some(oom), Some(error)) = (capture["oom"].as_object(), capture["error"].as_object())
        else {
            continue;
        };
        let text = error["message"].as_str().unwrap();
        let alloc = oom["observer"]["alloc"].as_u64().unwrap();
        assert_eq!(torch::tried_to_allocate(text), Some(alloc), "{name}");
        // Without the observer the text gives the same size.
        let from_text = torch::oom_event(None, "OutOfMemoryError", text, None, None, None);
        assert_eq!(from_text.requested_bytes, alloc, "{name}");
        assert_eq!(
            from_text.driver_error, 0,
            "{name}: the caching allocator's text is not a driver error"
        );
        checked += 1;
    }
    assert_eq!(checked, 7);
    assert_eq!(
        torch::tried_to_allocate("Tried to allocate 1.50 GiB."),
        Some(1610612736)
    );
    assert_eq!(
        torch::tried_to_allocate("Tried to allocate 20.00 KiB"),
        Some(20480)
    );
    assert_eq!(
        torch::tried_to_allocate("Tried to allocate 512 bytes"),
        Some(512)
    );
    assert_eq!(torch::tried_to_allocate("Tried to allocate "), None);
    assert_eq!(
        torch::tried_to_allocate("Tried to allocate lots of MiB"),
        None
    );
    assert_eq!(
        torch::tried_to_allocate("Tried to allocate 5 parsecs"),
        None
    );
    assert_eq!(torch::tried_to_allocate("Tried to allocate -5 MiB"), None);
    assert_eq!(torch::tried_to_allocate("out of memory"), None);
}

#[test]
fn cuda_malloc_async_words_its_request_differently() {
    // c10/cuda/CUDAMallocAsyncAllocator.cpp, mallocAsync: "Allocation on
    // device ", device, " would exceed allowed memory. (out of memory)",
    // "\nCurrently allocated     : ", ..., "\nRequested               : ",
    // format_size(size), "\nDevice limit            : ", ..., "\nFree
    // (according to CUDA): ", ..., "\nPyTorch limit (set by user-supplied
    // memory fraction)\n                        : ", ...
    let text = "Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 9.43 GiB\nRequested               : 640.00 MiB\nDevice limit            : 11.59 GiB\nFree (according to CUDA): 7.12 MiB\nPyTorch limit (set by user-supplied memory fraction)\n                        : 17179869184.00 GiB";
    assert_eq!(torch::tried_to_allocate(text), Some(640 << 20));
    // The observer cannot attach under that backend: the text is the source.
    let oom = torch::oom_event(None, "OutOfMemoryError", text, None, None, None);
    assert_eq!(oom.requested_bytes, 640 << 20);
    assert_eq!(oom.driver_error, 0);
    // "Requested" outside that message is not a request size.
    assert_eq!(
        torch::tried_to_allocate("Requested               : 640.00 MiB"),
        None
    );
    assert_eq!(
        torch::tried_to_allocate(
            "Allocation on device 0 would exceed allowed memory. (out of memory)"
        ),
        None
    );
}

#[test]
fn oom_event_prefers_the_observer_and_keeps_the_text() {
    let observer = torch::oom_observer(&json!({"device": 0, "alloc": 100663296, "device_allocated": 2147483648u64, "device_free": 147460325376u64})).unwrap();
    let stats = pb::AllocatorStats {
        device: 0,
        allocated_bytes: 838860800,
        ..Default::default()
    };
    let text = "CUDA out of memory. Tried to allocate 50.00 MiB.";
    let oom = torch::oom_event(
        Some(observer),
        "OutOfMemoryError",
        text,
        Some(stats.clone()),
        None,
        None,
    );
    assert_eq!(
        oom.requested_bytes, 100663296,
        "the observer's alloc wins over the text"
    );
    assert_eq!(oom.observer.unwrap().device_allocated, 2147483648);
    assert_eq!(oom.error_type, "OutOfMemoryError");
    assert_eq!(oom.error_text, text);
    assert_eq!(oom.stats, Some(stats));

    let driver = torch::oom_event(
        None,
        "RuntimeError",
        "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY",
        None,
        None,
        None,
    );
    assert_eq!((driver.driver_error, driver.requested_bytes), (2, 0));
    let runtime = torch::oom_event(
        None,
        "RuntimeError",
        "CUDA error: out of memory",
        None,
        None,
        None,
    );
    assert_eq!(runtime.driver_error, 2);
    assert!(torch::oom_observer(&json!("nope")).is_none());
}

#[test]
fn allocator_settings_from_snapshots_and_conf_strings() {
    for (name, capture) in torch_h200::captures() {
        let Some(raw) = capture
            .get("final_snapshot")
            .and_then(|s| s.get("allocator_settings"))
        else {
            continue;
        };
        let s = torch::allocator_settings(raw);
        let conf = capture["notes"]["alloc_conf"].as_str().unwrap_or("");
        assert_eq!(s.alloc_conf, conf, "{name}");
        assert_eq!(
            s.expandable_segments,
            raw["expandable_segments"].as_bool().unwrap(),
            "{name}"
        );
        assert_eq!(
            s.expandable_segments,
            conf.contains("expandable_segments:True"),
            "{name}"
        );
        assert_eq!(s.max_split_size_bytes, -1, "{name}: PyTorch's 'no limit'");
        assert_eq!(s.garbage_collection_threshold, 0.0);
        assert_eq!(s.other["pinned_num_register_threads"], "1");
        assert!(
            s.other["roundup_power2_divisions"].starts_with('{'),
            "{name}"
        );
        // Every key lands: four fields (three settings and the conf) plus `other`.
        assert_eq!(s.other.len() + 4, raw.as_object().unwrap().len(), "{name}");
    }
    let s = torch::alloc_conf_settings("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6,roundup_power2_divisions:4,bad");
    assert!(s.expandable_segments);
    assert_eq!(s.max_split_size_bytes, 128 << 20);
    assert_eq!(s.garbage_collection_threshold, 0.6);
    assert_eq!(s.other["roundup_power2_divisions"], "4");
    assert_eq!(s.other["bad"], "");
    // A dict that only carries the conf string still yields its settings.
    let s = torch::allocator_settings(
        &json!({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync,max_split_size_mb:x"}),
    );
    assert_eq!(s.backend, "cudaMallocAsync");
    assert_eq!(s.other["max_split_size_mb"], "x");
    assert_eq!(
        torch::allocator_settings(&json!([1, 2])),
        pb::AllocatorSettings::default()
    );
}
