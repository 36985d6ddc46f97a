//! Every real H200 capture read back as an agent's stream, each message checked
//! against numbers taken straight from the file.

use oomscope_agent_core::pb;
use oomscope_agent_core::pb::event::Kind;
use oomscope_replay::capture::{self, Capture, CaptureItem};
use serde_json::Value;

use oomscope_testkit::torch_h200;

const BASE_NS: i64 = 1_790_000_000_000_000_000;
const MIB: u64 = 1 << 20;

fn load(name: &str) -> (Capture, Value) {
    let path = torch_h200::scenario(name);
    (
        capture::load(&path, BASE_NS).unwrap(),
        torch_h200::read(&path),
    )
}

fn ooms(c: &Capture) -> Vec<(f64, &pb::Oom)> {
    c.items
        .iter()
        .filter_map(|(t, i)| match i {
            CaptureItem::Event(pb::Event {
                kind: Some(Kind::Oom(o)),
                ..
            }) => Some((*t, o)),
            _ => None,
        })
        .collect()
}

fn phases(c: &Capture) -> Vec<(f64, &pb::Phase)> {
    c.items
        .iter()
        .filter_map(|(t, i)| match i {
            CaptureItem::Event(pb::Event {
                kind: Some(Kind::Phase(p)),
                ..
            }) => Some((*t, p)),
            _ => None,
        })
        .collect()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a u64: {v}"))
}

#[test]
fn every_capture_replays_sample_for_sample() {
    for path in torch_h200::paths() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let raw = torch_h200::read(&path);
        let cap = capture::load(&path, BASE_NS).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(cap.scenario, raw["scenario"].as_str().unwrap(), "{name}");
        assert_eq!(cap.hello.name, cap.scenario);
        assert_eq!(
            (cap.hello.runtime.as_str(), cap.hello.role.as_str()),
            ("replay", "replay")
        );
        assert_eq!(cap.hello.start_time_ns, BASE_NS);
        assert!(
            cap.items.windows(2).all(|w| w[0].0 <= w[1].0),
            "{name}: items in time order"
        );
        for (t, item) in &cap.items {
            let time_ns = match item {
                CaptureItem::Sample(s) => s.time_ns,
                CaptureItem::Event(e) => e.time_ns,
            };
            assert_eq!(time_ns, BASE_NS + (t * 1e9).round() as i64, "{name}");
        }

        let Some(timeline) = raw["timeline"].as_array() else {
            assert!(!cap.is_timeline(), "{name}");
            assert!(cap.items.is_empty(), "{name}: raw facts give no samples");
            for (k, v) in raw
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| *k != "scenario")
            {
                let text = v
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| v.to_string());
                assert_eq!(cap.hello.labels.get(k), Some(&text), "{name}: fact {k}");
            }
            continue;
        };
        assert!(cap.is_timeline(), "{name}");
        let (finals, samples): (Vec<&pb::Sample>, Vec<&pb::Sample>) = cap
            .samples()
            .partition(|s| s.context.as_ref().is_some_and(|c| c.phase == "final"));
        assert_eq!(
            samples.len(),
            timeline.len(),
            "{name}: one sample per timeline entry"
        );
        // The `final` reading is one last sample, after every timeline entry.
        let fin = &raw["final"]["memory_stats"];
        assert_eq!(
            finals.len(),
            usize::from(fin.is_object()),
            "{name}: the final reading"
        );
        if let Some(f) = finals.first() {
            assert_eq!(
                f.allocator[0].allocated_bytes,
                u(&fin["allocated_bytes.all.current"]),
                "{name}: final"
            );
            assert_eq!(
                f.allocator[0].reserved_bytes,
                u(&fin["reserved_bytes.all.current"]),
                "{name}: final"
            );
            assert!(
                std::ptr::eq(*f, cap.samples().last().unwrap()),
                "{name}: final comes last"
            );
        }
        for (i, (s, e)) in samples.iter().zip(timeline).enumerate() {
            let ms = &e["memory_stats"];
            let a = &s.allocator[0];
            assert_eq!(s.t_s, e["t_s"].as_f64().unwrap(), "{name}[{i}]");
            assert_eq!(s.step, u(&e["step"]), "{name}[{i}]");
            assert_eq!(
                a.allocated_bytes,
                u(&ms["allocated_bytes.all.current"]),
                "{name}[{i}]"
            );
            assert_eq!(
                a.reserved_bytes,
                u(&ms["reserved_bytes.all.current"]),
                "{name}[{i}]"
            );
            assert_eq!(
                a.inactive_split_bytes,
                u(&ms["inactive_split_bytes.all.current"]),
                "{name}[{i}]"
            );
            assert_eq!(
                a.requested_bytes,
                u(&ms["requested_bytes.all.current"]),
                "{name}[{i}]"
            );
            assert_eq!(
                a.num_alloc_retries,
                u(&ms["num_alloc_retries"]),
                "{name}[{i}]"
            );
            assert_eq!(a.raw.len(), ms.as_object().unwrap().len(), "{name}[{i}]");
            assert_eq!(
                a.driver_free_bytes,
                u(&e["mem_get_info"]["free"]),
                "{name}[{i}]"
            );
            let ctx = s.context.as_ref().unwrap();
            for (k, v) in e["context"].as_object().unwrap() {
                torch_h200::assert_context_key(ctx, k, v, &format!("{name}[{i}]"));
            }
            match e.get("host") {
                Some(h) => {
                    let p = s.process.as_ref().unwrap();
                    assert_eq!(
                        (p.vm_rss_bytes, p.vm_hwm_bytes, p.vm_size_bytes),
                        (u(&h["vmrss"]), u(&h["vmhwm"]), u(&h["vmsize"]))
                    );
                }
                None => assert!(s.process.is_none(), "{name}[{i}]"),
            }
        }

        let notes = &raw["notes"];
        assert_eq!(
            cap.hello.versions["torch"],
            notes["torch"].as_str().unwrap()
        );
        assert_eq!(cap.hello.versions["cuda"], notes["cuda"].as_str().unwrap());
        let gpu = &cap.hello.gpus[0];
        assert_eq!(
            (gpu.name.as_str(), gpu.total_bytes),
            (
                notes["device_name"].as_str().unwrap(),
                u(&notes["total_memory"])
            )
        );
        assert_eq!(
            gpu.cap_bytes,
            notes["cap_bytes"].as_u64().unwrap_or(0),
            "{name}"
        );

        let found = ooms(&cap);
        if raw["oom"].is_null() {
            assert!(found.is_empty(), "{name}: no OOM in the file");
        } else {
            assert_eq!(found.len(), 1, "{name}");
            let (t, oom) = found[0];
            assert_eq!(t, raw["oom"]["t_s"].as_f64().unwrap());
            assert_eq!(
                oom.requested_bytes,
                u(&raw["oom"]["observer"]["alloc"]),
                "{name}"
            );
            assert_eq!(
                oom.error_text,
                raw["error"]["message"].as_str().unwrap(),
                "{name}: verbatim"
            );
            assert_eq!(oom.error_type, raw["error"]["type"].as_str().unwrap());
            assert_eq!(
                oom.observer.unwrap().device_allocated,
                raw["oom"]["observer"]["device_allocated"].as_i64().unwrap()
            );
            assert_eq!(
                oom.stats.as_ref(),
                samples.last().unwrap().allocator.first(),
                "{name}: stats of the last sample"
            );
            let segs = raw["oom"]["snapshot_at_oom"]["segments"]
                .as_array()
                .unwrap();
            let snap = oom.snapshot.as_ref().unwrap();
            assert_eq!(
                snap.reserved_bytes,
                segs.iter().map(|s| u(&s["total_size"])).sum::<u64>(),
                "{name}"
            );
        }

        let (last_t, last) = cap.items.last().unwrap();
        let CaptureItem::Event(pb::Event {
            kind: Some(Kind::Snapshot(fin)),
            ..
        }) = last
        else {
            panic!("{name}: the final snapshot summary comes last");
        };
        assert!(cap.items.iter().all(|(t, _)| t <= last_t));
        let segs = raw["final_snapshot"]["segments"].as_array().unwrap();
        assert_eq!(fin.segments, segs.len() as u64, "{name}");
        assert_eq!(
            fin.allocated_bytes,
            segs.iter().map(|s| u(&s["allocated_size"])).sum::<u64>(),
            "{name}"
        );

        // The stream: Hello at 0, then every item in order.
        let msgs = cap.messages();
        assert_eq!(msgs.len(), cap.items.len() + 1);
        assert!(msgs.iter().enumerate().all(|(i, m)| m.seq == i as u64));
        assert!(matches!(
            msgs[0].body,
            Some(pb::agent_message::Body::Hello(_))
        ));
    }
}

#[test]
fn fragmentation_oom_carries_the_verdicts_numbers() {
    let (cap, raw) = load("fragmentation_oom");
    let (_, oom) = ooms(&cap)[0];
    assert_eq!(oom.requested_bytes, 100663296);
    assert_eq!(oom.error_text, raw["error"]["message"].as_str().unwrap());
    assert!(oom
        .error_text
        .contains("1.17 GiB is reserved by PyTorch but unallocated"));
    assert_eq!(oom.driver_error, 0);
    assert_eq!(oom.context.as_ref().unwrap().phase, "big_alloc_oom");

    // reserved - allocated and the largest free block, from the file's segments.
    let segs = raw["oom"]["snapshot_at_oom"]["segments"]
        .as_array()
        .unwrap();
    let reserved: u64 = segs.iter().map(|s| u(&s["total_size"])).sum();
    let allocated: u64 = segs.iter().map(|s| u(&s["allocated_size"])).sum();
    let largest_free = segs
        .iter()
        .flat_map(|s| s["blocks"].as_array().unwrap())
        .filter(|b| b["state"] == "inactive")
        .map(|b| u(&b["size"]))
        .max()
        .unwrap();
    let snap = oom.snapshot.as_ref().unwrap();
    assert_eq!(
        snap.reserved_bytes - snap.allocated_bytes,
        reserved - allocated
    );
    assert_eq!(reserved - allocated, 1200 * MIB);
    assert_eq!(snap.largest_free_block_bytes, largest_free);
    assert!(
        largest_free < oom.requested_bytes,
        "no free block fits the request: fragmentation"
    );
    let stats = oom.stats.as_ref().unwrap();
    assert_eq!(stats.inactive_split_bytes, 1200 * MIB);
    assert_eq!(
        stats.reserved_bytes - stats.allocated_bytes,
        reserved - allocated
    );
    assert_eq!(cap.hello.gpus[0].cap_bytes, 2 << 30);
    assert_eq!(cap.hello.labels["big_alloc"], "oom");
    assert!(
        !cap.hello
            .allocator_settings
            .as_ref()
            .unwrap()
            .expandable_segments
    );
}

#[test]
fn fragmentation_expandable_says_expandable() {
    let (cap, _) = load("fragmentation_expandable");
    let settings = cap.hello.allocator_settings.as_ref().unwrap();
    assert!(settings.expandable_segments);
    assert_eq!(settings.alloc_conf, "expandable_segments:True");
    let (_, oom) = ooms(&cap)[0];
    let snap = oom.snapshot.as_ref().unwrap();
    assert!(snap.expandable_segments);
    assert_eq!(snap.reserved_bytes - snap.allocated_bytes, 1000 * MIB);
}

#[test]
fn loads_that_fail_open_a_phase_and_close_it_with_the_error() {
    for name in ["weights_too_large", "other_process_shared"] {
        let (cap, raw) = load(name);
        let timeline = raw["timeline"].as_array().unwrap();
        let p = phases(&cap);
        assert_eq!(p.len(), 2, "{name}: {p:?}");
        let (t0, start) = p[0];
        assert!(start.start && start.name == "load" && start.error.is_empty());
        assert_eq!(
            t0,
            timeline[0]["t_s"].as_f64().unwrap(),
            "{name}: the load starts at load_start"
        );
        let (t1, end) = p[1];
        assert!(!end.start);
        assert_eq!(
            t1,
            raw["oom"]["t_s"].as_f64().unwrap(),
            "{name}: the load ends at the OOM"
        );
        assert_eq!(end.error, raw["error"]["message"].as_str().unwrap());
        let last_alloc =
            u(&timeline.last().unwrap()["memory_stats"]["allocated_bytes.all.current"]);
        assert_eq!(end.allocated_bytes, last_alloc, "{name}");
    }
    let (cap, _) = load("weights_too_large");
    assert_eq!(
        phases(&cap)[0].1.model.as_ref().unwrap().bytes,
        3 << 30,
        "model_bytes of the context"
    );
}

#[test]
fn hf_loads_finish_at_weights_loaded() {
    for name in ["hf_concurrency", "hf_leak_scores", "hf_varied_no_leak"] {
        let (cap, raw) = load(name);
        let timeline = raw["timeline"].as_array().unwrap();
        let p = phases(&cap);
        assert_eq!(p.len(), 2, "{name}");
        assert!(p[0].1.start && !p[1].1.start);
        let loaded = timeline
            .iter()
            .find(|e| e["context"]["phase"] == "weights_loaded")
            .unwrap();
        assert_eq!(p[1].0, loaded["t_s"].as_f64().unwrap(), "{name}");
        assert_eq!(
            p[1].1.allocated_bytes,
            u(&loaded["memory_stats"]["allocated_bytes.all.current"])
        );
        assert_eq!(p[1].1.host_rss_bytes, u(&loaded["host"]["vmrss"]), "{name}");
        assert!(p[1].1.error.is_empty());
        let model = p[0].1.model.as_ref().unwrap();
        assert_eq!(
            (model.name.as_str(), model.dtype.as_str()),
            ("llama-random", "bfloat16")
        );
        assert_eq!(cap.hello.models[0].dtype, "bfloat16");
        assert!(
            cap.hello.labels["model"].contains("\"kv_bytes_per_token\""),
            "{name}"
        );
    }
    // No load phase at all: no Phase events.
    assert!(phases(&load("kv_concurrency_oom").0).is_empty());
}

#[test]
fn other_process_shared_lists_the_gpu_processes() {
    let (cap, _) = load("other_process_shared");
    assert_eq!(cap.hello.pid, 422);
    let lists: Vec<&pb::ProcessList> = cap
        .events()
        .filter_map(|e| match &e.kind {
            Some(Kind::ProcessList(p)) => Some(p),
            _ => None,
        })
        .collect();
    assert_eq!(lists.len(), 1);
    let gpu: Vec<(u32, Option<u64>)> = lists[0].gpu.iter().map(|p| (p.pid, p.used_bytes)).collect();
    assert_eq!(
        gpu,
        vec![(422, Some(4838129664)), (444, Some(144732848128))]
    );
    assert!(
        !cap.hello.labels.contains_key("nvml_procs_at_failure"),
        "parsed, so not a label"
    );
    assert!(cap.hello.labels["nvml_memory_at_failure"].contains("150230990848"));
}

#[test]
fn driver_and_nvml_and_perf_anchor_are_facts_not_timelines() {
    let (cap, _) = load("driver_and_nvml");
    assert!(!cap.is_timeline());
    assert_eq!(cap.hello.labels["cuMemAlloc_v2_1TiB_result"], "2");
    assert_eq!(cap.hello.labels["error_name"], "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(
        cap.hello.labels["/proc/self/cgroup"],
        "0::/app.slice/inference-server\n"
    );
    assert_eq!(cap.hello.pid, 652);
    let (cap, _) = load("perf_anchor");
    assert!(!cap.is_timeline() && cap.items.is_empty());
    assert_eq!(cap.hello.labels["gc_objects"], "167626");
}

#[test]
fn gzipped_and_plain_captures_read_alike() {
    let dir = tempfile::tempdir().unwrap();
    // A gzipped fixture written out plain, and a plain one gzipped.
    let gz = torch_h200::scenario("hf_concurrency");
    let plain_copy = dir.path().join("hf_concurrency.json");
    std::fs::write(&plain_copy, torch_h200::read(&gz).to_string()).unwrap();
    let plain = torch_h200::scenario("fragmentation_oom");
    let gz_copy = dir.path().join("fragmentation_oom.json.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut enc, &std::fs::read(&plain).unwrap()).unwrap();
    std::fs::write(&gz_copy, enc.finish().unwrap()).unwrap();

    for (a, b) in [(gz, plain_copy), (plain, gz_copy)] {
        let mut ca = capture::load(&a, 7).unwrap();
        let mut cb = capture::load(&b, 7).unwrap();
        ca.hello.labels.remove("capture_file");
        cb.hello.labels.remove("capture_file");
        assert_eq!(ca, cb, "{}", a.display());
    }
}

#[test]
fn rebase_and_rename_retime_and_rename() {
    let (mut cap, _) = load("leak_retained");
    cap.rebase(5);
    cap.set_name("svc-a");
    assert_eq!(cap.hello.name, "svc-a");
    assert_eq!(cap.hello.start_time_ns, 5);
    let s = cap.samples().next().unwrap();
    assert_eq!(s.time_ns, 5 + (s.t_s * 1e9).round() as i64);
}
