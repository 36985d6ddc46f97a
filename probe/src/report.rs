//! The probe's report: one versioned JSON shape (for CI gates and
//! `probe --compare`), and its text rendering for people.
//!
//! Schema `oomscope.probe/v1` (additive changes keep the version; a removed or
//! retyped field bumps it):
//! ```text
//! {schema, endpoint, model|null, agent|null, started_ns, duration_s,
//!  settings: {str: str},                 // what the run and the server were configured with
//!  verdict: "ok"|"environment"|"unsafe"|"incomplete",
//!  suites: [{suite, status: "pass"|"fail"|"error"|"skipped", verdict, reason|null,
//!            steps: [Step], findings: object, duration_s}],
//!  envelope: {max_context_at_concurrency_1, max_concurrency_at_typical_context,
//!             max_concurrency_at_max_context: Figure}|null,
//!  warnings: [str]}
//! Step   = {label, prompt_words, prompt_tokens|null, concurrency, calls, ok, refused,
//!           rejected, server_errors, timeouts, unreachable, p50_ms|null, p99_ms|null,
//!           memory: {allocated_bytes, reserved_bytes, rss_bytes, cgroup_usage_bytes}|null,
//!           failure|null}
//! Figure = {value|null, unit: "tokens"|"sequences", context_tokens|null, concurrency|null,
//!           bounded_by, evidence: [str]}
//! ```
//! `bounded_by` is a memory domain ("gpu_vram", "host_ram", "cgroup", ...) when
//! the next step failed for memory, else "latency", "max_context_setting",
//! "admission_cap", "server_error", "timeout" or "probe_limit" (the probe's
//! own ceiling was reached without a failure).

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::{Deserialize, Serialize};

pub const SCHEMA: &str = "oomscope.probe/v1";

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MemoryAt {
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub rss_bytes: Option<u64>,
    pub cgroup_usage_bytes: Option<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Step {
    pub label: String,
    pub prompt_words: usize,
    pub prompt_tokens: Option<u64>,
    pub concurrency: usize,
    pub calls: usize,
    pub ok: usize,
    pub refused: usize,
    pub rejected: usize,
    pub server_errors: usize,
    pub timeouts: usize,
    pub unreachable: usize,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub memory: Option<MemoryAt>,
    pub failure: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Fail,
    Error,
    Skipped,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SuiteReport {
    pub suite: String,
    pub status: Status,
    pub verdict: String,
    pub reason: Option<String>,
    pub steps: Vec<Step>,
    pub findings: serde_json::Value,
    pub duration_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    pub value: Option<u64>,
    pub unit: String,
    pub context_tokens: Option<u64>,
    pub concurrency: Option<u64>,
    pub bounded_by: String,
    pub evidence: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Envelope {
    pub max_context_at_concurrency_1: Figure,
    pub max_concurrency_at_typical_context: Figure,
    pub max_concurrency_at_max_context: Figure,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeReport {
    pub schema: String,
    pub endpoint: String,
    pub model: Option<String>,
    pub agent: Option<String>,
    pub started_ns: i64,
    pub duration_s: f64,
    pub settings: BTreeMap<String, String>,
    pub verdict: String,
    pub suites: Vec<SuiteReport>,
    pub envelope: Option<Envelope>,
    pub warnings: Vec<String>,
}

impl ProbeReport {
    pub fn suite(&self, name: &str) -> Option<&SuiteReport> {
        self.suites.iter().find(|s| s.suite == name)
    }
}

fn figure_line(name: &str, f: &Figure) -> String {
    let v = f
        .value
        .map_or("none found".to_string(), |v| format!("{v} {}", f.unit));
    let at = match (f.context_tokens, f.concurrency) {
        (Some(c), Some(n)) => format!(" (context {c} tokens, concurrency {n})"),
        (Some(c), None) => format!(" (context {c} tokens)"),
        (None, Some(n)) => format!(" (concurrency {n})"),
        _ => String::new(),
    };
    format!("  {name:<36} {v}{at}; bounded by {}", f.bounded_by)
}

pub fn text(r: &ProbeReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "oomscope probe of {} ({})",
        r.endpoint,
        r.model.as_deref().unwrap_or("default model")
    );
    let _ = writeln!(out, "Verdict: {}", r.verdict);
    for s in &r.suites {
        let status = match s.status {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Error => "ERROR",
            Status::Skipped => "skip",
        };
        let _ = writeln!(out, "[{status:<5}] {:<13} {}", s.suite, s.verdict);
        if let Some(why) = &s.reason {
            let _ = writeln!(out, "        {why}");
        }
        for st in &s.steps {
            let mem = st
                .memory
                .as_ref()
                .and_then(|m| m.allocated_bytes.or(m.rss_bytes))
                .map(|b| format!(" mem {}", oomscope_analysis::units::bytes_table(b)))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "        {:<24} ok {}/{} refused {} errors {} timeouts {} p99 {}{mem}{}",
                st.label,
                st.ok,
                st.calls,
                st.refused,
                st.server_errors + st.unreachable,
                st.timeouts,
                st.p99_ms.map_or("-".into(), |p| format!("{p:.0} ms")),
                st.failure
                    .as_ref()
                    .map(|f| format!("  <- {f}"))
                    .unwrap_or_default()
            );
        }
    }
    if let Some(e) = &r.envelope {
        out.push_str("Safe envelope:\n");
        for (name, f) in [
            (
                "max context at concurrency 1",
                &e.max_context_at_concurrency_1,
            ),
            (
                "max concurrency at typical context",
                &e.max_concurrency_at_typical_context,
            ),
            (
                "max concurrency at max context",
                &e.max_concurrency_at_max_context,
            ),
        ] {
            let _ = writeln!(out, "{}", figure_line(name, f));
            for ev in &f.evidence {
                let _ = writeln!(out, "      {ev}");
            }
        }
    } else {
        out.push_str("Safe envelope: none claimed (the capacity suites did not run, or the smoke test failed)\n");
    }
    for w in &r.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
}

/// The probe's exit status for each verdict, which CI gates on; anything
/// else the probe reports counts as unsafe.
pub const VERDICT_EXITS: [(&str, i32, &str); 4] = [
    (
        "ok",
        0,
        "the envelope was measured and nothing unsafe was seen",
    ),
    (
        "unsafe",
        1,
        "the overload, restart or repeated suite failed",
    ),
    (
        "environment",
        3,
        "the smoke request failed: the server, URL or model, not capacity",
    ),
    (
        "incomplete",
        4,
        "a suite could not finish (an error, not a verdict)",
    ),
];

/// The exit status for `verdict` (an unknown one counts as unsafe).
pub fn exit_code(verdict: &str) -> i32 {
    VERDICT_EXITS
        .iter()
        .find(|(v, ..)| *v == verdict)
        .map_or(1, |&(_, code, _)| code)
}
