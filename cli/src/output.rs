//! What the verbs print, and how: agent- and server-supplied text is never
//! written to a terminal raw, and a reader that went away ends a verb
//! quietly. `--json` is always a proto message's serde form
//! (oomscope-proto's `serde` feature), the shape Python's queries give.

use oomscope_report::format;

/// Writes `text` to stdout, its control characters but line breaks shown
/// visibly (`format::terminal_text`: agent-supplied strings never reach the
/// terminal raw, whichever rendering carried them). A reader that went away
/// (`oomscope incidents | head -1`) is no error: it has what it wanted, so
/// the verb ends quietly with status 0 instead of print!'s "Broken pipe" panic.
pub(crate) fn print_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let text = format::terminal_text(text);
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Prints `message`'s serde form for `--json`, else the text rendering.
pub(crate) fn show<T: serde::Serialize + ?Sized>(
    json: bool,
    message: &T,
    as_text: impl FnOnce() -> String,
) -> anyhow::Result<i32> {
    match json {
        true => print_out(&format!("{}\n", serde_json::to_string_pretty(message)?))?,
        false => print_out(&as_text())?,
    }
    Ok(0)
}
