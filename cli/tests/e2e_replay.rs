//! `oomscope replay` of every real H200 capture: the collector stores its
//! timeline, phases, OOM event with its error text, and snapshot summary, and
//! the numbers equal the file's.

mod common;

use common::*;
use oomscope_proto::v1 as pb;

#[test]
fn every_capture_replays_with_its_numbers_intact() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    for path in torch_h200::paths() {
        let file = torch_h200::read(&path);
        let scenario = file["scenario"].as_str().unwrap().to_string();
        replay(&col, &path, &scenario);

        let t = timeline(&col.url, &scenario);
        let expected = file["timeline"].as_array().map(|a| a.len()).unwrap_or(0);
        let has_final = file["final"]["memory_stats"].is_object();
        assert_eq!(
            t.samples.len(),
            expected + usize::from(has_final),
            "{scenario}: one sample per timeline entry, and the final reading"
        );
        if has_final {
            let last = t.samples.last().unwrap().sample.as_ref().unwrap();
            assert_eq!(last.context.as_ref().unwrap().phase, "final");
            assert_eq!(
                last.allocator[0].allocated_bytes,
                file["final"]["memory_stats"]["allocated_bytes.all.current"]
                    .as_u64()
                    .unwrap(),
                "{scenario}: final"
            );
        }
        for (i, (s, f)) in t
            .samples
            .iter()
            .zip(file["timeline"].as_array().into_iter().flatten())
            .enumerate()
        {
            let a = &s.sample.as_ref().unwrap().allocator[0];
            let ms = &f["memory_stats"];
            assert_eq!(
                a.allocated_bytes,
                ms["allocated_bytes.all.current"].as_u64().unwrap(),
                "{scenario} sample {i}"
            );
            assert_eq!(
                a.reserved_bytes,
                ms["reserved_bytes.all.current"].as_u64().unwrap(),
                "{scenario} sample {i}"
            );
            assert_eq!(
                a.inactive_split_bytes,
                ms["inactive_split_bytes.all.current"].as_u64().unwrap(),
                "{scenario} sample {i}"
            );
            assert_eq!(
                a.raw.len(),
                ms.as_object().unwrap().len(),
                "{scenario}: every memory_stats key kept"
            );
        }
        let ooms: Vec<&pb::Oom> = t
            .events
            .iter()
            .filter_map(|e| match e.event.as_ref()?.kind.as_ref()? {
                pb::event::Kind::Oom(o) => Some(o),
                _ => None,
            })
            .collect();
        if file["oom"].is_object() {
            assert_eq!(ooms.len(), 1, "{scenario}: the OOM event");
            let o = ooms[0];
            assert_eq!(
                o.requested_bytes,
                file["oom"]["observer"]["alloc"].as_u64().unwrap(),
                "{scenario}"
            );
            assert_eq!(
                o.error_text,
                file["error"]["message"].as_str().unwrap(),
                "{scenario}: error text verbatim"
            );
            let snap = o.snapshot.as_ref().expect("snapshot summary at the OOM");
            let segs = file["oom"]["snapshot_at_oom"]["segments"]
                .as_array()
                .unwrap();
            let reserved: u64 = segs
                .iter()
                .filter(|s| s["device"] == 0)
                .map(|s| s["total_size"].as_u64().unwrap())
                .sum();
            assert_eq!(
                snap.reserved_bytes, reserved,
                "{scenario}: snapshot reserved bytes"
            );
        } else {
            assert!(
                ooms.is_empty(),
                "{scenario}: no OOM in the file, none stored"
            );
        }
        if file["final_snapshot"].is_object() {
            assert!(
                t.events.iter().any(|e| matches!(
                    e.event.as_ref().and_then(|e| e.kind.as_ref()),
                    Some(pb::event::Kind::Snapshot(_))
                )),
                "{scenario}: the final snapshot summary"
            );
        }
    }
}

#[test]
fn malformed_capture_is_a_clear_error_and_the_collector_keeps_serving() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, b"{\"scenario\": \"x\", \"timeline\": [1, 2").unwrap();
    let out = oomscope()
        .arg("replay")
        .arg(&bad)
        .args(["--collector", &col.url])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.json"), "the error names the file: {err}");
    let good = fixture("weights_too_large.json");
    let out = oomscope()
        .arg("replay")
        .arg(&good)
        .args(["--collector", &col.url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
