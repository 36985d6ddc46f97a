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
