//! Escaping text for HTML (text and attribute values) and Markdown.

/// Text safe inside HTML element content and double- or single-quoted
/// attribute values.
pub fn html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Control characters other than tab and newline have no place in a page.
            c if c.is_control() && c != '\n' && c != '\t' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// Text safe inside a Markdown paragraph, list item or table cell: markup
/// characters are backslash-escaped, and a newline becomes a space (a table
/// row is one line).
pub fn md(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    for (i, &c) in chars.iter().enumerate() {
        // An underscore inside a word (gpu_vram) never starts emphasis in
        // CommonMark: leave it readable.
        let inside_word = |j: Option<usize>| {
            j.and_then(|j| chars.get(j))
                .is_some_and(|n| n.is_alphanumeric())
        };
        if c == '_' && inside_word(i.checked_sub(1)) && inside_word(Some(i + 1)) {
            out.push(c);
            continue;
        }
        match c {
            '\\' | '`' | '*' | '_' | '[' | ']' | '<' | '>' | '|' | '#' | '!' | '~' => {
                out.push('\\');
                out.push(c);
            }
            '&' => out.push_str("&amp;"),
            '\n' | '\r' => out.push(' '),
            c if c.is_control() => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// `text` as a fenced code block whose fence is longer than any run of
/// backticks inside it, so the text cannot close it early.
pub fn md_code_block(text: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in text.chars() {
        if c == '`' {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    let fence = "`".repeat((longest + 1).max(3));
    format!("{fence}text\n{}\n{fence}\n", text.trim_end_matches('\n'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_escapes_markup_and_quotes() {
        assert_eq!(
            html(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(html("a\u{7}b"), "a\u{FFFD}b");
    }

    #[test]
    fn markdown_escapes_table_breakers() {
        assert_eq!(md("a|b\nc *d*"), r"a\|b c \*d\*");
        assert_eq!(md("<img src=x>"), r"\<img src=x\>");
        assert_eq!(md("gpu_vram _em_"), r"gpu_vram \_em\_");
    }

    #[test]
    fn code_block_fence_outlasts_backticks() {
        let b = md_code_block("x ``` y");
        assert!(b.starts_with("````text\n"), "{b}");
        assert!(b.ends_with("\n````\n"));
    }
}
