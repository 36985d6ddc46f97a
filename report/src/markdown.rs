//! The report as Markdown: the same verdict, memory table, causes, evidence
//! and fixes as the HTML page; each domain's peak instead of a chart.

use std::fmt::Write;

use oomscope_analysis::units::{bytes, bytes_short, time};

use super::escape::{md, md_code_block};
use super::{domains, error_text, metric_text, View};

pub(super) fn render(v: &View) -> String {
    let d = &v.input.diagnosis;
    let mut o = String::new();
    let _ = writeln!(o, "# {}\n", md(&v.title()));
    let _ = writeln!(
        o,
        "<!-- oomscope: domain={} cause={} -->\n",
        v.domain.replace("--", ""),
        v.cause.replace("--", "")
    );
    let h = &v.hello;
    let _ = writeln!(
        o,
        "Agent {} ({}){}{}\n",
        md(&h.name),
        md(&h.agent_id),
        if h.host.is_empty() {
            String::new()
        } else {
            format!(" on {}", md(&h.host))
        },
        if h.pid == 0 {
            String::new()
        } else {
            format!(", pid {}", h.pid)
        }
    );

    o.push_str("## Verdict\n\n");
    for (k, val) in v.verdict_lines() {
        let _ = writeln!(o, "- **{}**: {}", md(k), md(&val));
    }
    o.push('\n');
    if let Some(text) = v.failure.and_then(|f| f.error_text.as_ref()) {
        // The lines that carry the failure; the whole text folded below them.
        let e = error_text::excerpt(text);
        o.push_str("Error text:\n\n");
        o.push_str(&md_code_block(&e.text()));
        o.push('\n');
        if e.folded > 0 {
            let _ = writeln!(
                o,
                "<details><summary>The whole text ({} lines, {} folded above)</summary>\n",
                e.total_lines, e.folded
            );
            o.push_str(&md_code_block(text));
            o.push_str("\n</details>\n\n");
        }
    }

    let charts = domains::charts(&v.input.timeline, v.failure);
    if !charts.is_empty() {
        o.push_str("## Memory over time (peaks; the HTML form has the charts)\n\n| chart | series | peak |\n|---|---|---:|\n");
        for c in &charts {
            for s in &c.series {
                if let Some(peak) = s.points.iter().map(|p| p.1).max() {
                    let _ = writeln!(
                        o,
                        "| {} | {} | {} |",
                        md(&c.title),
                        md(&s.name),
                        bytes_short(peak)
                    );
                }
            }
        }
        o.push('\n');
    }

    o.push_str("## Memory at three points\n\n| |");
    for p in &v.table.points {
        let when = p.time_ns.map(time).unwrap_or_else(|| "not recorded".into());
        let _ = write!(o, " {} ({}) |", md(&p.title), md(&when));
    }
    o.push_str("\n|---|");
    for _ in &v.table.points {
        o.push_str("---:|");
    }
    o.push('\n');
    for (i, row) in v.table.shown_rows() {
        let _ = write!(o, "| {} |", md(row.title));
        for p in &v.table.points {
            let cell = p.values[i].map(bytes_short).unwrap_or_else(|| "—".into());
            let _ = write!(o, " {cell} |");
        }
        o.push('\n');
    }
    o.push('\n');
    for (_, row) in v.table.shown_rows() {
        let _ = writeln!(o, "- {}: {}", md(row.title), md(row.how));
    }
    for n in &v.table.notes {
        let _ = writeln!(o, "- {}", md(n));
    }
    o.push('\n');

    o.push_str("## Causes (most likely first)\n\n");
    if d.causes.is_empty() {
        o.push_str("The analysis named no cause.\n\n");
    }
    for (i, c) in d.causes.iter().enumerate() {
        let _ = writeln!(
            o,
            "{}. **{}** (confidence {:.2})",
            i + 1,
            md(&c.kind),
            c.confidence
        );
        for e in &c.evidence {
            let _ = writeln!(o, "   - {}", md(e));
        }
        let mut names: Vec<&String> = c.metrics.keys().collect();
        names.sort();
        for k in names {
            let _ = writeln!(
                o,
                "   - metric {}: {}",
                md(k),
                md(&metric_text(k, Some(c.metrics[k]), ""))
            );
        }
        for p in &c.processes {
            let _ = writeln!(
                o,
                "   - pid {} holds {} ({})",
                p.pid,
                bytes(p.bytes),
                md(p.command.as_deref().unwrap_or(""))
            );
        }
    }
    o.push('\n');

    o.push_str("## Evidence\n\n");
    if d.evidence.is_empty() {
        o.push_str("No evidence lines.\n");
    }
    for e in &d.evidence {
        let _ = writeln!(o, "- {}", md(e));
    }
    o.push('\n');

    o.push_str("## Fixes (least risky first)\n\n");
    if d.fixes.is_empty() {
        o.push_str("The analysis suggested no fix.\n");
    }
    for (i, f) in d.fixes.iter().enumerate() {
        let _ = writeln!(o, "{}. [{} risk] {}", i + 1, md(&f.risk), md(&f.action));
        let _ = writeln!(o, "   - retest: {}", md(&f.retest));
        if let Some(c) = &f.caveat {
            let _ = writeln!(o, "   - caveat: {}", md(c));
        }
    }
    o.push('\n');

    let capacity = v.capacity();
    if !capacity.is_empty() {
        o.push_str("## Capacity estimate\n\n");
        for (k, val) in capacity {
            let _ = writeln!(o, "- {}: {}", md(&k), md(&val));
        }
        o.push('\n');
    }
    if !v.settings.is_empty() {
        o.push_str("## Configuration\n\n| setting | value |\n|---|---|\n");
        for (k, val) in &v.settings {
            let _ = writeln!(o, "| {} | {} |", md(k), md(val));
        }
        o.push('\n');
    }
    o
}
