//! Broken captures are refused with an error that names the file and the
//! problem; odd but valid ones still load. Real files on disk throughout.

use std::path::{Path, PathBuf};

use oomscope_agent_core::pb;
use oomscope_agent_core::pb::event::Kind;
use oomscope_replay::capture::{self, CaptureItem};
use serde_json::json;

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut enc, bytes).unwrap();
    enc.finish().unwrap()
}

/// Loads `bytes` from a file and returns the error text, which must name the file.
fn error_of(name: &str, bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), name, bytes);
    let err = match capture::load(&path, 0) {
        Ok(c) => panic!("{name} loaded: {:?}", c.scenario),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains(name), "the error names the file: {err}");
    err
}

fn entry(t_s: f64) -> serde_json::Value {
    json!({"t_s": t_s, "step": 0, "context": {"phase": "idle"}, "memory_stats": {"num_ooms": 0},
           "mem_get_info": {"free": 1, "total": 2}})
}

#[test]
fn garbage_bytes_are_not_json() {
    let err = error_of("garbage.json", &[0xff, 0x00, 0x13, 0x37, b'{', b'x']);
    assert!(err.contains("not JSON"), "{err}");
    let err = error_of("empty.json", b"");
    assert!(err.contains("not JSON"), "{err}");
}

#[test]
fn truncated_gzip_is_named_as_such() {
    let full = gzip(
        json!({"scenario": "s", "timeline": [entry(0.0), entry(1.0)]})
            .to_string()
            .as_bytes(),
    );
    let err = error_of("cut.json.gz", &full[..full.len() / 2]);
    assert!(err.contains("corrupt or truncated gzip"), "{err}");
    // Valid gzip of garbage: the JSON error, not the gzip one.
    let err = error_of("junk.json.gz", &gzip(b"\x00\x01 not json"));
    assert!(err.contains("not JSON"), "{err}");
}

#[test]
fn json_that_is_not_a_capture() {
    let err = error_of(
        "no_scenario.json",
        json!({"timeline": []}).to_string().as_bytes(),
    );
    assert!(err.contains("no \"scenario\""), "{err}");
    let err = error_of(
        "number_scenario.json",
        json!({"scenario": 5}).to_string().as_bytes(),
    );
    assert!(err.contains("no \"scenario\""), "{err}");
    let err = error_of("list.json", b"[1, 2]");
    assert!(err.contains("top level is an array"), "{err}");
}

#[test]
fn timeline_entries_of_the_wrong_type() {
    let cases = [
        (
            json!({"scenario": "s", "timeline": "soon"}),
            "\"timeline\" is a string, not an array",
        ),
        (
            json!({"scenario": "s", "timeline": [entry(0.0), 42]}),
            "timeline[1] is a number, not an object",
        ),
        (
            json!({"scenario": "s", "timeline": [[1]]}),
            "timeline[0] is an array, not an object",
        ),
        (
            json!({"scenario": "s", "timeline": [{"memory_stats": {}}]}),
            "timeline[0].t_s is missing",
        ),
        (
            json!({"scenario": "s", "timeline": [{"t_s": "late", "memory_stats": {}}]}),
            "timeline[0].t_s is missing or not a number",
        ),
        (
            json!({"scenario": "s", "timeline": [{"t_s": 0.5}]}),
            "timeline[0].memory_stats is missing or not an object",
        ),
        (
            json!({"scenario": "s", "timeline": [{"t_s": 0.5, "memory_stats": [1]}]}),
            "timeline[0].memory_stats",
        ),
        (
            json!({"scenario": "s", "timeline": [{"t_s": 0.5, "memory_stats": {}, "context": "x"}]}),
            "timeline[0].context is a string",
        ),
        (
            json!({"scenario": "s", "timeline": [{"t_s": 0.5, "memory_stats": {}, "host": 3}]}),
            "timeline[0].host is a number",
        ),
        (
            json!({"scenario": "s", "notes": [1]}),
            "\"notes\" is an array",
        ),
        (
            json!({"scenario": "s", "timeline": [], "oom": 7}),
            "\"oom\" is a number",
        ),
        (
            json!({"scenario": "s", "timeline": [], "oom": {"t_s": "x"}}),
            "\"oom.t_s\" is not a number",
        ),
        (
            json!({"scenario": "s", "timeline": [], "error": "boom"}),
            "\"error\" is a string",
        ),
    ];
    for (i, (capture, want)) in cases.iter().enumerate() {
        let err = error_of(&format!("case{i}.json"), capture.to_string().as_bytes());
        assert!(err.contains(want), "case {i}: want {want:?} in {err}");
    }
}

#[test]
fn a_missing_file_is_an_error_not_a_panic() {
    let err = capture::load(Path::new("/nonexistent/oomscope/cap.json"), 0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("/nonexistent/oomscope/cap.json") && err.contains("cannot read"),
        "{err}"
    );
}

#[test]
fn minimal_captures_are_valid() {
    let dir = tempfile::tempdir().unwrap();
    let bare = capture::load(
        &write(dir.path(), "bare.json", br#"{"scenario": "bare"}"#),
        0,
    )
    .unwrap();
    assert!(!bare.is_timeline() && bare.items.is_empty());
    assert_eq!(bare.hello.name, "bare");
    let empty = capture::load(
        &write(
            dir.path(),
            "empty.json",
            br#"{"scenario": "e", "timeline": []}"#,
        ),
        0,
    )
    .unwrap();
    assert!(empty.is_timeline() && empty.items.is_empty());
}

#[test]
fn an_error_without_an_observer_still_gives_the_requested_size() {
    let dir = tempfile::tempdir().unwrap();
    let text =
        "CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 139.80 GiB";
    let cap = json!({"scenario": "s", "timeline": [entry(0.1), entry(0.2)],
                     "error": {"type": "OutOfMemoryError", "message": text}});
    let cap = capture::load(
        &write(dir.path(), "s.json", cap.to_string().as_bytes()),
        1_000,
    )
    .unwrap();
    let ooms: Vec<(f64, &pb::Event)> = cap
        .items
        .iter()
        .filter_map(|(t, i)| match i {
            CaptureItem::Event(
                e @ pb::Event {
                    kind: Some(Kind::Oom(_)),
                    ..
                },
            ) => Some((*t, e)),
            _ => None,
        })
        .collect();
    assert_eq!(ooms.len(), 1);
    let (t, event) = ooms[0];
    assert_eq!(t, 0.2, "at the last sample when the file gives no time");
    assert_eq!(event.time_ns, 1_000 + 200_000_000);
    let Some(Kind::Oom(oom)) = &event.kind else {
        unreachable!()
    };
    assert_eq!(oom.requested_bytes, 100663296);
    assert!(oom.observer.is_none() && oom.snapshot.is_none());
}

#[test]
fn nvml_lists_as_python_repr_text() {
    let dir = tempfile::tempdir().unwrap();
    let reprs = [
        ("[{'pid': 422, 'usedGpuMemory': 4838129664}, {'pid': 444, 'usedGpuMemory': None}]", vec![(422, Some(4838129664)), (444, None)]),
        (
            "[c_nvmlProcessInfo_t(pid: 7, usedGpuMemory: 1024 B, gpuInstanceId: 4294967295), c_nvmlProcessInfo_t(pid: 8, usedGpuMemory: 2048 B)]",
            vec![(7, Some(1024)), (8, Some(2048))],
        ),
        ("[]", vec![]),
    ];
    for (text, want) in reprs {
        let cap = json!({"scenario": "s", "notes": {"nvml_procs_at_failure": text}, "timeline": [entry(0.0)]});
        let cap =
            capture::load(&write(dir.path(), "n.json", cap.to_string().as_bytes()), 0).unwrap();
        let got: Vec<(u32, Option<u64>)> = cap
            .events()
            .find_map(|e| match &e.kind {
                Some(Kind::ProcessList(p)) => {
                    Some(p.gpu.iter().map(|g| (g.pid, g.used_bytes)).collect())
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("no process list from {text}"));
        assert_eq!(got, want, "{text}");
        assert!(!cap.hello.labels.contains_key("nvml_procs_at_failure"));
    }
    // Text it cannot read in full is kept verbatim as a label, not half-parsed.
    for text in [
        "<pynvml object at 0x7f>",
        "[{'pid': 'x'}]",
        "[{'pid': 1}, oops {'pid': 2}]",
        "[{'used': 5}]",
    ] {
        let cap = json!({"scenario": "s", "notes": {"nvml_procs_at_failure": text}, "timeline": [entry(0.0)]});
        let cap =
            capture::load(&write(dir.path(), "n.json", cap.to_string().as_bytes()), 0).unwrap();
        assert!(
            cap.events()
                .all(|e| !matches!(e.kind, Some(Kind::ProcessList(_)))),
            "{text}"
        );
        assert_eq!(cap.hello.labels["nvml_procs_at_failure"], text);
    }
    assert!(capture::gpu_processes(&json!(5), 0).is_none());
    assert_eq!(
        capture::gpu_processes(&json!([{"pid": 3, "usedGpuMemory": 9}]), 2).unwrap()[0].device,
        2
    );
}
