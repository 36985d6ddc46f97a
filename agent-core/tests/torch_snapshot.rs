//! snapshot_summary against real H200 allocator snapshots, with every number
//! recomputed here straight from the JSON, and against broken snapshots.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;

use oomscope_agent_core::torch;
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;

fn fixture(name: &str) -> Value {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/torch-h200");
    let plain = dir.join(format!("{name}.json"));
    let text = if plain.exists() {
        std::fs::read_to_string(plain).unwrap()
    } else {
        let mut s = String::new();
        let gz = std::fs::read(dir.join(format!("{name}.json.gz"))).unwrap();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_string(&mut s)
            .unwrap();
        s
    };
    serde_json::from_str(&text).unwrap()
}

/// The numbers a summary must hold, computed independently from the JSON.
struct Expected {
    segments: u64,
    reserved: u64,
    allocated: u64,
    requested: u64,
    largest_free: u64,
    by_state: BTreeMap<String, (u64, u64)>,
    actions: BTreeMap<String, u64>,
}

fn expected(snapshot: &Value) -> Expected {
    let segs = snapshot["segments"].as_array().unwrap();
    let mut e = Expected {
        segments: segs.len() as u64,
        reserved: segs.iter().map(|s| s["total_size"].as_u64().unwrap()).sum(),
        allocated: segs
            .iter()
            .map(|s| s["allocated_size"].as_u64().unwrap())
            .sum(),
        requested: segs
            .iter()
            .map(|s| s["requested_size"].as_u64().unwrap())
            .sum(),
        largest_free: 0,
        by_state: BTreeMap::new(),
        actions: BTreeMap::new(),
    };
    for seg in segs {
        let general = seg["segment_pool_id"] == json!([0, 0]);
        assert!(general, "the H200 captures hold no private pool");
    }
    for b in segs.iter().flat_map(|s| s["blocks"].as_array().unwrap()) {
        let size = b["size"].as_u64().unwrap();
        let state = b["state"].as_str().unwrap().to_string();
        if state == "inactive" {
            e.largest_free = e.largest_free.max(size);
        }
        let entry = e.by_state.entry(state).or_default();
        entry.0 += 1;
        entry.1 += size;
    }
    for t in snapshot["device_traces"][0].as_array().unwrap() {
        *e.actions
            .entry(t["action"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    e
}

fn check_against_json(name: &str, snapshot: &Value) -> oomscope_agent_core::pb::SnapshotSummary {
    let s = torch::snapshot_summary(snapshot, 0);
    let e = expected(snapshot);
    assert_eq!(s.segments, e.segments, "{name} segments");
    assert_eq!(s.reserved_bytes, e.reserved, "{name} reserved");
    assert_eq!(s.allocated_bytes, e.allocated, "{name} allocated");
    assert_eq!(s.requested_bytes, e.requested, "{name} requested");
    assert_eq!(
        s.largest_free_block_bytes, e.largest_free,
        "{name} largest free block"
    );
    let by_state: BTreeMap<String, (u64, u64)> = s
        .blocks
        .iter()
        .map(|b| (b.state.clone(), (b.count, b.bytes)))
        .collect();
    assert_eq!(by_state, e.by_state, "{name} blocks by state");
    let actions: BTreeMap<String, u64> = s
        .trace_actions
        .iter()
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    assert_eq!(actions, e.actions, "{name} trace actions");
    // Live bytes by site add up to the allocated bytes, caps included.
    assert!(s.live_by_site.len() <= torch::MAX_SITES, "{name}");
    assert_eq!(
        s.live_by_site.iter().map(|x| x.bytes).sum::<u64>(),
        s.allocated_bytes,
        "{name} sites"
    );
    assert_eq!(
        s.live_by_site.iter().map(|x| x.blocks).sum::<u64>(),
        e.by_state.get("active_allocated").map_or(0, |b| b.0)
    );
    assert!(s
        .live_by_site
        .windows(2)
        .all(|w| w[0].bytes >= w[1].bytes || w[1].site == torch::OTHER_SITES));
    // Largest free first, capped, and the head is the overall largest.
    assert!(s.segments_free.len() <= torch::MAX_SEGMENTS_FREE, "{name}");
    assert!(s
        .segments_free
        .windows(2)
        .all(|w| w[0].largest_free_block_bytes >= w[1].largest_free_block_bytes));
    if e.largest_free > 0 {
        assert_eq!(
            s.segments_free[0].largest_free_block_bytes, e.largest_free,
            "{name}"
        );
    }
    s
}

#[test]
fn fragmentation_oom_snapshot_shows_the_fragments() {
    let capture = fixture("fragmentation_oom");
    let snap = &capture["oom"]["snapshot_at_oom"];
    let s = check_against_json("fragmentation_oom", snap);
    // The verdict's numbers: 1200 MiB reserved but unallocated, no free block
    // large enough for the 96 MiB request.
    let request = capture["oom"]["observer"]["alloc"].as_u64().unwrap();
    assert_eq!(request, 96 * MIB);
    assert_eq!(s.reserved_bytes - s.allocated_bytes, 1200 * MIB);
    assert_eq!(s.allocated_bytes, 800 * MIB);
    assert!(
        s.largest_free_block_bytes < request,
        "largest free {} must not fit the request",
        s.largest_free_block_bytes
    );
    assert!(s.reserved_bytes - s.allocated_bytes > request);
    // Cross-check with the allocator's own counters at the failure.
    let last = capture["timeline"].as_array().unwrap().last().unwrap();
    assert_eq!(
        s.reserved_bytes,
        last["memory_stats"]["reserved_bytes.all.current"]
            .as_u64()
            .unwrap()
    );
    assert_eq!(
        s.allocated_bytes,
        last["memory_stats"]["allocated_bytes.all.current"]
            .as_u64()
            .unwrap()
    );
    assert_eq!(s.trace_actions.get("oom"), Some(&1));
    assert!(!s.expandable_segments);
    assert_eq!(s.settings.as_ref().unwrap().max_split_size_bytes, -1);
    assert_eq!(
        s.segments_free.len(),
        torch::MAX_SEGMENTS_FREE,
        "100 fragmented segments, capped"
    );
    assert_eq!(s.segments_free[0].pool, "large");
    // Every live block was made by the scenario's own line.
    assert_eq!(
        s.live_by_site[0].site,
        "capture_torch_fixtures.py:132 _fragment"
    );
    assert_eq!(s.live_by_site[0].bytes, 800 * MIB);
    assert!(s.live_by_tag.is_empty(), "no tags in this capture");
}

#[test]
fn fragmentation_expandable_snapshot_is_expandable() {
    let capture = fixture("fragmentation_expandable");
    let s = check_against_json(
        "fragmentation_expandable",
        &capture["oom"]["snapshot_at_oom"],
    );
    assert!(s.expandable_segments);
    assert_eq!(s.settings.unwrap().alloc_conf, "expandable_segments:True");
    assert_eq!(s.reserved_bytes - s.allocated_bytes, 1000 * MIB);
    assert_eq!(s.segments, 1);
}

#[test]
fn every_fixture_snapshot_matches_its_json() {
    for name in [
        "cache_no_leak",
        "cycle_retention",
        "fragmentation_expandable",
        "fragmentation_oom",
        "hf_concurrency",
        "hf_leak_scores",
        "hf_varied_no_leak",
        "kv_concurrency_oom",
        "leak_retained",
        "long_context_single",
        "other_process_shared",
        "weights_too_large",
    ] {
        let capture = fixture(name);
        check_against_json(name, &capture["final_snapshot"]);
        if !capture["oom"].is_null() {
            check_against_json(name, &capture["oom"]["snapshot_at_oom"]);
        }
    }
}

#[test]
fn hf_sites_name_the_model_code_not_torch() {
    let capture = fixture("hf_concurrency");
    let s = check_against_json("hf_concurrency", &capture["oom"]["snapshot_at_oom"]);
    assert!(
        s.live_by_site
            .iter()
            .any(|x| x.site == "transformers/models/llama/modeling_llama.py:317 forward"),
        "sites: {:?}",
        s.live_by_site.iter().map(|x| &x.site).collect::<Vec<_>>()
    );
    assert!(
        s.live_by_site.iter().all(|x| !x.site.starts_with("torch/")),
        "torch internals are skipped"
    );
}

#[test]
fn tags_come_from_blocks_or_the_trace() {
    let snap = json!({
        "segments": [
            {"device": 0, "address": 4096, "total_size": 300, "allocated_size": 250, "segment_type": "small",
             "blocks": [
                {"address": 4096, "size": 100, "requested_size": 90, "state": "active_allocated", "frames": [], "tag": "kv"},
                {"address": 4196, "size": 150, "requested_size": 150, "state": "active_allocated", "frames": []},
                {"address": 4346, "size": 50, "state": "inactive"}]},
            {"device": 1, "address": 9000, "total_size": 1000, "blocks": []}
        ],
        "device_traces": [[
            {"action": "alloc", "addr": 4196, "size": 150, "user_metadata": "weights"},
            {"action": "free_completed", "addr": 1},
            "not an entry"
        ]]
    });
    let s = torch::snapshot_summary(&snap, 0);
    assert_eq!(
        (
            s.segments,
            s.reserved_bytes,
            s.allocated_bytes,
            s.requested_bytes
        ),
        (1, 300, 250, 240)
    );
    let tags: BTreeMap<_, _> = s
        .live_by_tag
        .iter()
        .map(|t| (t.site.as_str(), t.bytes))
        .collect();
    assert_eq!(tags, BTreeMap::from([("kv", 100), ("weights", 150)]));
    assert_eq!(s.live_by_site[0].site, torch::NO_STACK);
    assert_eq!(s.trace_actions.len(), 2);
    assert_eq!(s.segments_free[0].largest_free_block_bytes, 50);
    // Device 1 sees only its own segment.
    let d1 = torch::snapshot_summary(&snap, 1);
    assert_eq!(
        (d1.segments, d1.reserved_bytes, d1.largest_free_block_bytes),
        (1, 1000, 0)
    );
    assert!(d1.trace_actions.is_empty());
}

/// A snapshot shaped like `torch.cuda.memory._snapshot()` after a CUDA
/// graph was captured: the graph's pool (`segment_pool_id` (0, 1), as
/// `torch.cuda.graph_pool_handle()` numbers it) holds a 64 MiB segment with
/// 40 MiB free for its replays; the general pool (0, 0) holds one 20 MiB
/// segment with a 4 MiB free block.
fn graph_pool_snapshot() -> Value {
    let block = |address: u64, size: u64, state: &str| json!({"address": address, "size": size, "requested_size": size, "state": state, "frames": []});
    json!({
        "segments": [
            {"device": 0, "address": 1 << 30, "total_size": 20 * MIB, "allocated_size": 16 * MIB,
             "active_size": 16 * MIB, "requested_size": 16 * MIB, "stream": 0, "segment_type": "large",
             "segment_pool_id": [0, 0], "is_expandable": false, "frames": [],
             "blocks": [block(1 << 30, 16 * MIB, "active_allocated"),
                        block((1 << 30) + 16 * MIB, 4 * MIB, "inactive")]},
            {"device": 0, "address": 2 << 30, "total_size": 64 * MIB, "allocated_size": 24 * MIB,
             "active_size": 24 * MIB, "requested_size": 24 * MIB, "stream": 0, "segment_type": "large",
             "segment_pool_id": [0, 1], "is_expandable": false, "frames": [],
             "blocks": [block(2 << 30, 24 * MIB, "active_allocated"),
                        block((2 << 30) + 24 * MIB, 40 * MIB, "inactive")]}
        ],
        "device_traces": [[]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": null, "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": false}
    })
}

#[test]
fn a_graph_pools_segment_is_counted_apart() {
    let s = torch::snapshot_summary(&graph_pool_snapshot(), 0);
    // Both pools are reserved by the allocator...
    assert_eq!(
        (s.segments, s.reserved_bytes, s.allocated_bytes),
        (2, 84 * MIB, 40 * MIB)
    );
    // ...but the graph's pool is held for its replays.
    assert_eq!(s.private_pool_reserved_bytes, 64 * MIB);
    assert_eq!(s.private_pool_free_bytes, 40 * MIB);
    // The largest free block a general request could take is 4 MiB, not
    // the graph pool's 40 MiB.
    assert_eq!(s.largest_free_block_bytes, 4 * MIB);
    let flags: Vec<(u64, bool)> = s
        .segments_free
        .iter()
        .map(|f| (f.largest_free_block_bytes, f.private_pool))
        .collect();
    assert_eq!(flags, vec![(40 * MIB, true), (4 * MIB, false)]);
}

#[test]
fn a_pool_id_that_is_missing_or_odd_is_the_general_pool() {
    let mut snap = graph_pool_snapshot();
    for id in [Value::Null, json!("graph"), json!([]), json!([0, 0])] {
        snap["segments"][1]["segment_pool_id"] = id.clone();
        let s = torch::snapshot_summary(&snap, 0);
        assert_eq!(
            (s.private_pool_reserved_bytes, s.private_pool_free_bytes),
            (0, 0),
            "{id}"
        );
        assert_eq!(s.largest_free_block_bytes, 40 * MIB, "{id}");
    }
    // A MemPool's id is numbered in the first place: (1, 0).
    snap["segments"][1]["segment_pool_id"] = json!([1, 0]);
    let s = torch::snapshot_summary(&snap, 0);
    assert_eq!(s.private_pool_reserved_bytes, 64 * MIB);
    snap["segments"].as_array_mut().unwrap().remove(1);
    snap["segments"][0]["segment_pool_id"] = json!([3, 0]);
    assert_eq!(
        torch::snapshot_summary(&snap, 0).private_pool_free_bytes,
        4 * MIB
    );
}

#[test]
fn broken_snapshots_give_empty_summaries() {
    for v in [
        Value::Null,
        json!({}),
        json!("snapshot"),
        json!({"segments": 5, "device_traces": {"x": 1}, "allocator_settings": []}),
        json!({"segments": [1, "x", null, {"blocks": "no"}, {"total_size": -5, "blocks": [7, {"size": "big"}]}]}),
    ] {
        let s = torch::snapshot_summary(&v, 0);
        assert_eq!(s.reserved_bytes, 0, "{v}");
        assert_eq!(s.allocated_bytes, 0, "{v}");
        assert!(s.live_by_site.is_empty(), "{v}");
    }
    // The older list form (torch.cuda.memory_snapshot()) is a list of segments.
    let list = json!([{"device": 0, "total_size": 64, "allocated_size": 32}]);
    let s = torch::snapshot_summary(&list, 0);
    assert_eq!(
        (s.segments, s.reserved_bytes, s.allocated_bytes),
        (1, 64, 32)
    );
    assert_eq!(torch::snapshot_summary(&list, -1).segments, 0);
}
