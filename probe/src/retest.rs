//! `oomscope retest`: the decision table over one-change launches of a
//! server, each replaying the same fixture. Pure: the candidate's command
//! line, each row's outcome against the baseline, the risk of a change, the
//! choice, and the table as text and Markdown. The launches are the cli's.
//!
//! Outcome of a candidate against the baseline (which must have failed):
//! `vanished` (every request of the fixture answered, none preempted where
//! the runtime counts preemptions, and the server lived),
//! `moved` (it failed, bounded by another domain, or the server turned part
//! of the fixture away: a context or admission limit), `shrank` (same domain, but more of
//! the fixture was answered first), `same`, or `failed_start` (the server
//! never became ready) and `not_measured` (the replay did not run to an
//! end). A launch that died in a memory domain while starting or before its
//! replay (a KV cache reserved at start past a limit) is `same` in the
//! baseline's domain and `moved` in another; a baseline that died so
//! reproduced its failure. The chosen fix is the least risky row that vanished with its
//! overload burst handled cleanly and no quality drift over the threshold.

use serde::{Deserialize, Serialize};

use oomscope_analysis::settings::Runtime;
use oomscope_analysis::Domain;
use oomscope_proto::IncidentKind;

use crate::report::{ProbeReport, Status, SuiteReport};

/// The JSON form's schema name.
pub const SCHEMA: &str = "oomscope.retest/v1";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Vanished,
    Moved,
    Shrank,
    Same,
    FailedStart,
    NotMeasured,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Vanished => "vanished",
            Outcome::Moved => "moved",
            Outcome::Shrank => "shrank",
            Outcome::Same => "same",
            // The incident kind of a server that failed while starting.
            Outcome::FailedStart => IncidentKind::FailedStart.as_str(),
            Outcome::NotMeasured => "not_measured",
        }
    }
}

/// One launch's row of the decision table.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Empty for the baseline.
    pub setting: String,
    pub value: String,
    /// None for the baseline, which is what the others are measured against.
    pub outcome: Option<Outcome>,
    /// What bounded the replay where it failed (the collector's domain, else
    /// what the requests showed: server_died, out_of_memory, ...).
    pub domain: Option<String>,
    /// Requests of the fixture answered before it failed (all of them where it completed).
    pub answered: usize,
    pub requests: usize,
    /// The memory the collector read at the replay's last wave, where it did.
    pub peak_memory: Option<String>,
    /// The most requests of the fixture's shape answered in one wave.
    pub capacity: Option<usize>,
    /// Running sequences the runtime preempted during the replay (its
    /// metrics' counter), where it exposes one: a load served so did not
    /// fit the KV pool, and is no `vanished`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemptions: Option<u64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Answered requests a second over the replay.
    pub throughput_rps: Option<f64>,
    /// "clean" (the burst was served or refused with 429/503), "failure:
    /// why", or "not run: why".
    pub overload: String,
    /// The quality check against the baseline's answers, where measured.
    pub quality_drift: Option<crate::quality::Drift>,
    /// Why the quality check did not run, where it did not.
    #[serde(default)]
    pub quality_note: Option<String>,
    /// "low", "medium", "high": what the change costs where it works.
    pub risk: String,
    pub chosen: bool,
    /// Why the row is what it is, where that needs saying (a failed start).
    pub note: Option<String>,
}

/// The domain of a replay served in full with sequences preempted.
pub const PREEMPTED: &str = "kv_preemption";

/// A change at most this risky that altered no numerics needs no accuracy rerun.
pub const RISK_ORDER: [&str; 3] = ["low", "medium", "high"];

/// The risk of changing `setting` (as typed), from what its knob trades:
/// fewer sequences or tokens in flight cost throughput only (low); a
/// shorter context refuses requests users send, and a smaller pool or
/// device share queues more (medium); a KV-cache type or precision changes
/// the numerics (high). An unknown setting is medium. A flag several
/// runtimes spell alike is read as `runtime`'s where it has it.
pub fn risk(setting: &str, runtime: Option<Runtime>) -> &'static str {
    use oomscope_analysis::settings::{Knob, SETTINGS};
    let named = || SETTINGS.iter().filter(|s| s.name == setting);
    let knob = named()
        .find(|s| Some(s.runtime) == runtime)
        .or_else(|| named().next())
        .map(|s| s.knob);
    match knob {
        Some(Knob::MaxSequences | Knob::MaxBatchTokens | Knob::PrefillChunk) => "low",
        Some(Knob::KvCacheDtype) => "high",
        _ if setting.contains("dtype") => "high",
        _ => "medium",
    }
}

/// `command` with `setting` set to `value`: its value replaced where the
/// flag is there (`--f v` or `--f=v`), else the flag appended. A setting
/// that is no flag (an environment variable) leaves the command as it is.
pub fn with_setting(command: &[String], setting: &str, value: &str) -> Vec<String> {
    if !setting.starts_with('-') {
        return command.to_vec();
    }
    let mut out = command.to_vec();
    let eq = format!("{setting}=");
    if let Some(i) = out.iter().position(|w| w.starts_with(&eq)) {
        out[i] = format!("{setting}={value}");
        return out;
    }
    if let Some(i) = out.iter().position(|w| w == setting) {
        match out.get(i + 1) {
            Some(next) if !next.starts_with("--") => out[i + 1] = value.to_string(),
            _ => out.insert(i + 1, value.to_string()),
        }
        return out;
    }
    out.push(setting.to_string());
    out.push(value.to_string());
    out
}

/// The environment variables a flag candidate replaces: the runtime's
/// variables for the same knob, which would otherwise still set it (vLLM's
/// CPU backend sizes its KV cache from `VLLM_CPU_KVCACHE_SPACE` over
/// `--kv-cache-memory-bytes`). The launch with the flag unsets them: the
/// one change is the knob's value, however it was set. None for a variable.
pub fn displaced(setting: &str, runtime: Option<Runtime>) -> Vec<&'static str> {
    use oomscope_analysis::settings::SETTINGS;
    if !setting.starts_with('-') {
        return Vec::new();
    }
    let Some(flag) = SETTINGS
        .iter()
        .find(|s| s.name == setting && (runtime.is_none() || Some(s.runtime) == runtime))
    else {
        return Vec::new();
    };
    SETTINGS
        .iter()
        .filter(|s| s.runtime == flag.runtime && s.knob == flag.knob && !s.name.starts_with('-'))
        .map(|s| s.name)
        .collect()
}

/// The changes a diagnosis proposes, as (setting, value): every
/// `` `SETTING VALUE` `` or `` `SETTING=VALUE` `` in its fixes' actions that
/// names a known setting of the settings map (the form `setting_fixes`
/// writes computed proposals in), each once, in the fixes' order (least
/// risky first). A setting named with no value gets one from the fixture
/// where its knob has a basis there: sequences at once halved from the
/// fixture's concurrency, tokens in flight halved from its first wave's, a
/// context cut to the power of two that still holds its longest request;
/// others (a pool) need the diagnosis's figures and are left out.
pub fn candidates_from_fixes<'a>(
    actions: impl IntoIterator<Item = &'a str>,
    runtime: Option<Runtime>,
    fx: &crate::fixture::Fixture,
) -> Vec<(String, String)> {
    use oomscope_analysis::settings::{Knob, SETTINGS};
    let knob_of = |name: &str| {
        let named = || SETTINGS.iter().filter(move |s| s.name == name);
        named()
            .find(|s| Some(s.runtime) == runtime)
            .or_else(|| named().next())
            .map(|s| s.knob)
    };
    let wave_tokens: u64 = fx
        .requests
        .iter()
        .take(fx.concurrency)
        .map(|q| q.prompt_tokens + q.output_tokens)
        .sum();
    // The shortest context (a power of two) that still holds every request.
    let longest = fx
        .requests
        .iter()
        .map(|q| q.prompt_tokens + q.output_tokens)
        .max()
        .unwrap_or(0);
    let mut out: Vec<(String, String)> = Vec::new();
    for action in actions {
        for (i, span) in action.split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            let (name, value) = match span.split_once('=') {
                Some((n, v)) if !n.contains(' ') => (n, v.to_string()),
                _ => match span.split_once(' ') {
                    Some((n, v)) => (n, v.trim().to_string()),
                    None => (span, String::new()),
                },
            };
            let Some(knob) = knob_of(name) else { continue };
            let value = if !value.is_empty() {
                value
            } else {
                match knob {
                    Knob::MaxSequences if fx.concurrency > 1 => (fx.concurrency / 2).to_string(),
                    Knob::MaxBatchTokens if wave_tokens > 1 => (wave_tokens / 2).to_string(),
                    Knob::MaxContext if longest > 0 => longest.next_power_of_two().to_string(),
                    _ => continue,
                }
            };
            if !value.contains(' ') && !out.iter().any(|(n, _)| n == name) {
                out.push((name.to_string(), value));
            }
        }
    }
    out
}

/// The fixture suite of a probe report.
fn fixture_suite(r: &ProbeReport) -> Option<&SuiteReport> {
    r.suites.iter().find(|s| s.suite == "fixture")
}

/// Whether a report's replay failed: the failure is there.
pub fn reproduced(r: &ProbeReport) -> bool {
    fixture_suite(r).is_some_and(|s| s.status == Status::Fail) || !r.deaths.is_empty()
}

/// A row's measurements from one launch's probe report.
pub fn measured(setting: &str, value: &str, runtime: Option<Runtime>, r: &ProbeReport) -> Row {
    let mut row = Row {
        setting: setting.into(),
        value: value.into(),
        risk: if setting.is_empty() {
            String::new()
        } else {
            risk(setting, runtime).into()
        },
        ..Default::default()
    };
    if let Some(f) = fixture_suite(r) {
        row.requests = f.findings["requests"].as_u64().unwrap_or(0) as usize;
        row.answered = f.steps.iter().map(|s| s.ok).sum();
        row.capacity = f.steps.iter().map(|s| s.ok).max();
        row.p50_ms = f.steps.first().and_then(|s| s.p50_ms);
        row.p99_ms = f.steps.iter().filter_map(|s| s.p99_ms).reduce(f64::max);
        row.throughput_rps = (f.duration_s > 0.0).then(|| row.answered as f64 / f.duration_s);
        row.peak_memory = f
            .steps
            .iter()
            .rev()
            .find_map(|s| s.memory.as_ref().and_then(|m| m.shown()));
        row.preemptions = f.findings["preemptions"].as_f64().map(|p| p as u64);
        if f.status == Status::Fail {
            row.domain = f
                .reason
                .as_deref()
                .map(|r| r.split(':').next().unwrap_or(r).trim().to_string());
        } else if f.status == Status::Pass && row.preemptions.unwrap_or(0) > 0 {
            row.domain = Some(PREEMPTED.into());
        } else if f.status == Status::Pass && row.answered < row.requests {
            // Served without a failure, but not all of it: the server refused the rest.
            let rejected: usize = f.steps.iter().map(|s| s.rejected + s.empty).sum();
            row.domain = Some(
                if rejected > 0 {
                    "max_context_setting"
                } else {
                    "admission_cap"
                }
                .into(),
            );
        }
    }
    if fixture_suite(r).is_none() {
        // Died before the replay: the death's domain, and what the collector said of it.
        if let Some((domain, summary)) = memory_death(&r.deaths) {
            row.domain = Some(domain.to_string());
            row.note = Some(format!("died before the replay: {summary}"));
        }
    }
    row.overload = match r.suites.iter().find(|s| s.suite == "overload") {
        Some(o) if o.status == Status::Pass => "clean".into(),
        Some(o) if o.status == Status::Fail => format!(
            "failure: {}",
            o.reason.clone().unwrap_or_else(|| o.verdict.clone())
        ),
        Some(o) if o.verdict.starts_with("not run") => o.verdict.clone(),
        Some(o) => format!(
            "not run: {}",
            o.reason.clone().unwrap_or_else(|| o.verdict.clone())
        ),
        None => "not run".into(),
    };
    row
}

/// The first death the collector named a memory domain for: (domain, summary).
fn memory_death(deaths: &[crate::report::Death]) -> Option<(&str, &str)> {
    deaths.iter().find_map(|d| {
        d.domain
            .as_deref()
            .filter(|dom| memory_domain(dom))
            .map(|dom| (dom, d.summary.as_str()))
    })
}

/// A launch that died in memory before its replay ran (during the smoke or
/// the quality prompts): the same failure as the baseline's where the
/// domain is the same, a moved one otherwise; None without such a death.
pub fn died_before_replay(baseline: &Row, deaths: &[crate::report::Death]) -> Option<Outcome> {
    let (domain, _) = memory_death(deaths)?;
    Some(if baseline.domain.as_deref() == Some(domain) {
        Outcome::Same
    } else {
        Outcome::Moved
    })
}

/// `row`'s outcome against the baseline's.
pub fn outcome(baseline: &Row, row: &Row, r: &ProbeReport) -> Outcome {
    let Some(f) = fixture_suite(r) else {
        return died_before_replay(baseline, &r.deaths).unwrap_or(Outcome::NotMeasured);
    };
    match f.status {
        // Refused in part: the failure moved to a limit that turns the workload away.
        Status::Pass if r.deaths.is_empty() && row.answered < row.requests => Outcome::Moved,
        // Served, by evicting running sequences: the pool, not a kill, bounded it.
        Status::Pass if r.deaths.is_empty() && row.preemptions.unwrap_or(0) > 0 => Outcome::Moved,
        Status::Pass if r.deaths.is_empty() => Outcome::Vanished,
        Status::Fail => {
            if row.domain != baseline.domain {
                Outcome::Moved
            } else if row.answered > baseline.answered {
                Outcome::Shrank
            } else {
                Outcome::Same
            }
        }
        _ if !r.deaths.is_empty() => Outcome::Same,
        _ => Outcome::NotMeasured,
    }
}

/// A row for a candidate that never became ready.
pub fn failed_start(setting: &str, value: &str, runtime: Option<Runtime>, why: String) -> Row {
    Row {
        setting: setting.into(),
        value: value.into(),
        outcome: Some(Outcome::FailedStart),
        overload: "not run: the server did not start".into(),
        risk: risk(setting, runtime).into(),
        note: Some(why),
        ..Default::default()
    }
}

/// Whether an incident's domain is a memory one: a launch that died while
/// starting with such an incident ran out of memory there (a KV cache
/// reserved at start past a limit), which is a failure a fixture can
/// reproduce; any other failed start is the candidate's own fault.
pub fn memory_domain(domain: &str) -> bool {
    !matches!(
        Domain::from_wire(domain),
        Domain::Unknown | Domain::ExternalKill
    )
}

/// A row for a launch that died before it was ready, in memory `domain`
/// (`why`: its incident), with the fixture's `requests` unserved. For the
/// baseline this is the failure reproduced at start; a candidate's outcome
/// is [`start_outcome`].
pub fn died_at_start(
    setting: &str,
    value: &str,
    runtime: Option<Runtime>,
    requests: usize,
    domain: &str,
    why: String,
) -> Row {
    Row {
        setting: setting.into(),
        value: value.into(),
        domain: Some(domain.into()),
        requests,
        overload: "not run: the server died while starting".into(),
        risk: if setting.is_empty() {
            String::new()
        } else {
            risk(setting, runtime).into()
        },
        note: Some(why),
        ..Default::default()
    }
}

/// A candidate that died while starting, against the baseline: the same
/// memory domain is the same failure; another is a moved one.
pub fn start_outcome(baseline: &Row, row: &Row) -> Outcome {
    if row.domain == baseline.domain {
        Outcome::Same
    } else {
        Outcome::Moved
    }
}

/// Marks the chosen row: the least risky that vanished with overload clean
/// and quality within the threshold; the first such in order among equals.
/// Returns why none qualifies where none does.
pub fn choose(rows: &mut [Row]) -> Result<usize, String> {
    let rank = |r: &Row| RISK_ORDER.iter().position(|x| *x == r.risk).unwrap_or(1);
    let ok = |r: &Row| {
        r.outcome == Some(Outcome::Vanished)
            && r.overload == "clean"
            && r.quality_drift.as_ref().is_none_or(|d| !d.flagged)
    };
    let best = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| ok(r))
        .min_by_key(|(i, r)| (rank(r), *i))
        .map(|(i, _)| i);
    match best {
        Some(i) => {
            rows[i].chosen = true;
            Ok(i)
        }
        None => Err(rows
            .iter()
            .map(|r| {
                let why = match r.outcome {
                    Some(Outcome::Vanished) if r.overload != "clean" => {
                        format!("overload {}", r.overload)
                    }
                    Some(Outcome::Vanished) => {
                        "quality drift over the threshold: rerun the model's accuracy suite".into()
                    }
                    Some(o) => format!("the failure {}", o.name()),
                    None => "baseline".into(),
                };
                format!("{}={}: {why}", r.setting, r.value)
            })
            .collect::<Vec<_>>()
            .join("; ")),
    }
}

/// The whole retest, as `--json` prints it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Retest {
    pub schema: String,
    pub fixture: String,
    pub command: Vec<String>,
    pub memory_limit: Option<String>,
    pub baseline: Row,
    pub rows: Vec<Row>,
    /// The chosen change as `SETTING=VALUE`, where one qualified.
    pub chosen: Option<String>,
    /// Why none was chosen, where none was; or why the run stopped.
    pub why: Option<String>,
    /// The regression test to keep: exits non-zero when the failure comes back.
    pub regression: String,
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".into())
}

/// The table's cells for a row, against the baseline.
fn cells(r: &Row, base: &Row) -> Vec<String> {
    let vs = |v: Option<f64>, b: Option<f64>| match (v, b) {
        (Some(v), Some(b)) if b > 0.0 => format!("{v:.0} ({:+.0}%)", (v / b - 1.0) * 100.0),
        (Some(v), _) => format!("{v:.0}"),
        _ => "-".into(),
    };
    vec![
        if r.setting.is_empty() {
            "(baseline)".into()
        } else {
            format!("{} {}", r.setting, r.value)
        },
        r.outcome.map_or("fails".into(), |o| o.name().to_string()),
        opt(r.domain.clone(), |d| d),
        format!("{}/{}", r.answered, r.requests),
        opt(r.peak_memory.clone(), |m| m),
        opt(r.capacity, |c| c.to_string()),
        vs(r.p50_ms, base.p50_ms),
        vs(r.p99_ms, base.p99_ms),
        opt(r.throughput_rps, |t| format!("{t:.2}")),
        r.overload.clone(),
        opt(r.quality_drift.as_ref(), |d| {
            format!(
                "{:.0}% identical{}{}",
                d.identical_share * 100.0,
                d.mean_abs_logprob_delta
                    .map(|l| format!(", mean dlogprob {l:.1e}"))
                    .unwrap_or_default(),
                if d.flagged { " FLAGGED" } else { "" }
            )
        }),
        r.risk.clone(),
        if r.chosen {
            "yes".into()
        } else {
            String::new()
        },
    ]
}

/// The decision table's columns.
pub const HEADER: [&str; 13] = [
    "change",
    "outcome",
    "domain",
    "answered",
    "peak memory",
    "capacity",
    "p50 ms",
    "p99 ms",
    "req/s",
    "overload",
    "quality drift",
    "risk",
    "chosen",
];

/// The decision table's rows (the baseline first), cell by cell, as the text forms show them.
pub fn table(t: &Retest) -> Vec<Vec<String>> {
    std::iter::once(&t.baseline)
        .chain(&t.rows)
        .map(|r| cells(r, &t.baseline))
        .collect()
}

/// The closing lines: the choice (or why none) and the regression test.
pub fn closing(t: &Retest) -> String {
    summary(t)
}

/// The decision table as Markdown.
pub fn markdown(t: &Retest) -> String {
    let mut s = format!(
        "# oomscope retest\n\nFixture: {}  \nCommand: `{}`\n\n| {} |\n|{}\n",
        t.fixture,
        t.command.join(" "),
        HEADER.join(" | "),
        "---|".repeat(HEADER.len())
    );
    for r in std::iter::once(&t.baseline).chain(&t.rows) {
        s += &format!("| {} |\n", cells(r, &t.baseline).join(" | "));
    }
    s += &summary(t);
    s
}

/// The decision table as text: one block per row.
pub fn text(t: &Retest) -> String {
    let mut s = format!("Retest of {} ({})\n", t.command.join(" "), t.fixture);
    for r in std::iter::once(&t.baseline).chain(&t.rows) {
        let c = cells(r, &t.baseline);
        s += &format!("- {}: {}", c[0], c[1]);
        for (h, v) in HEADER.iter().zip(&c).skip(2) {
            if !v.is_empty() && v != "-" {
                s += &format!(", {h} {v}");
            }
        }
        if let Some(n) = &r.note {
            s += &format!(" ({n})");
        }
        s += "\n";
    }
    s += &summary(t);
    s
}

fn summary(t: &Retest) -> String {
    let mut s = String::new();
    match (&t.chosen, &t.why) {
        (Some(c), _) => s += &format!("\nChosen fix: {c}\n"),
        (None, Some(w)) => s += &format!("\nNo fix chosen: {w}\n"),
        (None, None) => {}
    }
    s += &format!("Regression test: {}\n", t.regression);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn one_setting_changes_one_flag() {
        let cmd = w("python server.py --port 8000 --max-active 8");
        assert_eq!(
            with_setting(&cmd, "--max-active", "3"),
            w("python server.py --port 8000 --max-active 3")
        );
        assert_eq!(
            with_setting(&cmd, "--max-context", "512"),
            w("python server.py --port 8000 --max-active 8 --max-context 512")
        );
        assert_eq!(
            with_setting(&w("vllm serve m --max-num-seqs=64"), "--max-num-seqs", "8"),
            w("vllm serve m --max-num-seqs=8")
        );
        // A switch with no value yet gets one.
        assert_eq!(
            with_setting(&w("s --eager --x"), "--eager", "1"),
            w("s --eager 1 --x")
        );
        // An environment variable is no flag.
        assert_eq!(with_setting(&cmd, "VLLM_CPU_KVCACHE_SPACE", "2"), cmd);
    }

    #[test]
    fn a_diagnosis_proposals_become_candidates() {
        let fx = crate::fixture::Fixture {
            schema: crate::fixture::SCHEMA.into(),
            source: String::new(),
            requests: vec![
                crate::fixture::Request {
                    prompt_tokens: 1000,
                    output_tokens: 16
                };
                8
            ],
            concurrency: 8,
            repeats: 1,
            at_start: None,
        };
        let actions = [
            "Admit fewer requests at once: lower `--max-num-seqs 8` (now 64)",
            "Give the KV cache less: `VLLM_CPU_KVCACHE_SPACE=2` (now 4)",
            "Again `--max-num-seqs 4`, and `--not-a-setting 3`, `--max-model-len` alone",
        ];
        assert_eq!(
            candidates_from_fixes(actions, Some(Runtime::Vllm), &fx),
            vec![
                ("--max-num-seqs".to_string(), "8".to_string()),
                ("VLLM_CPU_KVCACHE_SPACE".to_string(), "2".to_string()),
                // 1000 + 16 tokens, in the next power of two.
                ("--max-model-len".to_string(), "1024".to_string())
            ]
        );
        // Named without a value: from the fixture where the knob has a basis there.
        let named = ["Cap concurrency: `--max-active` (not set), `--max-total-tokens` (not set), `--max-context` (not set)"];
        assert_eq!(
            candidates_from_fixes(named, Some(Runtime::ReferencePytorch), &fx),
            vec![
                ("--max-active".to_string(), "4".to_string()),
                ("--max-total-tokens".to_string(), "4064".to_string()),
                ("--max-context".to_string(), "1024".to_string())
            ]
        );
    }

    #[test]
    fn a_start_that_dies_in_memory_is_the_failure_or_the_same_one() {
        assert!(memory_domain("cgroup") && memory_domain("host_ram"));
        assert!(!memory_domain("") && !memory_domain("unknown") && !memory_domain("external_kill"));
        let vllm = Some(Runtime::Vllm);
        let base = died_at_start("", "", vllm, 8, "cgroup", "killed".into());
        assert_eq!(
            (base.answered, base.requests, base.risk.as_str()),
            (0, 8, "")
        );
        let seqs = died_at_start("--max-num-seqs", "4", vllm, 8, "cgroup", "killed".into());
        assert_eq!(start_outcome(&base, &seqs), Outcome::Same);
        assert_eq!(seqs.risk, "low");
        let host = died_at_start("--max-num-seqs", "4", vllm, 8, "host_ram", "killed".into());
        assert_eq!(start_outcome(&base, &host), Outcome::Moved);
        // Never chosen: it did not vanish.
        let mut rows = vec![seqs];
        rows[0].outcome = Some(Outcome::Same);
        assert!(choose(&mut rows).is_err());
    }

    #[test]
    fn a_memory_death_before_the_replay_is_measured_against_the_baseline() {
        let base = died_at_start("", "", Some(Runtime::Vllm), 8, "cgroup", "killed".into());
        let death = |domain: Option<&str>| crate::report::Death {
            suite: "smoke".into(),
            domain: domain.map(str::to_string),
            summary: "the kernel's OOM killer took pid 7 (VLLM::Worker)".into(),
            ..Default::default()
        };
        assert_eq!(
            died_before_replay(&base, &[death(Some("cgroup"))]),
            Some(Outcome::Same)
        );
        assert_eq!(
            died_before_replay(&base, &[death(Some("host_ram"))]),
            Some(Outcome::Moved)
        );
        // A death with no memory domain (a stop from outside) says nothing: not measured.
        assert_eq!(
            died_before_replay(&base, &[death(Some("external_kill"))]),
            None
        );
        assert_eq!(died_before_replay(&base, &[death(None)]), None);
    }

    #[test]
    fn a_replay_served_by_preempting_sequences_did_not_vanish() {
        let base = died_at_start("", "", Some(Runtime::Vllm), 4, "cgroup", "killed".into());
        let report = |preemptions: serde_json::Value| ProbeReport {
            suites: vec![SuiteReport {
                suite: "fixture".into(),
                status: Status::Pass,
                verdict: String::new(),
                reason: None,
                steps: vec![crate::report::Step {
                    ok: 4,
                    calls: 4,
                    ..Default::default()
                }],
                findings: serde_json::json!({"requests": 4, "preemptions": preemptions}),
                duration_s: 1.0,
                budget_s: None,
            }],
            schema: String::new(),
            endpoint: String::new(),
            model: None,
            agent: None,
            started_ns: 0,
            duration_s: 1.0,
            settings: Default::default(),
            verdict: String::new(),
            envelope: None,
            server: Default::default(),
            prompts: Default::default(),
            deaths: Vec::new(),
            warnings: Vec::new(),
        };
        for (counted, want, domain) in [
            (serde_json::json!(0.0), Outcome::Vanished, None),
            // No counter exposed: the answers alone decide.
            (serde_json::Value::Null, Outcome::Vanished, None),
            (serde_json::json!(3.0), Outcome::Moved, Some(PREEMPTED)),
        ] {
            let r = report(counted);
            let row = measured("VLLM_CPU_KVCACHE_SPACE", "1", Some(Runtime::Vllm), &r);
            assert_eq!((row.answered, row.requests), (4, 4));
            assert_eq!(row.domain.as_deref(), domain);
            assert_eq!(outcome(&base, &row, &r), want, "{row:?}");
        }
    }

    #[test]
    fn a_kv_size_flag_replaces_the_variable_that_would_override_it() {
        let vllm = Some(Runtime::Vllm);
        assert_eq!(
            displaced("--kv-cache-memory-bytes", vllm),
            vec!["VLLM_CPU_KVCACHE_SPACE"]
        );
        assert!(displaced("--max-num-seqs", vllm).is_empty());
        assert!(displaced("VLLM_CPU_KVCACHE_SPACE", vllm).is_empty());
    }

    #[test]
    fn risk_follows_what_the_knob_trades() {
        let reference = Some(Runtime::ReferencePytorch);
        assert_eq!(risk("--max-active", reference), "low");
        assert_eq!(risk("--max-num-seqs", Some(Runtime::Vllm)), "low");
        assert_eq!(risk("--max-total-tokens", reference), "low");
        assert_eq!(risk("--max-context", reference), "medium");
        assert_eq!(risk("--kv-cache-dtype", Some(Runtime::Vllm)), "high");
        assert_eq!(risk("--kv-dtype", reference), "high");
        assert_eq!(risk("--unknown", None), "medium");
    }

    fn row(setting: &str, outcome: Outcome, overload: &str) -> Row {
        Row {
            setting: setting.into(),
            value: "1".into(),
            outcome: Some(outcome),
            overload: overload.into(),
            risk: risk(setting, Some(Runtime::ReferencePytorch)).into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_least_risky_clean_vanish_is_chosen() {
        let mut rows = vec![
            row("--max-context", Outcome::Vanished, "clean"),
            row("--max-active", Outcome::Vanished, "failure: 500"),
            row("--max-total-tokens", Outcome::Vanished, "clean"),
            row("--max-num-seqs", Outcome::Same, "clean"),
        ];
        assert_eq!(choose(&mut rows), Ok(2));
        assert!(rows[2].chosen && !rows[0].chosen);
        // None qualifies: it says why, row by row.
        let mut rows = vec![
            row("--max-active", Outcome::Vanished, "failure: 500"),
            row("--max-context", Outcome::Shrank, "clean"),
        ];
        let why = choose(&mut rows).unwrap_err();
        assert!(
            why.contains("--max-active=1: overload failure: 500"),
            "{why}"
        );
        assert!(why.contains("--max-context=1: the failure shrank"), "{why}");
    }
}
