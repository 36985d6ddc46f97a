//! Every real H200 capture, replayed through a real collector, diagnosed by
//! `oomscope diagnose --agent NAME --json`: the verdict of
//! tests/fixtures/README.md with the numbers behind it, and the confusion
//! table over all of them (`cargo test -p oomscope --test e2e_verdicts --
//! --nocapture` prints it; BENCHMARKS.md keeps it).

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const KIB: f64 = 1024.0;
const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

/// What tests/fixtures/README.md expects of one capture. `-` for a trigger
/// means no growth pattern: null when nothing failed, "unknown" when
/// something did. A cause `!leak` means anything but a leak (or nothing).
struct Expected {
    file: &'static str,
    domain: &'static str,
    trigger: &'static str,
    cause: &'static str,
    check: fn(&Value),
}

const EXPECTED: &[Expected] = &[
    Expected {
        file: "cache_no_leak.json",
        domain: "-",
        trigger: "-",
        cause: "cache_retention",
        check: cache_no_leak,
    },
    Expected {
        file: "cycle_retention.json",
        domain: "-",
        trigger: "repeated_requests",
        cause: "gc_retained",
        check: cycle_retention,
    },
    Expected {
        file: "driver_and_nvml.json",
        domain: "-",
        trigger: "-",
        cause: "-",
        check: nothing,
    },
    Expected {
        file: "fragmentation_expandable.json",
        domain: "gpu_vram",
        trigger: "-",
        cause: "fragmentation",
        check: fragmentation_expandable,
    },
    Expected {
        file: "fragmentation_oom.json",
        domain: "gpu_vram",
        trigger: "-",
        cause: "fragmentation",
        check: fragmentation_oom,
    },
    Expected {
        file: "hf_concurrency.json.gz",
        domain: "gpu_vram",
        trigger: "concurrency_dependent",
        cause: "kv_growth",
        check: hf_concurrency,
    },
    Expected {
        file: "hf_leak_scores.json.gz",
        domain: "-",
        trigger: "repeated_requests",
        cause: "leak",
        check: hf_leak_scores,
    },
    Expected {
        file: "hf_varied_no_leak.json.gz",
        domain: "-",
        trigger: "-",
        cause: "!leak",
        check: hf_varied_no_leak,
    },
    Expected {
        file: "kv_concurrency_oom.json",
        domain: "gpu_vram",
        trigger: "concurrency_dependent",
        cause: "kv_growth",
        check: kv_concurrency_oom,
    },
    Expected {
        file: "leak_retained.json",
        domain: "-",
        trigger: "repeated_requests",
        cause: "leak",
        check: leak_retained,
    },
    Expected {
        file: "long_context_single.json",
        domain: "gpu_vram",
        trigger: "size_dependent",
        cause: "kv_growth",
        check: long_context_single,
    },
    Expected {
        file: "other_process_shared.json",
        domain: "gpu_vram",
        trigger: "immediate",
        cause: "other_process",
        check: other_process_shared,
    },
    Expected {
        file: "perf_anchor.json",
        domain: "-",
        trigger: "-",
        cause: "-",
        check: nothing,
    },
    Expected {
        file: "weights_too_large.json",
        domain: "gpu_vram",
        trigger: "immediate",
        cause: "weights_too_large",
        check: weights_too_large,
    },
];

fn scenario(file: &str) -> &str {
    file.trim_end_matches(".gz").trim_end_matches(".json")
}

#[test]
fn every_capture_gets_its_verdict_with_the_numbers_behind_it() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for exp in EXPECTED {
        let name = scenario(exp.file);
        replay(&col, &fixture(exp.file), name);
        if exp.domain != "-" {
            let incidents = col.incidents_of(name, 1, Duration::from_secs(10));
            assert!(!incidents.is_empty(), "{name}: the OOM is an incident");
        }
        let d = col.json(&["diagnose", "--agent", name]);
        let got = (
            text(&d["domain"]),
            text(&d["trigger"]),
            text(&d["causes"][0]["kind"]),
        );
        let ok = domain_matches(exp.domain, &got.0)
            && trigger_matches(exp.trigger, &got.1)
            && cause_matches(exp.cause, &got.2);
        rows.push(format!(
            "| {name} | {} / {} / {} | {} / {} / {} | {} |",
            exp.domain,
            exp.trigger,
            exp.cause,
            got.0,
            got.1,
            got.2,
            if ok { "yes" } else { "NO" }
        ));
        if !ok {
            failures.push(format!(
                "{name}: {}",
                serde_json::to_string_pretty(&d).unwrap()
            ));
            continue;
        }
        // Each capture's own numbers; a panic names the capture.
        let check = std::panic::catch_unwind(|| (exp.check)(&d));
        if check.is_err() {
            failures.push(format!(
                "{name}: numbers: {}",
                serde_json::to_string_pretty(&d).unwrap()
            ));
        }
    }
    println!("| capture | expected domain / trigger / first cause | got | match |");
    println!("|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    let matched = rows.iter().filter(|r| r.ends_with("| yes |")).count();
    println!("{matched} of {} captures match", rows.len());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `--since` keeps the agent's latest incident when it falls in the window.
#[test]
fn diagnose_since_includes_the_latest_incident_in_range() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    for file in ["kv_concurrency_oom.json", "leak_retained.json"] {
        replay(&col, &fixture(file), scenario(file));
    }
    col.incidents_of("kv_concurrency_oom", 1, Duration::from_secs(10));
    let d = col.json(&["diagnose", "--agent", "kv_concurrency_oom", "--since", "1h"]);
    assert_eq!(d["domain"], "gpu_vram");
    assert!(d["incident"].is_string());
    assert_eq!(d["causes"][0]["kind"], "kv_growth");
    let d = col.json(&["diagnose", "--agent", "leak_retained", "--since", "1h"]);
    assert!(d["domain"].is_null() && d["incident"].is_null());
    assert_eq!(d["trigger"], "repeated_requests");
    assert_eq!(d["causes"][0]["kind"], "leak");
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or("-").to_string()
}

fn domain_matches(exp: &str, got: &str) -> bool {
    exp == got
}

fn trigger_matches(exp: &str, got: &str) -> bool {
    exp == got || (exp == "-" && got == "unknown")
}

fn cause_matches(exp: &str, got: &str) -> bool {
    match exp.strip_prefix('!') {
        Some(not) => got != not,
        None => exp == got,
    }
}

fn cause<'a>(d: &'a Value, kind: &str) -> &'a Value {
    d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} cause"))
}

fn has_cause(d: &Value, kind: &str) -> bool {
    d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["kind"] == kind)
}

fn metric(d: &Value, kind: &str, name: &str) -> f64 {
    cause(d, kind)["metrics"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("{kind} has no metric {name}"))
}

fn within(got: f64, want: f64, rel: f64) -> bool {
    (got - want).abs() <= want.abs() * rel
}

fn assert_within(got: f64, want: f64, rel: f64, what: &str) {
    assert!(
        within(got, want, rel),
        "{what}: got {got}, want {want} ± {:.0}%",
        rel * 100.0
    );
}

/// Every fix says what to retest, and none suggests empty_cache as the plan
/// or killing a process.
fn fixes_are_sound(d: &Value) {
    for f in d["fixes"].as_array().unwrap() {
        assert!(!f["retest"].as_str().unwrap().is_empty(), "{f}");
        let action = f["action"].as_str().unwrap().to_lowercase();
        assert!(!action.contains("kill"), "a fix suggests killing: {f}");
        assert!(!action.contains("empty_cache"), "{f}");
    }
}

fn nothing(d: &Value) {
    assert!(d["causes"].as_array().unwrap().is_empty());
    assert!(d["capacity"].is_null());
}

fn leak_retained(d: &Value) {
    assert_within(
        metric(d, "leak", "bytes_per_request"),
        8.0 * MIB,
        0.01,
        "bytes_per_request",
    );
    assert!(metric(d, "leak", "requests_to_limit") > 1000.0);
    assert_within(
        metric(d, "leak", "live_tensors_per_request"),
        1.0,
        0.01,
        "live tensors",
    );
    assert!(!has_cause(d, "gc_retained"));
    fixes_are_sound(d);
}

fn hf_leak_scores(d: &Value) {
    assert_within(
        metric(d, "leak", "bytes_per_request"),
        6.15 * MIB,
        0.03,
        "bytes_per_request",
    );
    assert_within(
        metric(d, "leak", "live_tensors_per_request"),
        49.0,
        0.01,
        "live tensors",
    );
    assert!(!has_cause(d, "host_growth"), "host RSS is flat");
}

fn cycle_retention(d: &Value) {
    assert!(!has_cause(d, "leak"), "garbage awaiting gc is not a leak");
    assert_within(
        metric(d, "gc_retained", "bytes_per_request"),
        16.0 * MIB,
        0.01,
        "bytes_per_request",
    );
    assert_within(
        metric(d, "gc_retained", "reclaimed_bytes"),
        480.0 * MIB,
        0.01,
        "reclaimed",
    );
}

fn cache_no_leak(d: &Value) {
    let kinds: Vec<&str> = d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["cache_retention"]);
    assert_within(
        metric(d, "cache_retention", "reserved_peak_bytes"),
        846.0 * MIB,
        0.01,
        "reserved",
    );
    assert_within(
        metric(d, "cache_retention", "released_bytes"),
        846.0 * MIB,
        0.01,
        "released",
    );
    assert_eq!(metric(d, "cache_retention", "live_bytes"), 0.0);
}

fn hf_varied_no_leak(d: &Value) {
    assert!(!has_cause(d, "leak"));
    assert!(
        !has_cause(d, "host_growth"),
        "warm-up RSS growth that plateaus is not host growth"
    );
    assert!(d["trigger"].is_null());
}

fn fragmentation_oom(d: &Value) {
    assert_eq!(metric(d, "fragmentation", "request_bytes"), 96.0 * MIB);
    assert_eq!(
        metric(d, "fragmentation", "reserved_unallocated_bytes"),
        1200.0 * MIB
    );
    assert!(metric(d, "fragmentation", "largest_free_block_bytes") < 96.0 * MIB);
    assert_eq!(
        metric(d, "fragmentation", "inactive_split_bytes"),
        1200.0 * MIB
    );
    let actions: Vec<&str> = d["fixes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["action"].as_str().unwrap())
        .collect();
    assert!(
        actions
            .iter()
            .any(|a| a.contains("expandable_segments:True")),
        "{actions:?}"
    );
    fixes_are_sound(d);
}

fn fragmentation_expandable(d: &Value) {
    assert_eq!(metric(d, "fragmentation", "request_bytes"), 96.0 * MIB);
    assert_eq!(
        metric(d, "fragmentation", "reserved_unallocated_bytes"),
        1000.0 * MIB
    );
    assert_eq!(metric(d, "fragmentation", "expandable_segments"), 1.0);
    let evidence = cause(d, "fragmentation")["evidence"].to_string();
    assert!(evidence.contains("already on"), "{evidence}");
    for f in d["fixes"].as_array().unwrap() {
        assert!(
            !f["action"]
                .as_str()
                .unwrap()
                .contains("expandable_segments:True"),
            "already on: {f}"
        );
    }
    fixes_are_sound(d);
}

fn kv_concurrency_oom(d: &Value) {
    assert_within(
        metric(d, "kv_growth", "bytes_per_token"),
        128.0 * KIB,
        0.15,
        "bytes_per_token",
    );
    assert_eq!(metric(d, "kv_growth", "failed_at_active_tokens"), 14848.0);
    let cap = &d["capacity"];
    assert_eq!(cap["safe_sequences"], 3, "{cap}");
    assert_eq!(cap["limit_bytes"], 3u64 << 30);
    assert_eq!(cap["weights_bytes"], 1u64 << 30);
    assert_eq!(cap["context_tokens"], 4096);
    assert_within(
        cap["bytes_per_token"].as_f64().unwrap(),
        128.0 * KIB,
        0.15,
        "capacity bytes_per_token",
    );
    // Activation/workspace overhead counts: 32 MiB per sequence here.
    assert_within(
        cap["overhead_bytes_per_sequence"].as_f64().unwrap(),
        32.0 * MIB,
        0.15,
        "overhead",
    );
    fixes_are_sound(d);
}

fn hf_concurrency(d: &Value) {
    assert_within(
        metric(d, "kv_growth", "bytes_per_token"),
        64.0 * KIB,
        0.15,
        "bytes_per_token",
    );
    assert_eq!(metric(d, "kv_growth", "failed_at_active_tokens"), 36864.0);
    // It failed at 32 sequences: a capacity claim must stay below that.
    let safe = d["capacity"]["safe_sequences"].as_u64().unwrap();
    assert!(safe > 0 && safe < 32, "{}", d["capacity"]);
    fixes_are_sound(d);
}

fn long_context_single(d: &Value) {
    assert_within(
        metric(d, "kv_growth", "bytes_per_token"),
        96.0 * KIB,
        0.15,
        "bytes_per_token",
    );
    assert_eq!(metric(d, "kv_growth", "failed_at_active_tokens"), 12800.0);
    let safe_tokens = d["capacity"]["safe_active_tokens"].as_u64().unwrap();
    assert!(safe_tokens > 0 && safe_tokens < 12800, "{}", d["capacity"]);
}

fn weights_too_large(d: &Value) {
    assert_eq!(metric(d, "weights_too_large", "loaded_bytes"), 2.0 * GIB);
    assert_eq!(metric(d, "weights_too_large", "limit_bytes"), 2.0 * GIB);
    assert_eq!(metric(d, "weights_too_large", "model_bytes"), 3.0 * GIB);
    assert!(d["capacity"].is_null(), "no request was served");
    fixes_are_sound(d);
}

fn other_process_shared(d: &Value) {
    let c = cause(d, "other_process");
    let procs = c["processes"].as_array().unwrap();
    let p444 = procs
        .iter()
        .find(|p| p["pid"] == 444)
        .expect("pid 444 named");
    assert_eq!(p444["bytes"], 144_732_848_128u64);
    assert!(
        procs.iter().all(|p| p["pid"] != 422),
        "its own pid is not another process"
    );
    fixes_are_sound(d);
}
