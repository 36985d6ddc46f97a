//! A real vLLM start-up kill, from its capture (tests/fixtures/vllm-startup-kill,
//! README there): vLLM on CPU under `oomscope run --memory-limit`, its
//! `VLLM_CPU_KVCACHE_SPACE` pool larger than the limit leaves, the kernel
//! killing `VLLM::Worker` while it filled the pool, before any request.
//! The Worker's own agent saw its RSS rise for 20 s: that is the pool being
//! filled (loading), not growth over requests, so the reservation leads,
//! with the figures the capture holds; and the reservation is found from
//! the size vLLM stated (`vllm.kv_pool_bytes`) where no setting says it.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};
use serde_json::Value;

const CG: &str = "/oomscope-run/vllm";
/// The epoch of the capture's millisecond offsets.
const MS: i64 = 1_000_000;

fn capture(name: &str) -> Value {
    let path = format!(
        "{}/../tests/fixtures/vllm-startup-kill/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

fn at(v: &Value) -> i64 {
    T0 + v.as_i64().unwrap() * MS
}

/// What the Python agent reports in every sample: its request counters,
/// zero here (nothing was served), and what vLLM's plugin adds.
fn agent_context(kv_pool: u64) -> pb::RequestContext {
    let mut c = pb::RequestContext {
        phase: "periodic".into(),
        ..Default::default()
    };
    for k in [
        "requests_in_flight",
        "requests_failed",
        "in_flight_tokens_max",
    ] {
        c.numbers.insert(k.into(), 0.0);
    }
    if kv_pool > 0 {
        c.numbers
            .insert("vllm.kv_pool_bytes".into(), kv_pool as f64);
    }
    c
}

/// The Worker's own agent: its RSS and what the plugin stated of its pool.
fn worker(x: &Value) -> Evidence {
    let w = &x["worker"];
    let pid = u(&w["pid"]) as u32;
    Evidence {
        members: Vec::new(),
        ended: true,
        hello: Some(pb::Hello {
            agent_id: "pytorch-worker".into(),
            name: "vllm-kv".into(),
            pid,
            role: "worker".into(),
            runtime: "pytorch".into(),
            title: w["title"].as_str().unwrap().into(),
            command: vec!["-c".into(), "--multiprocessing-fork".into()],
            start_time_ns: at(&w["start_ms"]),
            ..Default::default()
        }),
        samples: w["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| pb::Sample {
                time_ns: at(&s[0]),
                process: Some(pb::ProcessMemory {
                    pid,
                    vm_rss_bytes: u(&s[1]),
                    ..Default::default()
                }),
                context: Some(agent_context(u(&s[2]))),
                ..Default::default()
            })
            .collect(),
        events: Vec::new(),
        incident: None,
    }
}

/// `oomscope run`'s evidence of the instance: its cgroup's usage and the API
/// server's readings, the kernel's kill and the exits; `env` as the Hello's
/// labels; with the Worker's agent as a member where `with_worker`.
fn instance(x: &Value, env: bool, with_worker: bool) -> Evidence {
    let limit = u(&x["limit_bytes"]);
    let api = u(&x["api_server"]["pid"]) as u32;
    let mut h = hello();
    h.command = x["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap().to_string())
        .collect();
    if env {
        for (k, v) in x["env"].as_object().unwrap() {
            h.labels
                .insert(format!("env.{k}"), v.as_str().unwrap().into());
        }
    }
    let samples = x["supervisor_samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| pb::Sample {
            time_ns: at(&s[0]),
            cgroup: vec![v1(CG, limit, u(&s[1]), u(&s[1]), 0, 0)],
            process: Some(pb::ProcessMemory {
                pid: api,
                vm_rss_bytes: u(&s[2]),
                ..Default::default()
            }),
            context: Some(agent_context(0)),
            ..Default::default()
        })
        .collect();
    let k = &x["kill"];
    let kill_ns = at(&k["t_ms"]);
    let mut events = vec![pb::Event {
        time_ns: kill_ns,
        kind: Some(Kind::KernelOomKill(pb::KernelOomKill {
            pid: u(&k["pid"]) as u32,
            task: k["task"].as_str().unwrap().into(),
            constraint: "CONSTRAINT_MEMCG".into(),
            oom_memcg: CG.into(),
            task_memcg: CG.into(),
            anon_rss_bytes: u(&k["anon_rss_bytes"]),
            file_rss_bytes: u(&k["file_rss_bytes"]),
            memcg_usage_bytes: u(&k["memcg_usage_bytes"]),
            memcg_limit_bytes: limit,
            ..Default::default()
        })),
    }];
    for e in x["exits"].as_array().unwrap() {
        events.push(pb::Event {
            time_ns: at(&e["t_ms"]),
            kind: Some(Kind::ChildExit(pb::ChildExit {
                pid: u(&e["pid"]) as u32,
                exit_code: e["exit_code"].as_i64().map(|c| c as i32),
                signal: e["signal"].as_i64().map(|s| s as i32),
                member: e["member"].as_bool().unwrap(),
                runtime_ns: u(&e["runtime_ms"]) * MS as u64,
                stderr_tail: e["stderr_tail"].as_str().unwrap().into(),
                ..Default::default()
            })),
        });
    }
    Evidence {
        members: if with_worker {
            vec![worker(x)]
        } else {
            Vec::new()
        },
        ended: false,
        hello: Some(h),
        samples,
        events,
        incident: incident("oom", kill_ns),
    }
}

/// The captured pool (VLLM_CPU_KVCACHE_SPACE) and limit of a fixture.
fn pool_and_limit(x: &Value) -> (u64, u64) {
    let gib: u64 = x["env"]["VLLM_CPU_KVCACHE_SPACE"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    (gib * GIB, u(&x["limit_bytes"]))
}

/// The reservation leads a start-up kill, the Worker's rise is no growth
/// verdict, and the figures are the capture's: the pool, the limit, what
/// the rest of vLLM held before the climb (the cgroup's usage where the
/// last run of ≥4 MiB steps began), and a proposal that fits beside it.
fn reservation_leads(name: &str, env: bool) -> pb::Diagnosis {
    let x = capture(name);
    let (pool, limit) = pool_and_limit(&x);
    let d = diagnose(&instance(&x, env, true));
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert_eq!(d.causes[0].kind, "kv_reservation", "{:#?}", d.causes);
    assert!(
        d.causes
            .iter()
            .all(|c| c.kind != "host_growth" && c.kind != "leak"),
        "{:#?}",
        d.causes
    );
    // Loading is not growth over requests or time: no growth trigger.
    assert!(
        !matches!(
            d.trigger.as_deref(),
            Some("growth_over_time" | "repeated_requests")
        ),
        "{:?}",
        d.trigger
    );
    let c = &d.causes[0];
    assert_eq!(metric(c, "limit_bytes"), limit as f64);
    assert_eq!(metric(c, "kv_pool_bytes"), pool as f64);
    let usage: Vec<u64> = x["supervisor_samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| u(&s[1]))
        .collect();
    let rest = metric(c, "rest_bytes") as u64;
    let top = *usage.iter().max().unwrap();
    assert!(usage.contains(&rest) && rest < top, "{rest} of {usage:?}");
    // The rest plus the pool does not fit, and it is said with the numbers.
    assert!(rest + pool > limit);
    has(&c.evidence, "pool = ");
    has(&c.evidence, "while vLLM was starting, before any request");
    // What fits: (limit − rest − the warm-up after the pool) × 0.9, to 0.1 GiB.
    let warmup = ((rest as f64 * 0.15) as u64).max(256 * MIB);
    let room = (limit - rest - warmup) as f64 * 0.9 / GIB as f64;
    let proposed = ((room * 10.0 + 1e-9).floor() / 10.0 * GIB as f64).round();
    assert_eq!(metric(c, "proposed_kv_bytes"), proposed);
    d
}

#[test]
fn a_4_gib_pool_under_a_4_gib_limit_is_the_reservation_not_growth() {
    let d = reservation_leads("kv4-limit4g.json", true);
    // 1.7 GiB held before the climb leaves room for 1 GiB: the variable's whole GiB.
    assert!(
        d.fixes[0].action.starts_with(
            "Lower the KV reservation to what fits: `VLLM_CPU_KVCACHE_SPACE=1` (now 4; in GiB)"
        ),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn a_2_gib_pool_under_a_3_gib_limit_is_the_reservation_in_bytes() {
    let d = reservation_leads("kv2-limit3g.json", true);
    // Under 1 GiB fits: the variable takes whole GiB, so the flag in bytes,
    // and the variable unset (vLLM's CPU backend lets it override the flag).
    let c = &d.causes[0];
    let want = metric(c, "proposed_kv_bytes") as u64;
    assert!(want < GIB, "{want}");
    assert!(
        d.fixes[0].action.starts_with(&format!(
            "Lower the KV reservation to what fits: `--kv-cache-memory-bytes {want}` instead of `VLLM_CPU_KVCACHE_SPACE`"
        )),
        "{:#?}",
        d.fixes
    );
}

#[test]
fn the_pool_vllm_stated_is_the_reservation_where_no_setting_says_it() {
    // The same capture without the variable in the Hello's labels: the
    // Worker's plugin stated its pool (vllm.kv_pool_bytes) before the kill.
    let d = reservation_leads("kv4-limit4g.json", false);
    has(&d.causes[0].evidence, "vLLM stated a KV pool of 4.0 GiB");
}

#[test]
fn the_workers_own_timeline_alone_reads_as_growth() {
    // What the rule above sets aside: the Worker's agent, read alone, sees
    // its RSS rise against time (it counts no requests of its own).
    let x = capture("kv4-limit4g.json");
    let d = diagnose(&worker(&x));
    let c = cause(&d, "host_growth");
    assert!(metric(c, "bytes_per_second") > 10.0 * MIB as f64, "{c:?}");
    // In the instance that served a request before the kill, the same rise
    // is no start-up: it stays a growth of the Worker, and the reservation
    // (a kill before any request) is not claimed.
    let mut e = instance(&x, true, true);
    let first = e.samples.len() / 4;
    e.samples[first].context.as_mut().unwrap().requests_done = 1;
    let d = diagnose(&e);
    assert!(
        d.causes.iter().any(|c| c.kind == "host_growth"),
        "{:#?}",
        d.causes
    );
    assert!(
        d.causes.iter().all(|c| c.kind != "kv_reservation"),
        "{:#?}",
        d.causes
    );
}
