//! The probe's report: one versioned JSON shape (for CI gates and
//! `probe --compare`), and its text rendering for people.
//!
//! Schema `oomscope.probe/v1` (additive changes keep the version; a removed or
//! retyped field bumps it). Every count of context is in tokens, as the
//! server counted them (its tokenizer or `usage.prompt_tokens`):
//! ```text
//! {schema, endpoint, model|null, agent|null, started_ns, duration_s,
//!  settings: {str: str},                 // what the run and the server were configured with
//!  verdict: "ok"|"environment"|"unsafe"|"incomplete",
//!  suites: [{suite, status: "pass"|"fail"|"error"|"skipped", verdict, reason|null,
//!            steps: [Step], findings: object, duration_s, budget_s|null}],
//!  envelope: {max_context_at_concurrency_1, max_concurrency_at_typical_context,
//!             max_concurrency_at_max_context: Figure,
//!             shared_prefix_tokens|null, server_death: Death|null}|null,
//!  server: {api, streaming, tokenizer, token_count, tokenize_path|null, strict_fields, load_source|null,
//!           runtime|null, max_model_len|null,
//!           pace: {prefill_tokens_per_s|null, decode_tokens_per_s|null, overhead_ms,
//!                  tiny_ms, samples}|null},
//!  prompts: {sent, distinct, shared_prefix_tokens|null},
//!  deaths: [Death],
//!  warnings: [str]}
//! Step   = {label, prompt_words, prompt_tokens|null, context_tokens|null, concurrency, calls, ok,
//!           refused, rejected, empty, server_errors, timeouts, unreachable, not_measured,
//!           p50_ms|null, p99_ms|null,
//!           first_token_p50_ms|null, effective_concurrency|null, effective_method|null,
//!           server_load: Load|null, idle_wait: {waited_ms, method, still_busy, detail}|null,
//!           memory: {allocated_bytes, reserved_bytes, rss_bytes, cgroup_usage_bytes,
//!                    cgroup_limit_bytes, gpu_used_bytes, gpu_total_bytes}|null,
//!           failure|null}
//! Figure = {value|null, unit: "tokens"|"sequences", context_tokens|null, concurrency|null,
//!           bounded_by, evidence: [str], offered|null, method|null, estimated?: true}
//! Death  = {suite, time_ns, source: "collector"|"connection_refused", incident|null,
//!           kind|null, domain|null, cause|null, summary}
//! ```
//! A concurrency figure's `value` is the effective concurrency: the most
//! requests the server had in service at once (`offered` is the most the
//! probe sent at once that all succeeded; `method` says how the effective
//! count was known). `bounded_by` is a memory domain ("gpu_vram",
//! "host_ram", "cgroup", ...) when the next step failed for memory, else
//! "serialized" (one request at a time), "kv_pool" (the KV pool full with
//! requests waiting or preempted), "max_sequences_setting" (a cap on the
//! sequences run at once), "latency", "max_context_setting",
//! "admission_cap", "server_error", "timeout", "server_died" (it died and
//! the collector named no domain), "suite_budget" (the budget
//! ran out first: the suite is incomplete), "deadline" (the run's
//! `--deadline` left it no more time: incomplete too; both are lower
//! bounds whose evidence says where the ramp was), "not_measured" (its suite did
//! not run) or "probe_limit" (the probe's own ceiling was reached without a
//! failure) or "estimated" (no failure up to the probe's ceiling, in tokens
//! the server never counted). A figure with `estimated: true` is in tokens
//! estimated from words.

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
    /// The tightest limit over the server's cgroup and its ancestors (the
    /// level whose usage `cgroup_usage_bytes` is).
    #[serde(default)]
    pub cgroup_limit_bytes: Option<u64>,
    /// The server's GPUs, used and total, summed over its devices.
    #[serde(default)]
    pub gpu_used_bytes: Option<u64>,
    #[serde(default)]
    pub gpu_total_bytes: Option<u64>,
}

impl MemoryAt {
    /// The memory in the domain that bounds the server, as "domain used of
    /// limit": the GPU when it is on one, else its cgroup against the
    /// cgroup's limit when one is set, else its RSS (host memory).
    pub fn shown(&self) -> Option<String> {
        let b = oomscope_analysis::units::bytes_table;
        if let Some(used) = self.gpu_used_bytes.filter(|&u| u > 0) {
            return Some(match self.gpu_total_bytes.filter(|&t| t > 0) {
                Some(t) => format!("gpu {} of {}", b(used), b(t)),
                None => format!("gpu {}", b(used)),
            });
        }
        if let Some(used) = self.allocated_bytes.filter(|&u| u > 0) {
            return Some(format!("gpu allocated {}", b(used)));
        }
        if let (Some(used), Some(limit)) = (
            self.cgroup_usage_bytes,
            self.cgroup_limit_bytes.filter(|&l| l > 0),
        ) {
            return Some(format!("cgroup {} of {}", b(used), b(limit)));
        }
        self.rss_bytes.map(|r| format!("rss {}", b(r)))
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Step {
    pub label: String,
    pub prompt_words: usize,
    /// The most prompt tokens the server counted for one request of the step.
    pub prompt_tokens: Option<u64>,
    /// The tokens each prompt was sized to.
    #[serde(default)]
    pub context_tokens: Option<u64>,
    pub concurrency: usize,
    pub calls: usize,
    pub ok: usize,
    pub refused: usize,
    pub rejected: usize,
    /// Answered 200 with no generated token: a refusal at that size.
    #[serde(default)]
    pub empty: usize,
    pub server_errors: usize,
    pub timeouts: usize,
    pub unreachable: usize,
    /// Requests cut by the suite's budget or the run's deadline before an
    /// answer: neither a success nor a failure.
    #[serde(default)]
    pub not_measured: usize,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Median time to the first streamed token.
    #[serde(default)]
    pub first_token_p50_ms: Option<f64>,
    /// The most requests in service at once (see `Figure.method` for how).
    #[serde(default)]
    pub effective_concurrency: Option<u64>,
    #[serde(default)]
    pub effective_method: Option<String>,
    /// The server's own account of its load during the step.
    #[serde(default)]
    pub server_load: Option<crate::metrics::Load>,
    pub memory: Option<MemoryAt>,
    pub failure: Option<String>,
    /// How long the rung first waited for the server to finish the probe's
    /// abandoned requests, where any were.
    #[serde(default)]
    pub idle_wait: Option<crate::idle::IdleWait>,
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
    /// The suite's wall-clock budget.
    #[serde(default)]
    pub budget_s: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    pub value: Option<u64>,
    pub unit: String,
    pub context_tokens: Option<u64>,
    pub concurrency: Option<u64>,
    pub bounded_by: String,
    pub evidence: Vec<String>,
    /// Concurrency figures: the most requests sent at once that all succeeded.
    #[serde(default)]
    pub offered: Option<u64>,
    /// Concurrency figures: how the effective concurrency was known
    /// ("server_metrics", "collector", "first_token", "latency_scaling").
    #[serde(default)]
    pub method: Option<String>,
    /// Its tokens are estimates from words: the server counted none the
    /// probe could read (its refusals still bound it where it refused).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estimated: bool,
}

impl Figure {
    /// A figure whose suite did not run: no claim, and why.
    pub fn not_measured(unit: &str, why: impl Into<String>) -> Figure {
        Figure {
            unit: unit.into(),
            bounded_by: "not_measured".into(),
            evidence: vec![why.into()],
            ..Default::default()
        }
    }
}

/// A death of the server during the probe: a collector incident, or the
/// connection refused after the server had answered.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Death {
    /// The suite that was running.
    pub suite: String,
    pub time_ns: i64,
    /// "collector" or "connection_refused".
    pub source: String,
    pub incident: Option<String>,
    /// The incident's kind ("oom", "signal", "agent_lost", ...).
    pub kind: Option<String>,
    /// The memory domain that ran out ("cgroup", "gpu_vram", ...).
    pub domain: Option<String>,
    /// The diagnosis's leading cause.
    pub cause: Option<String>,
    pub summary: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Envelope {
    pub max_context_at_concurrency_1: Figure,
    pub max_concurrency_at_typical_context: Figure,
    pub max_concurrency_at_max_context: Figure,
    /// Set when every prompt shared a prefix of this many tokens
    /// (`--shared-prefix`): the figures are the prefix-cached case.
    #[serde(default)]
    pub shared_prefix_tokens: Option<u64>,
    /// The first death of the server during the probe.
    #[serde(default)]
    pub server_death: Option<Death>,
}

/// What the probe found out about the server before the suites.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ServerFacts {
    /// "completions" or "chat".
    pub api: String,
    /// It streams (so the time to first token is measured).
    pub streaming: bool,
    /// It counts tokens for us (a tokenize endpoint).
    pub tokenizer: bool,
    /// How the probe counted tokens: "tokenize", "usage" (non-streamed
    /// answers), "stream_usage", "echo_logprobs", or "none" (figures in
    /// tokens are estimates from words).
    #[serde(default)]
    pub token_count: String,
    /// The tokenize endpoint's path, when one answered.
    #[serde(default)]
    pub tokenize_path: Option<String>,
    /// It refused the optional request fields (`ignore_eos`, `temperature`)
    /// by name, so the run sent none of them.
    #[serde(default)]
    pub strict_fields: bool,
    /// Where its load is read ("vLLM /metrics", "llama.cpp /slots").
    pub load_source: Option<String>,
    pub runtime: Option<String>,
    /// Its context limit, from `/v1/models` or `/tokenize`.
    pub max_model_len: Option<u64>,
    /// How fast it reads prompts and writes answers, measured after the
    /// smoke: the budgets and timeouts are sized from it.
    #[serde(default)]
    pub pace: Option<crate::pace::Pace>,
}

/// The prompts sent: each distinct (with `--shared-prefix` they share their
/// start and still differ after it). Only the restart suite sends a prompt
/// twice, on purpose: an idempotent request retried with its own key.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PromptStats {
    pub sent: u64,
    pub distinct: u64,
    pub shared_prefix_tokens: Option<u64>,
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
    #[serde(default)]
    pub server: ServerFacts,
    #[serde(default)]
    pub prompts: PromptStats,
    #[serde(default)]
    pub deaths: Vec<Death>,
    pub warnings: Vec<String>,
}

impl ProbeReport {
    pub fn suite(&self, name: &str) -> Option<&SuiteReport> {
        self.suites.iter().find(|s| s.suite == name)
    }
}

fn figure_line(name: &str, f: &Figure) -> String {
    if f.bounded_by == "not_measured" {
        return format!("  {name:<36} not measured");
    }
    let v = f
        .value
        .map_or("none found".to_string(), |v| match f.estimated {
            true => format!("~{v} {} (estimated: not counted by the server)", f.unit),
            false => format!("{v} {}", f.unit),
        });
    let at = match (f.context_tokens, f.concurrency) {
        (Some(c), Some(n)) => format!(" (context {c} tokens, concurrency {n})"),
        (Some(c), None) => format!(" (context {c} tokens)"),
        (None, Some(n)) => format!(" (concurrency {n})"),
        _ => String::new(),
    };
    let offered = match (f.offered, f.value) {
        (Some(o), Some(v)) if o > v => format!(" of {o} sent at once"),
        _ => String::new(),
    };
    format!("  {name:<36} {v}{offered}{at}; bounded by {}", f.bounded_by)
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
    if !r.server.token_count.is_empty() {
        let path = r
            .server
            .tokenize_path
            .as_ref()
            .map(|p| format!(" ({p})"))
            .unwrap_or_default();
        let how = match r.server.token_count.as_str() {
            "none" => " (figures in tokens are estimates from words)",
            _ => "",
        };
        let _ = writeln!(
            out,
            "Tokens counted by: {}{path}{how}; streaming {}",
            r.server.token_count,
            if r.server.streaming { "on" } else { "off" }
        );
    }
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
                .and_then(MemoryAt::shown)
                .map(|m| format!(" {m}"))
                .unwrap_or_default();
            let served = match st.effective_concurrency {
                Some(e) if (e as usize) < st.concurrency => format!(" in service {e}"),
                _ => String::new(),
            };
            let refused = match st.empty {
                0 => st.refused.to_string(),
                n => format!("{} empty {n}", st.refused),
            };
            let _ = writeln!(
                out,
                "        {:<28} ok {}/{} refused {refused} errors {} timeouts {}{} p99 {}{served}{mem}{}",
                st.label,
                st.ok,
                st.calls,
                st.server_errors + st.unreachable,
                st.timeouts,
                match st.not_measured {
                    0 => String::new(),
                    n => format!(" not measured {n}"),
                },
                st.p99_ms.map_or("-".into(), |p| format!("{p:.0} ms")),
                st.failure
                    .as_ref()
                    .map(|f| format!("  <- {f}"))
                    .unwrap_or_default()
            );
        }
    }
    if let Some(e) = &r.envelope {
        match e.shared_prefix_tokens {
            Some(n) => {
                let _ = writeln!(
                    out,
                    "Safe envelope (the cached case: every prompt shared a {n}-token prefix):"
                );
            }
            None => out.push_str("Safe envelope:\n"),
        }
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
    for d in &r.deaths {
        let _ = writeln!(out, "The server died during {}: {}", d.suite, death_line(d));
    }
    for w in &r.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
}

/// One death in words: its domain and cause where known.
pub fn death_line(d: &Death) -> String {
    let mut s = d.summary.clone();
    if let Some(dom) = &d.domain {
        s.push_str(&format!(" (domain {dom}"));
        if let Some(c) = &d.cause {
            s.push_str(&format!(", cause {c}"));
        }
        s.push(')');
    }
    s
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
        "the server died during the probe, or the overload, restart or repeated suite failed",
    ),
    (
        "environment",
        3,
        "the smoke request failed: the server, URL or model, not capacity",
    ),
    (
        "incomplete",
        4,
        "a suite could not finish: an error, or its budget ran out before it did",
    ),
];

/// The exit status for `verdict` (an unknown one counts as unsafe).
pub fn exit_code(verdict: &str) -> i32 {
    VERDICT_EXITS
        .iter()
        .find(|(v, ..)| *v == verdict)
        .map_or(1, |&(_, code, _)| code)
}
