//! `oomscope compare A B`: two runs of the same workload, side by side. What
//! changed in their configuration (a retest should change one variable), and
//! whether the failure vanished, moved, shrank or stayed the same.
//!
//! Pure: two timelines and diagnoses in, a comparison out.

use std::collections::BTreeMap;
use std::fmt::Write;

use oomscope_analysis::settings as runtime_settings;
use oomscope_analysis::units::{bytes, bytes_short};

use crate::memory::{self, MemoryTable, ROWS};
use crate::pb;
use crate::Run;

/// A request or a load that differs by more than this fraction is clearly
/// different; below it, two runs of one workload jitter (batching, timing).
pub const CLEAR_CHANGE: f64 = 0.10;

/// Labels that describe a run's provenance or its outcome, not its
/// configuration: they differ between any two runs and are no variable
/// (where the supervisor placed itself names its own pid).
const NOT_SETTINGS: [&str; 4] = [
    "capture_file",
    "failed_at",
    "self_pid",
    oomscope_analysis::SUPERVISOR_CGROUP_LABEL,
];
/// Label suffix of observations made at the failure (e.g. a capture's
/// `nvml_memory_at_failure`).
const OBSERVATION_SUFFIX: &str = "_at_failure";
/// The raw allocator configuration string: its options are compared one by
/// one, so it only counts as a change when none of them explains it.
const ALLOC_CONF: &str = "PYTORCH_CUDA_ALLOC_CONF";
/// How a switch on the command line (`--enforce-eager`) reads as a setting.
const SWITCH_ON: &str = "on";

/// A command-line flag or a recorded memory variable: where a run lacks it,
/// it was not set (the run's default), rather than not reported.
fn is_command_setting(setting: &str) -> bool {
    setting.starts_with('-') || runtime_settings::MEMORY_ENV.contains(&setting)
}

/// A capture's raw model description (`notes.model`, kept as a label): the
/// `models` setting holds what was read from it, so the label only counts as
/// a change when `models` does not explain it.
const MODEL_LABEL: &str = "label.model";

#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub setting: String,
    /// None: the run did not report this setting.
    pub a: Option<String>,
    pub b: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A failed, B did not.
    Vanished,
    /// Another domain, cause, phase or request size (or a failure where A had none).
    Moved,
    /// The same failure at a clearly smaller request or a clearly higher load.
    Shrank,
    Same,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Vanished => "vanished",
            Outcome::Moved => "moved",
            Outcome::Shrank => "shrank",
            Outcome::Same => "same",
        }
    }
}

/// What one side says, for the comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct SideSummary {
    pub agent_id: String,
    pub name: String,
    /// The incident the run is about.
    pub incident: Option<String>,
    /// Its failure's facts, as the analysis read them.
    pub failure: Option<pb::Failure>,
    pub domain: Option<String>,
    pub trigger: Option<String>,
    /// The first (most likely) cause's kind.
    pub cause: Option<String>,
    pub memory: MemoryTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub changed: Vec<Change>,
    pub one_variable: bool,
    pub warnings: Vec<String>,
    pub outcome: Outcome,
    /// Why the outcome is what it is, in a sentence.
    pub outcome_reason: String,
    pub a: SideSummary,
    pub b: SideSummary,
}

pub fn compare(a: &Run, b: &Run) -> Comparison {
    let ha = a.timeline.hello.clone().unwrap_or_default();
    let hb = b.timeline.hello.clone().unwrap_or_default();
    let changed = changes(&settings(&ha), &settings(&hb));
    let one_variable = changed.len() == 1;
    let mut warnings = Vec::new();
    if changed.len() > 1 {
        let names: Vec<&str> = changed.iter().map(|c| c.setting.as_str()).collect();
        warnings.push(format!(
            "{} settings changed ({}): change one variable at a time, or the outcome cannot be pinned on any one of them",
            changed.len(),
            names.join(", ")
        ));
    } else if changed.is_empty() {
        warnings.push(
            "no configuration difference was recorded: if something was changed, the agents did not report it"
                .into(),
        );
    }
    let sa = summary(a, &ha);
    let sb = summary(b, &hb);
    let (outcome, outcome_reason) = outcome(&sa, &sb);
    Comparison {
        changed,
        one_variable,
        warnings,
        outcome,
        outcome_reason,
        a: sa,
        b: sb,
    }
}

fn summary(side: &Run, hello: &pb::Hello) -> SideSummary {
    let d = &side.diagnosis;
    SideSummary {
        agent_id: hello.agent_id.clone(),
        name: hello.name.clone(),
        incident: side.incident.as_ref().map(|i| i.id.clone()),
        memory: memory::table(&side.timeline, d.failure.as_ref(), d.device.as_ref()),
        failure: d.failure.clone(),
        domain: d.domain.clone(),
        trigger: d.trigger.clone(),
        cause: d.causes.first().map(|c| c.kind.clone()),
    }
}

/// The configuration a Hello reports, as named settings. Allocator options
/// carry PyTorch's own names (`expandable_segments`, `max_split_size_mb`, ...).
/// The command line is read as the runtime's settings: each flag is its own
/// setting by its own name (`--max-num-seqs`; a switch reads `on`), the
/// memory variables `oomscope run` recorded by theirs
/// (`VLLM_CPU_KVCACHE_SPACE`), where the server listens is left out, and
/// `command` is what remains (the program, its subcommand, the model).
pub fn settings(h: &pb::Hello) -> BTreeMap<String, String> {
    let mut s = BTreeMap::new();
    let mut put = |k: String, v: String| {
        s.insert(k, v);
    };
    if !h.runtime.is_empty() {
        put("runtime".into(), h.runtime.clone());
    }
    let command = runtime_settings::of_hello(h);
    if !command.positional.is_empty() {
        put("command".into(), command.positional.join(" "));
    }
    for (k, v) in command.values {
        put(k, if v.is_empty() { SWITCH_ON.into() } else { v });
    }
    if let Some(a) = &h.allocator_settings {
        put(ALLOC_CONF.into(), a.alloc_conf.clone());
        put(
            "expandable_segments".into(),
            a.expandable_segments.to_string(),
        );
        put(
            "max_split_size_mb".into(),
            if a.max_split_size_bytes > 0 && a.max_split_size_bytes < i64::MAX {
                format!("{}", a.max_split_size_bytes >> 20)
            } else {
                "unlimited".into()
            },
        );
        put(
            "garbage_collection_threshold".into(),
            if a.garbage_collection_threshold > 0.0 {
                a.garbage_collection_threshold.to_string()
            } else {
                "off".into()
            },
        );
        if !a.backend.is_empty() {
            put("backend".into(), a.backend.clone());
        }
        for (k, v) in &a.other {
            put(format!("allocator.{k}"), v.clone());
        }
    }
    if !h.models.is_empty() {
        let models: Vec<String> = h
            .models
            .iter()
            .map(|m| {
                let mut parts: Vec<String> = [m.name.clone()]
                    .into_iter()
                    .filter(|n| !n.is_empty())
                    .collect();
                for (what, v) in [
                    ("revision", &m.revision),
                    ("quantization", &m.quantization),
                    ("dtype", &m.dtype),
                ] {
                    if !v.is_empty() {
                        parts.push(format!("{what} {v}"));
                    }
                }
                if m.bytes > 0 {
                    parts.push(bytes_short(m.bytes));
                }
                parts.join(", ")
            })
            .collect();
        put("models".into(), models.join("; "));
    }
    for (k, v) in h.versions.iter().filter(|(k, _)| k.as_str() != "oomscope") {
        put(format!("version.{k}"), v.clone());
    }
    for g in &h.gpus {
        put(
            format!("gpu{}", g.index),
            format!("{} {}", g.name, bytes_short(g.total_bytes))
                .trim()
                .to_string(),
        );
        put(
            format!("gpu{}.cap", g.index),
            if g.cap_bytes > 0 {
                bytes(g.cap_bytes)
            } else {
                "none".into()
            },
        );
    }
    if let Some(c) = h.cgroup.as_ref().filter(|c| !c.version.is_empty()) {
        put("cgroup_limit".into(), limit(c.limit_bytes)); // vocab: a setting's key
    }
    if let Some(r) = &h.rlimits {
        put("rlimit.address_space".into(), limit(r.address_space_bytes));
        put("rlimit.data".into(), limit(r.data_bytes));
        put("rlimit.rss".into(), limit(r.rss_bytes));
        put("rlimit.stack".into(), limit(r.stack_bytes));
    }
    for (k, v) in &h.labels {
        if NOT_SETTINGS.contains(&k.as_str())
            || k.ends_with(OBSERVATION_SUFFIX)
            || k.starts_with(runtime_settings::ENV_LABEL_PREFIX)
        {
            continue;
        }
        put(format!("label.{k}"), v.clone());
    }
    s
}

fn limit(b: u64) -> String {
    if oomscope_analysis::is_finite_limit(b) {
        bytes(b)
    } else {
        "unlimited".into()
    }
}

fn changes(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<Change> {
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let mut out: Vec<Change> = keys
        .into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| Change {
            setting: k.clone(),
            a: a.get(k).cloned(),
            b: b.get(k).cloned(),
        })
        .collect();
    let option_changed = out.iter().any(|c| is_allocator_option(&c.setting));
    if option_changed {
        out.retain(|c| c.setting != ALLOC_CONF);
    }
    if out.iter().any(|c| c.setting == "models") {
        out.retain(|c| c.setting != MODEL_LABEL);
    }
    out
}

fn is_allocator_option(setting: &str) -> bool {
    matches!(
        setting,
        "expandable_segments" | "max_split_size_mb" | "garbage_collection_threshold" | "backend"
    ) || setting.starts_with("allocator.")
}

fn outcome(a: &SideSummary, b: &SideSummary) -> (Outcome, String) {
    let (fa, fb) = match (&a.failure, &b.failure) {
        (None, None) => return (Outcome::Same, "neither run failed".into()),
        (Some(f), None) => {
            return (
                Outcome::Vanished,
                format!(
                    "A failed ({}); B ran without an incident",
                    what(f, a.domain.as_deref())
                ),
            )
        }
        (None, Some(f)) => {
            return (
                Outcome::Moved,
                format!(
                    "A did not fail, B did ({}): the change introduced a failure",
                    what(f, b.domain.as_deref())
                ),
            )
        }
        (Some(fa), Some(fb)) => (fa, fb),
    };
    let differs = |x: &Option<String>, y: &Option<String>| x.is_some() && y.is_some() && x != y;
    if a.domain != b.domain {
        return (
            Outcome::Moved,
            format!(
                "the failure moved to another memory domain: {} → {}",
                a.domain.as_deref().unwrap_or("none"),
                b.domain.as_deref().unwrap_or("none")
            ),
        );
    }
    if fa.kind != fb.kind {
        return (
            Outcome::Moved,
            format!("the failure changed kind: {} → {}", fa.kind, fb.kind),
        );
    }
    if differs(&a.cause, &b.cause) {
        return (
            Outcome::Moved,
            format!(
                "the most likely cause changed: {} → {}",
                a.cause.as_deref().unwrap_or(""),
                b.cause.as_deref().unwrap_or("")
            ),
        );
    }
    if differs(&fa.phase, &fb.phase) {
        return (
            Outcome::Moved,
            format!(
                "the failure moved to another phase: {} → {}",
                fa.phase.as_deref().unwrap_or(""),
                fb.phase.as_deref().unwrap_or("")
            ),
        );
    }
    if let (Some(ra), Some(rb)) = (fa.requested_bytes, fb.requested_bytes) {
        if clearly_below(rb, ra) {
            return (
                Outcome::Shrank,
                format!(
                    "the same failure at a smaller request: {} → {}",
                    bytes(ra),
                    bytes(rb)
                ),
            );
        }
        if clearly_below(ra, rb) {
            return (
                Outcome::Moved,
                format!("the failing request grew: {} → {}", bytes(ra), bytes(rb)),
            );
        }
    }
    let loads = [
        ("active tokens", fa.active_tokens, fb.active_tokens),
        ("active sequences", fa.active_sequences, fb.active_sequences),
        ("requests done", fa.requests_done, fb.requests_done),
    ];
    for (name, la, lb) in loads {
        if let (Some(la), Some(lb)) = (la, lb) {
            if clearly_below(la, lb) {
                return (
                    Outcome::Shrank,
                    format!("the same failure at a higher load: {name} {la} → {lb}"),
                );
            }
            if clearly_below(lb, la) {
                return (
                    Outcome::Moved,
                    format!("the failure came at a lower load: {name} {la} → {lb}"),
                );
            }
        }
    }
    let request = fb
        .requested_bytes
        .map(|r| format!(", request {}", bytes_short(r)))
        .unwrap_or_default();
    (
        Outcome::Same,
        format!(
            "the same failure remains: {}{}{request}",
            what(fb, b.domain.as_deref()),
            b.cause
                .as_deref()
                .map(|c| format!(", cause {c}"))
                .unwrap_or_default()
        ),
    )
}

/// `x` is clearly smaller than `y`.
fn clearly_below(x: u64, y: u64) -> bool {
    (x as f64) < (y as f64) * (1.0 - CLEAR_CHANGE)
}

fn what(f: &pb::Failure, domain: Option<&str>) -> String {
    let mut s = format!("{} in {}", f.kind, domain.unwrap_or("an unknown domain"));
    if let Some(p) = &f.phase {
        let _ = write!(s, " during {p}");
    }
    s
}

/// The comparison as its proto message, whose serde form is `--json`'s.
pub fn to_proto(c: &Comparison) -> pb::Comparison {
    pb::Comparison {
        a: Some(side(&c.a)),
        b: Some(side(&c.b)),
        changed: c
            .changed
            .iter()
            .map(|ch| pb::SettingChange {
                setting: ch.setting.clone(),
                a: ch.a.clone(),
                b: ch.b.clone(),
            })
            .collect(),
        one_variable: c.one_variable,
        warnings: c.warnings.clone(),
        outcome: c.outcome.as_str().to_string(),
        outcome_reason: c.outcome_reason.clone(),
        memory_rows: ROWS.iter().map(|r| r.key.to_string()).collect(),
    }
}

fn side(s: &SideSummary) -> pb::ComparedRun {
    pb::ComparedRun {
        agent_id: s.agent_id.clone(),
        name: s.name.clone(),
        incident: s.incident.clone(),
        failure: s.failure.clone(),
        domain: s.domain.clone(),
        trigger: s.trigger.clone(),
        cause: s.cause.clone(),
        memory: s.memory.points.iter().map(moment).collect(),
    }
}

/// One moment of the memory table; a row without a reading is left out.
fn moment(p: &memory::Point) -> pb::MemoryMoment {
    pb::MemoryMoment {
        moment: p.moment.key().to_string(),
        title: p.title.clone(),
        time_ns: p.time_ns,
        bytes: ROWS
            .iter()
            .zip(p.values)
            .filter_map(|(row, v)| Some((row.key.to_string(), v?)))
            .collect(),
    }
}

/// The comparison for people.
pub fn to_text(c: &Comparison) -> String {
    let mut out = String::new();
    for (label, s) in [("A", &c.a), ("B", &c.b)] {
        let state = match &s.failure {
            Some(f) => {
                let mut t = format!(
                    "incident {}: {}",
                    s.incident.as_deref().unwrap_or_default(),
                    what(f, s.domain.as_deref())
                );
                if let Some(r) = f.requested_bytes {
                    let _ = write!(t, ", requesting {}", bytes_short(r));
                }
                if let Some(cause) = &s.cause {
                    let _ = write!(t, ", cause {cause}");
                }
                t
            }
            None => "no incident".into(),
        };
        let _ = writeln!(out, "{label}: {} ({}): {state}", s.name, s.agent_id);
    }
    let _ = writeln!(
        out,
        "Changed ({} setting{}{}):",
        c.changed.len(),
        if c.changed.len() == 1 { "" } else { "s" },
        if c.one_variable { ", one variable" } else { "" }
    );
    if c.changed.is_empty() {
        out.push_str("  nothing recorded\n");
    }
    for ch in &c.changed {
        let missing = if is_command_setting(&ch.setting) {
            "(not set)"
        } else {
            "(not reported)"
        };
        let _ = writeln!(
            out,
            "  {}: {} -> {}",
            ch.setting,
            ch.a.as_deref().unwrap_or(missing),
            ch.b.as_deref().unwrap_or(missing)
        );
    }
    let _ = writeln!(out, "Outcome: {}: {}", c.outcome.as_str(), c.outcome_reason);
    for w in &c.warnings {
        let _ = writeln!(out, "Warning: {w}");
    }
    out.push_str("Memory:\n");
    let head: Vec<String> = [("A", &c.a), ("B", &c.b)]
        .iter()
        .flat_map(|(l, s)| {
            s.memory
                .points
                .iter()
                .map(move |p| format!("{l} {}", p.title))
        })
        .collect();
    let _ = write!(out, "  {:<28}", "");
    for h in &head {
        let _ = write!(out, " {h:>18}");
    }
    out.push('\n');
    for (i, row) in ROWS.iter().enumerate() {
        if !(c.a.memory.shows(i) || c.b.memory.shows(i)) {
            continue;
        }
        let _ = write!(out, "  {:<28}", row.title);
        for s in [&c.a, &c.b] {
            for p in &s.memory.points {
                let v = p.values[i].map(bytes_short).unwrap_or_else(|| "—".into());
                let _ = write!(out, " {v:>18}");
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::event::Kind;

    use serde_json::{json, Value};
    const MIB: u64 = 1 << 20;

    /// One run: a Hello with `conf`, two samples, and (when `fail`) an OOM
    /// of `request` bytes at `tokens` active tokens in phase `phase`.
    fn run(conf: &str, fail: Option<(u64, u64, &str)>, domain: &str, cause: &str) -> Run {
        let hello = pb::Hello {
            agent_id: format!("agent-{conf}"),
            name: "svc".into(),
            allocator_settings: Some(oomscope_agent_core::torch::alloc_conf_settings(conf)),
            ..Default::default()
        };
        let sample = |t: i64, alloc: u64, tokens: u64, phase: &str| pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                allocator: vec![pb::AllocatorStats {
                    allocated_bytes: alloc,
                    reserved_bytes: alloc + 10 * MIB,
                    ..Default::default()
                }],
                context: Some(pb::RequestContext {
                    phase: phase.into(),
                    active_tokens: tokens,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut timeline = pb::TimelineResponse {
            hello: Some(hello),
            samples: vec![
                sample(1, 0, 0, "idle"),
                sample(2, 100 * MIB, 1000, "decode"),
            ],
            ..Default::default()
        };
        let mut incident = None;
        let mut failure = None;
        if let Some((request, tokens, phase)) = fail {
            timeline.samples.push(sample(3, 200 * MIB, tokens, phase));
            timeline.events.push(pb::TimedEvent {
                seq: 9,
                agent_id: String::new(),
                event: Some(pb::Event {
                    time_ns: 4,
                    kind: Some(Kind::Oom(pb::Oom {
                        requested_bytes: request,
                        ..Default::default()
                    })),
                }),
            });
            incident = Some(pb::Incident {
                id: format!("inc-{conf}"),
                kind: "oom".into(),
                time_ns: 4,
                seq: 9,
                ..Default::default()
            });
            // What the analysis reads from that OOM and the sample before it.
            failure = Some(pb::Failure {
                time_ns: 4,
                kind: "oom".into(),
                requested_bytes: (request > 0).then_some(request),
                phase: (!phase.is_empty()).then(|| phase.to_string()),
                active_tokens: (tokens > 0).then_some(tokens),
                oom_device: Some(0),
                ..Default::default()
            });
        }
        let diagnosis = pb::Diagnosis {
            domain: incident.as_ref().map(|_| domain.to_string()),
            causes: if cause.is_empty() {
                vec![]
            } else {
                vec![pb::Cause {
                    kind: cause.into(),
                    ..Default::default()
                }]
            },
            failure,
            ..Default::default()
        };
        Run {
            timeline,
            diagnosis,
            incident,
        }
    }

    fn changed_names(c: &Comparison) -> Vec<&str> {
        c.changed.iter().map(|c| c.setting.as_str()).collect()
    }

    #[test]
    fn an_alloc_conf_option_is_one_variable_not_two() {
        let a = run("", Some((96 * MIB, 0, "x")), "gpu_vram", "fragmentation");
        let b = run(
            "expandable_segments:True",
            Some((96 * MIB, 0, "x")),
            "gpu_vram",
            "fragmentation",
        );
        let c = compare(&a, &b);
        assert_eq!(changed_names(&c), ["expandable_segments"]);
        assert!(c.one_variable);
        assert_eq!(c.outcome, Outcome::Same);

        // An option oomscope does not parse still shows, as the raw string.
        let b = run(
            "roundup_power2_divisions:4",
            Some((96 * MIB, 0, "x")),
            "gpu_vram",
            "",
        );
        let c = compare(&a, &b);
        assert_eq!(changed_names(&c), ["allocator.roundup_power2_divisions"]);

        let b = run(
            "expandable_segments:True,max_split_size_mb:128",
            Some((96 * MIB, 0, "x")),
            "gpu_vram",
            "",
        );
        let c = compare(&a, &b);
        assert_eq!(c.changed.len(), 2);
        assert!(!c.one_variable);
        assert!(
            c.warnings[0].contains("2 settings changed"),
            "{:?}",
            c.warnings
        );
        let split = c
            .changed
            .iter()
            .find(|c| c.setting == "max_split_size_mb")
            .unwrap();
        assert_eq!(
            (split.a.as_deref(), split.b.as_deref()),
            (Some("unlimited"), Some("128"))
        );
    }

    /// A capture's Hello, as `oomscope replay` builds it from `notes`.
    fn capture_hello(notes: Value) -> pb::Hello {
        let v = json!({
            "scenario": "s",
            "notes": notes,
            "timeline": [{"t_s": 0.0, "step": 0, "context": {"phase": "idle"}, "memory_stats": {}}],
        });
        oomscope_replay::capture::from_json(&v, "test", 0)
            .unwrap()
            .hello
    }

    fn with_hello(mut r: Run, hello: pb::Hello) -> Run {
        r.timeline.hello = Some(hello);
        r
    }

    #[test]
    fn a_captures_model_is_one_variable_not_two() {
        let model = |dtype: &str, layers: u64| {
            with_hello(
                run("", None, "", ""),
                capture_hello(json!({"model": {"dtype": dtype, "layers": layers}})),
            )
        };
        // notes.model is both the Hello's model and its `model` label.
        let c = compare(&model("bfloat16", 8), &model("float16", 8));
        assert_eq!(changed_names(&c), ["models"], "{:?}", c.changed);
        assert!(c.one_variable, "{:?}", c.warnings);
        let models = &c.changed[0];
        assert_eq!(
            (models.a.as_deref(), models.b.as_deref()),
            (Some("dtype bfloat16"), Some("dtype float16"))
        );
        // What the parsed model does not show still counts, once, as the raw notes.
        let c = compare(&model("bfloat16", 8), &model("bfloat16", 16));
        assert_eq!(changed_names(&c), ["label.model"]);
        assert!(c.one_variable);
        // A model where there was none is one change too.
        let none = with_hello(run("", None, "", ""), capture_hello(json!({})));
        let c = compare(&none, &model("bfloat16", 8));
        assert_eq!(changed_names(&c), ["models"], "{:?}", c.changed);
    }

    /// A supervised vLLM: `oomscope run`'s Hello with its command line and
    /// recorded memory variables.
    fn vllm(command: &str, env: &[(&str, &str)]) -> Run {
        let hello = pb::Hello {
            agent_id: "agent-vllm".into(),
            name: "vllm".into(),
            role: "supervisor".into(),
            runtime: "supervisor".into(),
            command: command.split_whitespace().map(str::to_string).collect(),
            labels: env
                .iter()
                .map(|(k, v)| (format!("env.{k}"), v.to_string()))
                .collect(),
            ..Default::default()
        };
        with_hello(run("", None, "", ""), hello)
    }

    #[test]
    fn the_one_flag_that_changed_is_named() {
        let base = "/opt/vllm/bin/vllm serve /models/tiny-llama --load-format dummy --max-num-seqs 64 --port 8000";
        let a = vllm(base, &[("VLLM_CPU_KVCACHE_SPACE", "1")]);
        // Another port and host are no memory variable.
        let b = vllm(
            &base
                .replace("--max-num-seqs 64", "--max-num-seqs 32")
                .replace("--port 8000", "--port 8001 --host 0.0.0.0"),
            &[("VLLM_CPU_KVCACHE_SPACE", "1")],
        );
        let c = compare(&a, &b);
        assert_eq!(changed_names(&c), ["--max-num-seqs"], "{:?}", c.changed);
        assert!(c.one_variable);
        assert_eq!(
            (c.changed[0].a.as_deref(), c.changed[0].b.as_deref()),
            (Some("64"), Some("32"))
        );
        assert!(to_text(&c).contains("  --max-num-seqs: 64 -> 32\n"));

        // The KV space from the environment, by its own name.
        let b = vllm(base, &[("VLLM_CPU_KVCACHE_SPACE", "0.5")]);
        let c = compare(&a, &b);
        assert_eq!(
            changed_names(&c),
            ["VLLM_CPU_KVCACHE_SPACE"],
            "{:?}",
            c.changed
        );

        // A switch added.
        let b = vllm(
            &format!("{base} --enforce-eager"),
            &[("VLLM_CPU_KVCACHE_SPACE", "1")],
        );
        let c = compare(&a, &b);
        assert_eq!(changed_names(&c), ["--enforce-eager"]);
        assert!(to_text(&c).contains("  --enforce-eager: (not set) -> on\n"));

        // Another model is the command that remains.
        let b = vllm(
            &base.replace("/models/tiny-llama", "/models/other"),
            &[("VLLM_CPU_KVCACHE_SPACE", "1")],
        );
        let c = compare(&a, &b);
        assert_eq!(changed_names(&c), ["command"]);
        assert_eq!(
            c.changed[0].b.as_deref(),
            Some("/opt/vllm/bin/vllm serve /models/other")
        );
    }

    #[test]
    fn a_python_module_launch_lists_its_flags_not_the_interpreters() {
        let a = vllm(
            "/venv/bin/python3 -u -m llama_cpp.server --model /m/q4.gguf --n_ctx 32768 --port 8000",
            &[],
        );
        let listed = settings(a.timeline.hello.as_ref().unwrap());
        assert!(
            !listed.contains_key("-m") && !listed.contains_key("-u"),
            "{listed:?}"
        );
        assert_eq!(
            listed.get("command").map(String::as_str),
            Some("/venv/bin/python3 -u -m llama_cpp.server")
        );
        assert_eq!(listed.get("--n_ctx").map(String::as_str), Some("32768"));
        // Another spelling of the same flag is the same setting: only its value counts.
        let b = vllm(
            "/venv/bin/python3 -u -m llama_cpp.server --model /m/q4.gguf --n-ctx=16384 --port 8000",
            &[],
        );
        let c = compare(&a, &b);
        assert_eq!(changed_names(&c), ["--n_ctx"], "{:?}", c.changed);
    }

    #[test]
    fn outcomes_follow_the_failure() {
        let base = run(
            "",
            Some((96 * MIB, 1000, "decode")),
            "gpu_vram",
            "kv_growth",
        );
        let outcome = |b: &Run| compare(&base, b).outcome;
        assert_eq!(outcome(&run("a", None, "", "")), Outcome::Vanished);
        assert_eq!(
            outcome(&run(
                "a",
                Some((96 * MIB, 1040, "decode")),
                "gpu_vram",
                "kv_growth"
            )),
            Outcome::Same,
            "4% more tokens is jitter"
        );
        assert_eq!(
            outcome(&run(
                "a",
                Some((96 * MIB, 4000, "decode")),
                "gpu_vram",
                "kv_growth"
            )),
            Outcome::Shrank,
            "it failed at four times the load"
        );
        assert_eq!(
            outcome(&run(
                "a",
                Some((20 * MIB, 1000, "decode")),
                "gpu_vram",
                "kv_growth"
            )),
            Outcome::Shrank,
            "a smaller request fails"
        );
        assert_eq!(
            outcome(&run(
                "a",
                Some((400 * MIB, 1000, "decode")),
                "gpu_vram",
                "kv_growth"
            )),
            Outcome::Moved,
            "a bigger request fails"
        );
        assert_eq!(
            outcome(&run(
                "a",
                Some((96 * MIB, 1000, "prefill")),
                "gpu_vram",
                "kv_growth"
            )),
            Outcome::Moved
        );
        assert_eq!(
            outcome(&run(
                "a",
                Some((96 * MIB, 1000, "decode")),
                "host_ram",
                "kv_growth"
            )),
            Outcome::Moved
        );
        assert_eq!(
            outcome(&run(
                "a",
                Some((96 * MIB, 1000, "decode")),
                "gpu_vram",
                "fragmentation"
            )),
            Outcome::Moved
        );
        // A cause missing on one side (not assessed) does not count as a move.
        assert_eq!(
            outcome(&run("a", Some((96 * MIB, 1000, "decode")), "gpu_vram", "")),
            Outcome::Same
        );
        let ok = run("", None, "", "");
        assert_eq!(compare(&ok, &base).outcome, Outcome::Moved, "a new failure");
        assert_eq!(compare(&ok, &ok).outcome, Outcome::Same);
    }

    #[test]
    fn the_message_carries_the_sides_and_the_memory_table() {
        let a = run(
            "",
            Some((96 * MIB, 1000, "decode")),
            "gpu_vram",
            "kv_growth",
        );
        let b = run("", None, "", "");
        let m = to_proto(&compare(&a, &b));
        let (ma, mb) = (m.a.unwrap(), m.b.unwrap());
        assert_eq!(m.outcome, "vanished");
        let fa = ma.failure.clone().unwrap();
        assert_eq!(fa.requested_bytes, Some(96 * MIB));
        assert_eq!(fa.active_tokens, Some(1000));
        assert!(mb.failure.is_none());
        // A's failure reading is the sample before the OOM; B's latest is its last sample.
        let at_failure = |r: &pb::ComparedRun| r.memory[2].clone();
        assert_eq!(at_failure(&ma).moment, "at_failure");
        assert_eq!(at_failure(&ma).bytes["allocated"], 200 * MIB);
        assert_eq!(at_failure(&ma).bytes["cached"], 10 * MIB);
        assert_eq!(at_failure(&mb).title, "latest");
        assert_eq!(at_failure(&mb).bytes["allocated"], 100 * MIB);
        assert!(!at_failure(&ma).bytes.contains_key("host_rss"));
        assert_eq!(m.memory_rows.len(), ROWS.len());
        assert!(m.changed.is_empty());
        assert!(!m.one_variable);
    }
}
