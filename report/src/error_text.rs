//! The lines of an error text that carry the failure. A server's stderr tail
//! is mostly its load log (64 KB of it, under `oomscope run`): the report
//! shows the memory texts the analysis knows (its one table), the Python
//! tracebacks and the last lines, and folds the rest away, so that the
//! charts stay near the top of the page.

use oomscope_analysis::is_oom_text;

/// The last lines are always shown: the death is at the end.
pub const LAST_LINES: usize = 20;
/// A traceback longer than this shows its first and last lines only.
pub const MAX_TRACEBACK_LINES: usize = 40;
/// At most this many lines are shown in all; the rest are folded.
pub const MAX_SHOWN_LINES: usize = 120;

/// One piece of the excerpt: a run of shown lines, or a count of folded ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    Lines(Vec<&'a str>),
    Folded(usize),
}

/// What the error box shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Excerpt<'a> {
    pub pieces: Vec<Piece<'a>>,
    /// Lines left out of the excerpt (0: the excerpt is the whole text).
    pub folded: usize,
    pub total_lines: usize,
}

impl Excerpt<'_> {
    /// The excerpt as plain text, folded runs as "… N lines …".
    pub fn text(&self) -> String {
        let mut out = Vec::new();
        for p in &self.pieces {
            match p {
                Piece::Lines(ls) => out.extend(ls.iter().map(|l| l.to_string())),
                Piece::Folded(n) => out.push(format!(
                    "… {n} line{} folded …",
                    if *n == 1 { "" } else { "s" }
                )),
            }
        }
        out.join("\n")
    }
}

/// The lines that carry the failure, in their order: every memory text of
/// the table, each Python traceback (bounded), and the last `LAST_LINES`.
pub fn excerpt(text: &str) -> Excerpt<'_> {
    let lines: Vec<&str> = text.lines().collect();
    let n = lines.len();
    let mut keep = vec![false; n];
    for (i, l) in lines.iter().enumerate() {
        if is_oom_text(l) {
            keep[i] = true;
        }
    }
    for (start, end) in tracebacks(&lines) {
        let len = end - start;
        for (k, slot) in keep.iter_mut().enumerate().take(end).skip(start) {
            // A deep stack: its head and its tail (where the error is).
            if len <= MAX_TRACEBACK_LINES
                || k < start + MAX_TRACEBACK_LINES / 4
                || k >= end - MAX_TRACEBACK_LINES * 3 / 4
            {
                *slot = true;
            }
        }
    }
    for slot in keep.iter_mut().skip(n.saturating_sub(LAST_LINES)) {
        *slot = true;
    }
    // Bounded: the lines nearest the end win.
    let mut shown = 0;
    for slot in keep.iter_mut().rev() {
        if *slot {
            shown += 1;
            if shown > MAX_SHOWN_LINES {
                *slot = false;
            }
        }
    }
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < n {
        let j = (i..n).find(|&j| keep[j] != keep[i]).unwrap_or(n);
        pieces.push(if keep[i] {
            Piece::Lines(lines[i..j].to_vec())
        } else {
            Piece::Folded(j - i)
        });
        i = j;
    }
    Excerpt {
        folded: keep.iter().filter(|k| !**k).count(),
        total_lines: n,
        pieces,
    }
}

/// Each Python traceback as (first line, one past its exception line): from
/// "Traceback (most recent call last):" through the indented frames to the
/// first line that is not a frame (the exception). A prefix that a process
/// manager adds to every line ("(Worker pid=9) ERROR ...") is allowed.
fn tracebacks(lines: &[&str]) -> Vec<(usize, usize)> {
    const HEAD: &str = "Traceback (most recent call last):";
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(at) = lines[i].find(HEAD) else {
            i += 1;
            continue;
        };
        let prefix = &lines[i][..at];
        let mut j = i + 1;
        while j < lines.len() {
            let body = lines[j].strip_prefix(prefix).unwrap_or(lines[j]);
            if body.starts_with(' ') || body.starts_with('\t') || body.trim().is_empty() {
                j += 1;
            } else {
                break;
            }
        }
        let end = (j + 1).min(lines.len());
        out.push((i, end));
        i = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_log(n: usize) -> String {
        (0..n)
            .map(|i| format!("INFO loading shard {i}: weights 12.3 MiB"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn a_short_text_is_shown_whole() {
        let e = excerpt("a\nb\nc");
        assert_eq!(e.folded, 0);
        assert_eq!(e.text(), "a\nb\nc");
    }

    #[test]
    fn the_memory_text_the_traceback_and_the_end_survive_a_long_load_log() {
        let text = format!(
            "{}\nWARNING KV cache pool is full. Retract requests. #retracted_reqs: 1\n{}\n\
             Traceback (most recent call last):\n  File \"serve.py\", line 3, in <module>\n    main()\n\
             ValueError: No available memory for the cache blocks.\n{}",
            load_log(500),
            load_log(300),
            load_log(30)
        );
        let e = excerpt(&text);
        let shown = e.text();
        assert!(shown.contains("KV cache pool is full"));
        assert!(shown.contains("Traceback (most recent call last):"));
        assert!(shown.contains("  File \"serve.py\", line 3, in <module>"));
        assert!(shown.contains("ValueError: No available memory for the cache blocks."));
        assert!(shown.contains("INFO loading shard 29:"), "the last line");
        assert!(
            !shown.contains("INFO loading shard 5:"),
            "the load log is folded"
        );
        assert!(shown.contains("lines folded"));
        assert_eq!(e.total_lines, 835);
        assert!(e.folded > 780, "{}", e.folded);
        assert!(shown.lines().count() < 40, "{shown}");
    }

    #[test]
    fn a_prefixed_traceback_is_one_block() {
        let lines = [
            "(Worker pid=9) ERROR Traceback (most recent call last):",
            "(Worker pid=9) ERROR   File \"x.py\", line 1, in f",
            "(Worker pid=9) ERROR ValueError: Available memory on node 0 (0.3/1.81 GiB) is less than requested memory for kv (1.0 GiB).",
            "(EngineCore pid=8) ERROR after",
        ];
        assert_eq!(tracebacks(&lines), vec![(0, 3)]);
    }

    #[test]
    fn the_excerpt_is_bounded() {
        let text = (0..1000)
            .map(|i| format!("CUDA out of memory {i}"))
            .collect::<Vec<_>>()
            .join("\n");
        let e = excerpt(&text);
        assert_eq!(e.total_lines - e.folded, MAX_SHOWN_LINES);
        assert!(e.text().ends_with("CUDA out of memory 999"));
    }
}
