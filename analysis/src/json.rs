//! The `oomscope diagnose --json` shape. Other tools read it: every key is
//! always present, null where unset.

use serde_json::{json, Map, Number, Value};

use crate::pb;

/// Renders a diagnosis in the documented JSON shape.
pub fn to_json(d: &pb::Diagnosis) -> Value {
    json!({
        "incident": d.incident,
        "agent": d.agent,
        "domain": d.domain,
        "trigger": d.trigger,
        "causes": d.causes.iter().map(cause).collect::<Vec<_>>(),
        "fixes": d.fixes.iter().map(|f| json!({
            "action": f.action,
            "risk": f.risk,
            "retest": f.retest,
            "caveat": f.caveat,
        })).collect::<Vec<_>>(),
        "capacity": capacity(&d.capacity_json),
        "evidence": d.evidence,
        "exit": d.exit.map(|x| json!({"code": x.code, "signal": x.signal})),
        "cgroup": d.cgroup.as_ref().map(|c| json!({
            "path": c.path,
            "limit_bytes": c.limit_bytes,
            "owner_level": c.owner_level,
        })),
        "failure": d.failure.as_ref().map(failure),
        "device": d.device.as_ref().map(device),
        "victim": d.victim.as_ref().map(|v| json!({
            "pid": v.pid,
            "command": v.command,
            "title": v.title,
            "status": v.status.map(|s| json!({"code": s.code, "signal": s.signal})),
        })),
        "kernel_report": d.kernel_report.as_ref().map(|k| json!({
            "pid": k.pid,
            "command": k.command,
            "anon_rss_bytes": k.anon_rss_bytes,
            "file_rss_bytes": k.file_rss_bytes,
            "shmem_rss_bytes": k.shmem_rss_bytes,
            "total_vm_bytes": k.total_vm_bytes,
            "constraint": k.constraint,
            "oom_memcg": k.oom_memcg,
            "task_memcg": k.task_memcg,
            "memcg_usage_bytes": k.memcg_usage_bytes,
            "memcg_limit_bytes": k.memcg_limit_bytes,
            "oom_score_adj": k.oom_score_adj,
            "order": k.order,
            "nodemask": k.nodemask,
            "mems_allowed": k.mems_allowed,
            "cpuset": k.cpuset,
        })),
    })
}

fn failure(f: &pb::Failure) -> Value {
    json!({
        "time_ns": f.time_ns,
        "kind": f.kind,
        "requested_bytes": f.requested_bytes,
        "phase": f.phase,
        "active_tokens": f.active_tokens,
        "active_sequences": f.active_sequences,
        "requests_done": f.requests_done,
        "kv_cache_bytes": f.kv_cache_bytes,
        "error_text": f.error_text,
        "oom_device": f.oom_device,
        // The allocator's headline numbers; `timeline` has the full readings.
        "stats": f.stats.as_ref().map(|s| json!({
            "allocated_bytes": s.allocated_bytes,
            "reserved_bytes": s.reserved_bytes,
            "inactive_split_bytes": s.inactive_split_bytes,
            "num_alloc_retries": s.num_alloc_retries,
            "driver_free_bytes": s.driver_free_bytes,
            "driver_total_bytes": s.driver_total_bytes,
        })),
        "stats_from_ns": f.stats_from_ns,
        "expandable_segments": f.expandable_segments,
    })
}

/// The failing device; an identity that is not known is null, never "".
fn device(d: &pb::FailedDevice) -> Value {
    let known = |s: &str| (!s.is_empty()).then(|| s.to_string());
    json!({
        "uuid": known(&d.uuid),
        "ordinal": d.ordinal,
        "nvml_index": d.nvml_index,
        "name": known(&d.name),
        "parent_uuid": known(&d.parent_uuid),
        "total_bytes": d.total_bytes,
        "identified_by": d.identified_by,
        "certain": d.certain,
    })
}

fn cause(c: &pb::Cause) -> Value {
    // Sorted keys: the same diagnosis always prints the same text.
    let mut names: Vec<&String> = c.metrics.keys().collect();
    names.sort();
    let metrics: Map<String, Value> = names
        .into_iter()
        .filter_map(|k| number(c.metrics[k]).map(|n| (k.clone(), Value::Number(n))))
        .collect();
    json!({
        "kind": c.kind,
        "confidence": c.confidence,
        "evidence": c.evidence,
        "metrics": metrics,
        "processes": c.processes.iter().map(|p| json!({
            "pid": p.pid,
            "bytes": p.bytes,
            "user": p.user,
            "command": p.command,
        })).collect::<Vec<_>>(),
    })
}

/// Whole numbers (byte counts) print as integers; NaN and infinities, which
/// JSON cannot carry, are left out.
fn number(v: f64) -> Option<Number> {
    // 2^53: beyond it an f64 no longer holds every integer exactly.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if v.is_finite() && v.fract() == 0.0 && v.abs() <= EXACT {
        Some(Number::from(v as i64))
    } else {
        Number::from_f64(v)
    }
}

/// The capacity estimate is stored as JSON text; anything but an object is null.
fn capacity(text: &str) -> Value {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Null,
    }
}
