//! The line of a stderr tail that names the error a process died of: a
//! Python traceback's exception line, else the last line shaped like an
//! error in any runtime's words (`ValueError: ...`, `Error: ...`,
//! `error: ...`, a panic, a C++ `what():`, a log line at ERROR or FATAL).

use crate::units::clip;

/// The longest error line quoted, in characters: enough for a path and a
/// reason, short enough for one line of a report.
pub const MAX_ERROR_LINE_CHARS: usize = 300;

const TRACEBACK: &str = "Traceback (most recent call last):";

/// The error line of `stderr_tail`, trimmed and clipped; None where no line
/// looks like an error.
pub fn error_line(stderr_tail: &str) -> Option<String> {
    traceback_exception(stderr_tail)
        .or_else(|| {
            stderr_tail
                .lines()
                .rev()
                .map(str::trim)
                .find(|l| looks_like_error(l))
        })
        .map(|l| clip(l, MAX_ERROR_LINE_CHARS))
}

/// The last non-empty line of `stderr_tail`, trimmed and clipped.
pub fn last_line(stderr_tail: &str) -> Option<String> {
    stderr_tail
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(|l| clip(l, MAX_ERROR_LINE_CHARS))
}

/// The exception line of the last Python traceback: the first line after
/// its frames at the traceback's own indentation. A log prefix before the
/// header (`(EngineCore pid=7) Traceback ...`) is stripped from the lines
/// that carry it too.
fn traceback_exception(tail: &str) -> Option<&str> {
    let lines: Vec<&str> = tail.lines().collect();
    let header = lines.iter().rposition(|l| l.contains(TRACEBACK))?;
    let prefix = &lines[header][..lines[header].find(TRACEBACK)?];
    lines[header + 1..]
        .iter()
        .map(|l| l.strip_prefix(prefix).unwrap_or(l))
        .find(|l| !l.is_empty() && !l.starts_with(char::is_whitespace))
        .map(str::trim)
        .filter(|l| !l.is_empty())
}

/// A line in the shape of an error: a named exception or error type with
/// its message (`ValueError: ...`, `std::runtime_error`, `HFValidationError:`),
/// a line that starts with error/fatal/panic, a Rust panic, C++'s `what():`,
/// or a log line at level ERROR, FATAL or CRITICAL.
pub fn looks_like_error(line: &str) -> bool {
    let l = line.trim();
    if l.is_empty() {
        return false;
    }
    let lower = l.to_ascii_lowercase();
    let starts = ["error", "fatal", "panic:", "critical", "exception"]
        .iter()
        .any(|p| lower.starts_with(p));
    let typed = l.split_whitespace().any(|w| {
        let name = w.trim_end_matches(':');
        w.ends_with(':')
            && (name.ends_with("Error") || name.ends_with("Exception") || name.ends_with("Exit"))
    });
    let level = l
        .split(|c: char| !c.is_ascii_alphabetic())
        .any(|w| ["ERROR", "FATAL", "CRITICAL"].contains(&w));
    starts
        || typed
        || level
        || lower.contains(" error:")
        || lower.contains("panicked at")
        || l.contains("what():")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceback_gives_its_exception_line_not_a_later_log_line() {
        let tail = "INFO loading\nTraceback (most recent call last):\n  File \"server.py\", line 9, in <module>\n    load(path)\n    ~~~~^^^^^^\nValueError: Model path does not exist: /models/x\nINFO shutting down\n";
        assert_eq!(
            error_line(tail).as_deref(),
            Some("ValueError: Model path does not exist: /models/x")
        );
        // A bare exception name (no message) is still the line.
        let bare = "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    assert x\nAssertionError\n";
        assert_eq!(error_line(bare).as_deref(), Some("AssertionError"));
    }

    #[test]
    fn a_prefixed_traceback_and_chained_ones_give_the_last_exception() {
        let tail = "(EngineCore pid=7) Traceback (most recent call last):\n(EngineCore pid=7)   File \"x.py\", line 2, in f\n(EngineCore pid=7) KeyError: 'a'\n\nDuring handling of the above exception, another exception occurred:\n\n(EngineCore pid=7) Traceback (most recent call last):\n(EngineCore pid=7)   File \"x.py\", line 4, in g\n(EngineCore pid=7) RuntimeError: engine core failed to start\n";
        assert_eq!(
            error_line(tail).as_deref(),
            Some("RuntimeError: engine core failed to start")
        );
    }

    #[test]
    fn other_runtimes_errors_are_found_and_chatter_is_not() {
        for (tail, want) in [
            ("loading model\nerror: failed to open model file 'm.gguf'\n", "error: failed to open model file 'm.gguf'"),
            ("Error: model path does not exist\n", "Error: model path does not exist"),
            ("thread 'main' panicked at src/main.rs:3:5:\nbad config\nnote: run with `RUST_BACKTRACE=1`\n", "thread 'main' panicked at src/main.rs:3:5:"),
            ("terminate called after throwing an instance of 'std::runtime_error'\n  what():  cannot open weights\n", "what():  cannot open weights"),
            ("2026-12-04 10:00:01 ERROR [server] no such device\nbye\n", "2026-12-04 10:00:01 ERROR [server] no such device"),
        ] {
            assert_eq!(error_line(tail).as_deref(), Some(want), "{tail}");
        }
        assert_eq!(error_line("starting\nlistening on 8000\n"), None);
        assert_eq!(error_line(""), None);
        assert_eq!(last_line("starting\nbye\n\n").as_deref(), Some("bye"));
    }

    #[test]
    fn a_long_line_is_clipped() {
        let long = format!("ValueError: {}", "x".repeat(1000));
        let got = error_line(&long).unwrap();
        assert_eq!(got.chars().count(), MAX_ERROR_LINE_CHARS + 3);
        assert!(got.ends_with("..."));
    }
}
