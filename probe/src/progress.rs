//! Progress on stderr while the probe runs: a line when a suite starts and
//! one per rung (its result, latency and memory), so a long run is never
//! silent. A spinner (indicatif) on a terminal, plain lines otherwise,
//! nothing with `--quiet`. The lines are built by pure functions.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use crate::report::{MemoryAt, Step};

/// Where progress goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Nothing (`--quiet`, and library use).
    Quiet,
    /// One line per event on stderr (not a terminal: CI logs, pipes).
    Plain,
    /// A spinner naming the rung in flight, finished rungs printed above it.
    Terminal,
}

pub struct Progress {
    mode: Mode,
    bar: Option<ProgressBar>,
}

/// A suite's first line.
pub fn suite_line(suite: &str, what: &str, budget: Duration) -> String {
    format!("{suite}: {what} (budget {:.0} s)", budget.as_secs_f64())
}

/// A finished rung's line: what was sent, how it went, latency, the
/// effective concurrency where it was below what was sent, and memory in the
/// domain that bounds the server.
pub fn rung_line(suite: &str, st: &Step) -> String {
    let failed = st.calls - st.ok - st.not_measured;
    let result = if failed == 0 {
        format!("ok {}/{}", st.ok, st.calls)
    } else {
        format!(
            "FAILED {failed}/{} ({})",
            st.calls,
            st.failure
                .as_deref()
                .unwrap_or("no answer")
                .chars()
                .take(120)
                .collect::<String>()
        )
    };
    let p99 = st
        .p99_ms
        .map_or("p99 -".to_string(), |p| format!("p99 {p:.0} ms"));
    let served = match st.effective_concurrency {
        Some(e) if (e as usize) < st.concurrency => format!(", {e} in service"),
        _ => String::new(),
    };
    let mem = st
        .memory
        .as_ref()
        .and_then(MemoryAt::shown)
        .map(|m| format!(", {m}"))
        .unwrap_or_default();
    let cut = match st.not_measured {
        0 => String::new(),
        n => format!(", {n} cut by the probe's time (not measured)"),
    };
    format!("{suite}: {}: {result}{cut}, {p99}{served}{mem}", st.label)
}

impl Progress {
    pub fn new(mode: Mode) -> Progress {
        let bar = (mode == Mode::Terminal).then(|| {
            let b = ProgressBar::new_spinner();
            b.set_style(
                ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        Progress { mode, bar }
    }

    pub fn quiet() -> Progress {
        Progress::new(Mode::Quiet)
    }

    /// A finished event: printed (above the spinner on a terminal).
    pub fn line(&self, line: &str) {
        match (self.mode, &self.bar) {
            (Mode::Quiet, _) => {}
            (Mode::Terminal, Some(b)) => b.println(line),
            _ => eprintln!("{line}"),
        }
    }

    /// What is in flight now (the spinner's text; nothing in plain mode).
    pub fn doing(&self, what: &str) {
        if let Some(b) = &self.bar {
            b.set_message(what.to_string());
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rung_line_says_result_latency_service_and_memory() {
        let st = Step {
            label: "8 x 256 tokens".into(),
            concurrency: 8,
            calls: 8,
            ok: 8,
            p99_ms: Some(1234.4),
            effective_concurrency: Some(1),
            memory: Some(MemoryAt {
                cgroup_usage_bytes: Some(400 << 20),
                cgroup_limit_bytes: Some(512 << 20),
                rss_bytes: Some(700 << 20),
                ..Default::default()
            }),
            ..Default::default()
        };
        let l = rung_line("concurrency", &st);
        assert!(
            l.starts_with(
                "concurrency: 8 x 256 tokens: ok 8/8, p99 1234 ms, 1 in service, cgroup "
            ),
            "{l}"
        );
        let failed = Step {
            label: "prompt 4096 tokens".into(),
            concurrency: 1,
            calls: 1,
            ok: 0,
            failure: Some("HTTP 400: context too long".into()),
            ..Default::default()
        };
        assert!(
            rung_line("long-context", &failed).contains("FAILED 1/1 (HTTP 400: context too long)")
        );
        // A request the probe's budget cut is no failure.
        let cut = Step {
            label: "prompt 4096 tokens".into(),
            concurrency: 1,
            calls: 1,
            not_measured: 1,
            ..Default::default()
        };
        let l = rung_line("long-context", &cut);
        assert!(
            l.contains("ok 0/1, 1 cut by the probe's time (not measured)") && !l.contains("FAILED"),
            "{l}"
        );
    }
}
