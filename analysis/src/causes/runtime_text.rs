//! The cause a runtime names in its own words: the stderr text matched an
//! entry of the table in `crate::oom_texts` that names a cause (the KV
//! reservation, a KV cache too small for the context, a prefill batch, ...).
//! Where the text gives figures (vLLM's "Available memory on node 0
//! (20.88/23.54 GiB) … requested memory for kv (40.0 GiB)"), they become
//! metrics, with the value a fix proposes from them.

use super::cause;
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::kv_pool_figures::{self, FIT_SHARE, GIB};
use crate::pb;

/// The runtime said what ran out and why. Where the verdict names another
/// domain (a kernel kill, a cgroup limit), the text is a lesser witness.
pub fn runtime_text(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let m = f.text.as_ref()?;
    // Every cause in the table is a CauseKind's name (its tests check).
    let kind = m.text.cause?.parse().ok()?;
    let confidence = if f.text_domain == Some(v.domain) {
        0.9
    } else {
        0.5
    };
    let evidence = vec![
        format!("{} said: {}", m.text.runtime, m.line),
        format!("{}: {}", m.text.runtime, m.text.meaning),
    ];
    Some(cause(kind, confidence, evidence, &text_metrics(&m.line)))
}

/// The text's figures, and what they let a fix propose: a KV reservation
/// below the memory available (a share of it, rounded down to 0.1 GiB), a
/// memory share below the free share of the device, a context the KV cache holds.
fn text_metrics(line: &str) -> Vec<(&'static str, f64)> {
    let t = kv_pool_figures::text_figures(line);
    let mut m = Vec::new();
    if let Some(a) = t.available_bytes {
        m.push(("available_bytes", a as f64));
    }
    if let Some(total) = t.total_bytes {
        m.push(("total_bytes", total as f64));
    }
    if let Some(r) = t.requested_bytes {
        m.push(("requested_bytes", r as f64));
    }
    if let Some(fr) = t.fraction {
        m.push(("memory_fraction", fr));
    }
    match (t.fraction, t.available_bytes, t.total_bytes) {
        // The share asked for did not fit the free memory: propose the free share.
        (Some(_), Some(a), Some(total)) if total > 0 => {
            let share = kv_pool_figures::floor_to(a as f64 / total as f64 * FIT_SHARE, 0.01);
            if share > 0.0 {
                m.push(("proposed_memory_fraction", share));
            }
        }
        // A KV reservation larger than the memory available.
        (None, Some(a), _) if t.requested_bytes.is_some() => {
            let gib = kv_pool_figures::floor_to(a as f64 * FIT_SHARE / GIB, 0.1);
            if gib > 0.0 {
                m.push(("proposed_kv_bytes", (gib * GIB).round()));
            }
        }
        _ => {}
    }
    if let Some(c) = t.context_tokens {
        m.push(("max_context_tokens", c as f64));
    }
    if let Some(k) = t.kv_tokens {
        m.push(("kv_tokens", k as f64));
        m.push(("proposed_max_context", k as f64));
    }
    m
}
