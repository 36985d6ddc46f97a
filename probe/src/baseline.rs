//! `oomscope probe --compare BASELINE.json`: what moved between two runs of
//! the same suites, and whether only one setting changed between them (a
//! retest changes one variable at a time).

use serde::Serialize;

use super::report::{Figure, ProbeReport};

#[derive(Debug, Serialize, PartialEq)]
pub struct Changed {
    pub setting: String,
    pub baseline: Option<String>,
    pub current: Option<String>,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct Moved {
    pub figure: String,
    pub baseline: Option<u64>,
    pub current: Option<u64>,
    pub baseline_bound: String,
    pub current_bound: String,
}

#[derive(Debug, Serialize)]
pub struct Comparison {
    pub changed: Vec<Changed>,
    pub one_variable: bool,
    pub figures: Vec<Moved>,
    /// Suites whose status differs: (suite, baseline status, current status).
    pub suites: Vec<(String, String, String)>,
    pub warnings: Vec<String>,
}

fn figures(r: &ProbeReport) -> Vec<(&'static str, Figure)> {
    let e = r.envelope.clone().unwrap_or_default();
    vec![
        (
            "max_context_at_concurrency_1",
            e.max_context_at_concurrency_1,
        ),
        (
            "max_concurrency_at_typical_context",
            e.max_concurrency_at_typical_context,
        ),
        (
            "max_concurrency_at_max_context",
            e.max_concurrency_at_max_context,
        ),
    ]
}

pub fn compare(baseline: &ProbeReport, current: &ProbeReport) -> Comparison {
    let mut keys: Vec<&String> = baseline
        .settings
        .keys()
        .chain(current.settings.keys())
        .collect();
    keys.sort();
    keys.dedup();
    let changed: Vec<Changed> = keys
        .into_iter()
        .filter(|k| baseline.settings.get(*k) != current.settings.get(*k))
        .map(|k| Changed {
            setting: k.clone(),
            baseline: baseline.settings.get(k).cloned(),
            current: current.settings.get(k).cloned(),
        })
        .collect();
    let mut warnings = Vec::new();
    if baseline.schema != current.schema {
        warnings.push(format!(
            "different report schemas: {} vs {}",
            baseline.schema, current.schema
        ));
    }
    if changed.len() > 1 {
        warnings.push(format!(
            "{} settings changed ({}): a retest should change one variable at a time, or you cannot tell which change moved the result",
            changed.len(),
            changed.iter().map(|c| c.setting.as_str()).collect::<Vec<_>>().join(", ")
        ));
    }
    if changed.is_empty() {
        warnings.push(
            "no setting changed between the runs: differences are noise or an unrecorded change"
                .into(),
        );
    }
    if baseline.endpoint != current.endpoint {
        warnings.push(format!(
            "different endpoints: {} vs {}",
            baseline.endpoint, current.endpoint
        ));
    }
    let figures = figures(baseline)
        .into_iter()
        .zip(figures(current))
        .filter(|((_, a), (_, b))| a.value != b.value || a.bounded_by != b.bounded_by)
        .map(|((name, a), (_, b))| Moved {
            figure: name.into(),
            baseline: a.value,
            current: b.value,
            baseline_bound: a.bounded_by,
            current_bound: b.bounded_by,
        })
        .collect();
    let suites = baseline
        .suites
        .iter()
        .filter_map(|a| {
            let b = current.suite(&a.suite)?;
            (a.status != b.status).then(|| {
                (
                    a.suite.clone(),
                    format!("{:?}", a.status).to_lowercase(),
                    format!("{:?}", b.status).to_lowercase(),
                )
            })
        })
        .collect();
    Comparison {
        one_variable: changed.len() == 1,
        changed,
        figures,
        suites,
        warnings,
    }
}

pub fn text(c: &Comparison) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "settings changed: {}{}\n",
        c.changed.len(),
        if c.one_variable {
            " (one variable: a clean retest)"
        } else {
            ""
        }
    ));
    for ch in &c.changed {
        out.push_str(&format!(
            "  {}: {} -> {}\n",
            ch.setting,
            ch.baseline.as_deref().unwrap_or("-"),
            ch.current.as_deref().unwrap_or("-")
        ));
    }
    if c.figures.is_empty() {
        out.push_str("envelope: unchanged\n");
    }
    for f in &c.figures {
        let v = |x: Option<u64>| x.map_or("none".to_string(), |v| v.to_string());
        out.push_str(&format!(
            "  {}: {} ({}) -> {} ({})\n",
            f.figure,
            v(f.baseline),
            f.baseline_bound,
            v(f.current),
            f.current_bound
        ));
    }
    for (s, a, b) in &c.suites {
        out.push_str(&format!("  suite {s}: {a} -> {b}\n"));
    }
    for w in &c.warnings {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Envelope, SCHEMA};

    fn report(settings: &[(&str, &str)], ctx: Option<u64>) -> ProbeReport {
        ProbeReport {
            schema: SCHEMA.into(),
            endpoint: "http://127.0.0.1:1/v1".into(),
            model: None,
            agent: None,
            started_ns: 0,
            duration_s: 0.0,
            settings: settings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            verdict: "ok".into(),
            suites: vec![],
            envelope: Some(Envelope {
                max_context_at_concurrency_1: Figure {
                    value: ctx,
                    unit: "tokens".into(),
                    bounded_by: "gpu_vram".into(),
                    ..Default::default()
                },
                ..Default::default()
            }),
            server: Default::default(),
            prompts: Default::default(),
            deaths: vec![],
            warnings: vec![],
        }
    }

    #[test]
    fn one_changed_setting_is_a_clean_retest_and_the_move_is_reported() {
        let a = report(&[("server.max_active", "4"), ("model", "m")], Some(2048));
        let b = report(&[("server.max_active", "8"), ("model", "m")], Some(4096));
        let c = compare(&a, &b);
        assert!(c.one_variable);
        assert_eq!(
            c.changed,
            vec![Changed {
                setting: "server.max_active".into(),
                baseline: Some("4".into()),
                current: Some("8".into())
            }]
        );
        assert_eq!(c.figures.len(), 1);
        assert_eq!(
            (c.figures[0].baseline, c.figures[0].current),
            (Some(2048), Some(4096))
        );
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn two_changed_settings_warn() {
        let a = report(
            &[("server.max_active", "4"), ("server.kv_dtype", "fp16")],
            Some(2048),
        );
        let b = report(
            &[("server.max_active", "8"), ("server.kv_dtype", "fp8")],
            Some(2048),
        );
        let c = compare(&a, &b);
        assert!(!c.one_variable);
        assert!(
            c.warnings[0].contains("2 settings changed"),
            "{:?}",
            c.warnings
        );
        assert!(c.figures.is_empty());
    }
}
