//! `oomscope compare` on replayed H200 captures and on real supervised
//! processes: what changed between two runs, and what became of the failure.
//! The numbers it shows are checked against the stored timelines.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use oomscope_proto::v1 as pb;
use serde_json::Value;

/// A variant of a capture: `edit` changes its JSON, and it is written to `dir`.
fn variant(dir: &Path, from: &str, to: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut v: Value = serde_json::from_slice(&std::fs::read(fixture(from)).unwrap()).unwrap();
    edit(&mut v);
    let path = dir.join(to);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    path
}

/// The OOM event of a timeline (there is exactly one in these captures).
fn oom(t: &pb::TimelineResponse) -> pb::Oom {
    let ooms: Vec<pb::Oom> = t
        .events
        .iter()
        .filter_map(|e| match e.event.as_ref()?.kind.as_ref()? {
            pb::event::Kind::Oom(o) => Some(o.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(ooms.len(), 1);
    ooms.into_iter().next().unwrap()
}

fn settings_changed(c: &Value) -> Vec<String> {
    c["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ch| ch["setting"].as_str().unwrap().to_string())
        .collect()
}

/// One moment of a side's memory table (`before_load`, `after_load`,
/// `at_failure`); a row without a reading is absent from its `bytes`.
fn moment<'a>(c: &'a serde_json::Value, side: &str, moment: &str) -> &'a serde_json::Value {
    c[side]["memory"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["moment"] == moment)
        .unwrap_or_else(|| panic!("no {moment} in {side}: {c:#}"))
}

#[test]
fn expandable_segments_retest_changes_one_variable_and_the_failure_remains() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    replay(&col, &fixture("fragmentation_oom.json"), "frag");
    replay(
        &col,
        &fixture("fragmentation_expandable.json"),
        "frag-expandable",
    );

    let c = col.json(&["compare", "frag", "frag-expandable"]);
    assert_eq!(settings_changed(&c), ["expandable_segments"], "{c:#}");
    assert_eq!(c["changed"][0]["a"], "false");
    assert_eq!(c["changed"][0]["b"], "true");
    assert_eq!(c["one_variable"], true);
    assert_eq!(c["warnings"].as_array().unwrap().len(), 0, "{c:#}");
    assert_eq!(c["outcome"], "same", "{}", c["outcome_reason"]);

    // The numbers behind it are the stored ones.
    let (ta, tb) = (
        timeline(&col.url, "frag"),
        timeline(&col.url, "frag-expandable"),
    );
    let (oa, ob) = (oom(&ta), oom(&tb));
    assert_eq!(oa.requested_bytes, 96 << 20);
    assert_eq!(c["a"]["failure"]["requested_bytes"], oa.requested_bytes);
    assert_eq!(c["b"]["failure"]["requested_bytes"], ob.requested_bytes);
    assert!(c["a"]["failure"].is_object(), "{c:#}");
    assert!(c["b"]["failure"].is_object(), "{c:#}");
    assert_eq!(c["a"]["domain"], "gpu_vram");
    assert_eq!(c["a"]["failure"]["phase"], "big_alloc_oom");
    for (side, o) in [("a", &oa), ("b", &ob)] {
        let s = o.stats.as_ref().unwrap();
        let at = &moment(&c, side, "at_failure")["bytes"];
        assert_eq!(at["allocated"], s.allocated_bytes, "{side}");
        assert_eq!(at["reserved"], s.reserved_bytes, "{side}");
        assert_eq!(at["cached"], s.reserved_bytes - s.allocated_bytes, "{side}");
        assert_eq!(
            at["non_pytorch"],
            s.driver_total_bytes - s.driver_free_bytes - s.reserved_bytes,
            "{side}"
        );
    }
    // 800 MiB live and 1200 MiB of fragments, as the error text says; under
    // expandable segments inactive_split is not counted, so no fragments row.
    assert_eq!(
        moment(&c, "a", "at_failure")["bytes"]["allocated"],
        800u64 << 20
    );
    assert_eq!(
        moment(&c, "a", "at_failure")["bytes"]["fragments"],
        1200u64 << 20
    );
    assert!(moment(&c, "b", "at_failure")["bytes"]["fragments"].is_null());
    assert_eq!(moment(&c, "a", "before_load")["bytes"]["allocated"], 0);
    assert!(
        moment(&c, "a", "after_load")["bytes"]["allocated"].is_null(),
        "no load phase in this capture"
    );

    // Incident ids name the same runs.
    let incs = col.json(&["incidents"]);
    let id = |agent: &str| {
        incs.as_array()
            .unwrap()
            .iter()
            .find(|i| i["agent_name"] == agent)
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let by_id = col.json(&["compare", &id("frag"), &id("frag-expandable")]);
    assert_eq!(by_id["outcome"], "same");
    assert_eq!(by_id["a"]["incident"], id("frag").as_str());
    assert_eq!(settings_changed(&by_id), ["expandable_segments"]);

    // The text form says the same.
    let text = col.text(&["compare", "frag", "frag-expandable"]);
    assert!(
        text.contains("expandable_segments: false -> true"),
        "{text}"
    );
    assert!(text.contains("Outcome: same"), "{text}");
    assert!(text.contains("one variable"), "{text}");
}

#[test]
fn a_larger_cap_makes_the_failure_vanish() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let ok = variant(tmp.path(), "fragmentation_oom.json", "frag_4g.json", |v| {
        v["notes"]["cap_bytes"] = (4u64 << 30).into();
        v["oom"] = Value::Null;
        v["error"] = Value::Null;
    });
    replay(&col, &fixture("fragmentation_oom.json"), "frag");
    replay(&col, &ok, "frag-4g");

    let c = col.json(&["compare", "frag", "frag-4g"]);
    assert_eq!(settings_changed(&c), ["gpu0.cap"], "{c:#}");
    assert!(c["changed"][0]["a"]
        .as_str()
        .unwrap()
        .contains("2147483648"));
    assert!(c["changed"][0]["b"]
        .as_str()
        .unwrap()
        .contains("4294967296"));
    assert_eq!(c["one_variable"], true);
    assert_eq!(c["outcome"], "vanished", "{}", c["outcome_reason"]);
    assert!(c["b"]["failure"].is_null(), "{c:#}");
    assert!(c["b"]["incident"].is_null());
    // Without a failure, B's third column is its latest reading.
    let tb = timeline(&col.url, "frag-4g");
    let last = tb.samples.last().unwrap().sample.as_ref().unwrap();
    assert_eq!(moment(&c, "b", "at_failure")["title"], "latest");
    assert_eq!(
        moment(&c, "b", "at_failure")["bytes"]["allocated"],
        last.allocator[0].allocated_bytes
    );
}

#[test]
fn several_changes_at_once_are_flagged() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let two = variant(
        tmp.path(),
        "fragmentation_expandable.json",
        "frag_exp_3g.json",
        |v| v["notes"]["cap_bytes"] = (3u64 << 30).into(),
    );
    replay(&col, &fixture("fragmentation_oom.json"), "frag");
    replay(&col, &two, "frag-two");
    let c = col.json(&["compare", "frag", "frag-two"]);
    let mut changed = settings_changed(&c);
    changed.sort();
    assert_eq!(changed, ["expandable_segments", "gpu0.cap"], "{c:#}");
    assert_eq!(c["one_variable"], false);
    let warning = c["warnings"][0].as_str().unwrap();
    assert!(warning.contains("2 settings changed"), "{warning}");
    assert!(warning.contains("one variable at a time"), "{warning}");
    // The same 96 MiB request still fails.
    assert_eq!(c["outcome"], "same", "{}", c["outcome_reason"]);

    // A different workload altogether: the failure moved (another phase at
    // least), and several settings differ.
    replay(&col, &fixture("kv_concurrency_oom.json"), "kv");
    let c = col.json(&["compare", "frag", "kv"]);
    assert_eq!(c["outcome"], "moved", "{}", c["outcome_reason"]);
    assert_eq!(c["one_variable"], false);
    assert_eq!(c["b"]["failure"]["phase"], "decode");
    let text = col.text(&["compare", "frag", "kv"]);
    assert!(text.contains("Warning: "), "{text}");
}

#[test]
fn a_real_cgroup_kill_vanishes_under_a_higher_limit() {
    if TestCgroup::own().is_none() {
        eprintln!("skipped: no memory cgroup controller here");
        return;
    }
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let alloc = ["python3", "-c", "b = bytearray(200 << 20); print(len(b))"];
    for (name, limit) in [("cg-small", 64u64 << 20), ("cg-large", 1u64 << 30)] {
        let cg = TestCgroup::create(None, name, Some(limit));
        let out = cg.run(&col, name, &alloc);
        assert_eq!(
            out.status.success(),
            name == "cg-large",
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let c = col.json(&["compare", "cg-small", "cg-large"]);
    assert_eq!(c["outcome"], "vanished", "{c:#}");
    assert_eq!(c["a"]["domain"], "cgroup");
    let changed = settings_changed(&c);
    assert_eq!(changed, ["cgroup_limit"], "{c:#}");
    assert!(c["changed"][0]["a"].as_str().unwrap().contains("67108864"));
    assert!(c["changed"][0]["b"]
        .as_str()
        .unwrap()
        .contains("1073741824"));
}
