//! The report as one self-contained HTML page: inline CSS and SVG, no
//! scripts, and a Content-Security-Policy that forbids every fetch.

use std::fmt::Write;

use oomscope_analysis::units::{bytes_short, time};

use super::escape::html as esc;
use super::{chart, domains, error_text, metric_text, View};

const STYLE: &str = r#"
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:24px auto;max-width:1180px;color:#1d1d1f;background:#fff;line-height:1.4}
h1{font-size:24px;margin:0 0 4px}h2{font-size:19px;border-bottom:2px solid #e3e6ee;padding-bottom:4px;margin-top:28px}
.sub{color:#555;margin:0}
.banner{border-left:6px solid #d62728;background:#fdf1f1;padding:10px 14px;margin:16px 0;font-size:17px}
.banner.ok{border-color:#2ca02c;background:#f0f8f0}
dl.verdict{display:grid;grid-template-columns:220px 1fr;gap:4px 12px}dl.verdict dt{font-weight:600;color:#444}dl.verdict dd{margin:0}
pre{background:#f6f7f9;border:1px solid #e1e4ea;padding:10px;white-space:pre-wrap;word-break:break-word;font-size:13px}
table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #dde1e8;padding:4px 10px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.unknown{text-align:center;color:#999}
tr.subtotal td,tr.subtotal th{background:#f4f6fa;font-weight:600}
svg.chart{width:100%;height:auto;display:block;margin:10px 0 18px;border:1px solid #eceef3}
.risk{display:inline-block;border-radius:3px;padding:0 6px;font-size:12px;font-weight:700;color:#fff;margin-right:6px}
.risk-low{background:#2ca02c}.risk-medium{background:#e08a00}.risk-high{background:#d62728}
ol.fixes li,ol.causes>li{margin-bottom:12px}.retest,.caveat{color:#444;font-size:14px}.caveat{color:#9a4d00}
#config table,#capacity table{table-layout:fixed;width:100%}#config th,#capacity th{width:300px}#config td,#capacity td,td{overflow-wrap:anywhere}
.note{color:#666;font-size:13px}details.error-full summary{cursor:pointer;color:#555;font-size:13px}footer{margin-top:32px;color:#888;font-size:12px}
"#;

pub(super) fn render(v: &View) -> String {
    let d = &v.input.diagnosis;
    let mut o = String::with_capacity(64 * 1024);
    let _ = write!(
        o,
        r#"<!DOCTYPE html>
<html lang="en" data-domain="{}" data-cause="{}">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{}</title>
<style>{STYLE}</style>
</head>
<body>
"#,
        esc(&v.domain),
        esc(&v.cause),
        esc(&v.title())
    );
    let h = &v.hello;
    let _ = writeln!(o, "<header><h1>{}</h1>", esc(&v.title()));
    let mut sub = format!("agent {} ({})", h.name, h.agent_id);
    if !h.host.is_empty() {
        let _ = write!(sub, " on {}", h.host);
    }
    if h.pid != 0 {
        let _ = write!(sub, ", pid {}", h.pid);
    }
    if !h.runtime.is_empty() {
        let _ = write!(sub, ", runtime {}", h.runtime);
    }
    if h.start_time_ns != 0 {
        let _ = write!(sub, ", started {}", time(h.start_time_ns));
    }
    let _ = writeln!(o, r#"<p class="sub">{}</p></header>"#, esc(&sub));

    // The verdict.
    o.push_str("<section id=\"verdict\"><h2>Verdict</h2>\n");
    let calm = oomscope_analysis::no_domain_reason(d);
    let banner = match (&d.domain, d.causes.first()) {
        (Some(dom), Some(c)) => format!("{dom} ran out: most likely {}", c.kind),
        (Some(dom), None) => format!("{dom} ran out"),
        (None, Some(c)) => format!("{calm}; most likely finding: {}", c.kind),
        (None, None) => format!("{calm} and nothing stands out"),
    };
    // A failure at start-up has no domain, but it is no good news.
    let ok = d.domain.is_none() && calm == "nothing failed";
    let _ = writeln!(
        o,
        r#"<div class="banner{}">{}</div>"#,
        if ok { " ok" } else { "" },
        esc(&banner)
    );
    o.push_str("<dl class=\"verdict\">\n");
    for (k, val) in v.verdict_lines() {
        let _ = writeln!(o, "<dt>{}</dt><dd>{}</dd>", esc(k), esc(&val));
    }
    o.push_str("</dl>\n");
    if let Some(text) = v.failure.and_then(|f| f.error_text.as_ref()) {
        // The lines that carry the failure; the rest (a load log, mostly) folded.
        let e = error_text::excerpt(text);
        let _ = writeln!(
            o,
            "<h3>Error text</h3><pre class=\"error\">{}</pre>",
            esc(&e.text())
        );
        if e.folded > 0 {
            let _ = writeln!(
                o,
                "<details class=\"error-full\"><summary>The whole text ({} lines, {} folded above)</summary><pre>{}</pre></details>",
                e.total_lines,
                e.folded,
                esc(text)
            );
        }
    }
    o.push_str("</section>\n");

    // Charts.
    let charts = domains::charts(&v.input.timeline, v.failure);
    o.push_str("<section id=\"charts\"><h2>Memory over time</h2>\n");
    if charts.is_empty() {
        o.push_str("<p class=\"note\">The timeline has no samples to chart.</p>\n");
    } else {
        let legend = chart::legend(&charts);
        if !legend.is_empty() {
            let _ = writeln!(o, r#"<p class="note">{}</p>"#, esc(&legend.join(" ")));
        }
        for c in &charts {
            o.push_str(&chart::svg(c));
            o.push('\n');
        }
    }
    o.push_str("</section>\n");

    // The memory table.
    o.push_str("<section id=\"memory\"><h2>Memory at three points</h2>\n<table class=\"memory\"><thead><tr><th></th>");
    for p in &v.table.points {
        let when = p.time_ns.map(time).unwrap_or_else(|| "not recorded".into());
        let _ = write!(
            o,
            r#"<th data-moment="{}">{}<br><span class="note">{}</span></th>"#,
            p.moment.key(),
            esc(&p.title),
            esc(&when)
        );
    }
    o.push_str("</tr></thead><tbody>\n");
    for (i, row) in v.table.shown_rows() {
        let subtotal = matches!(row.key, "allocated" | "reserved");
        let _ = write!(
            o,
            r#"<tr data-row="{}"{}><th title="{}">{}</th>"#,
            row.key,
            if subtotal { r#" class="subtotal""# } else { "" },
            esc(row.how),
            esc(row.title)
        );
        for p in &v.table.points {
            match p.values[i] {
                Some(b) => {
                    let _ = write!(
                        o,
                        r#"<td class="num" data-bytes="{b}" title="{b} bytes">{}</td>"#,
                        esc(&bytes_short(b))
                    );
                }
                None => o.push_str(r#"<td class="unknown">—</td>"#), // vocab: a CSS class
            }
        }
        o.push_str("</tr>\n");
    }
    o.push_str("</tbody></table>\n<ul class=\"note\">");
    for (_, row) in v.table.shown_rows() {
        let _ = write!(o, "<li><b>{}</b>: {}</li>", esc(row.title), esc(row.how));
    }
    for n in &v.table.notes {
        let _ = write!(o, "<li>{}</li>", esc(n));
    }
    o.push_str("</ul></section>\n");

    // Causes.
    o.push_str("<section id=\"causes\"><h2>Causes (most likely first)</h2>\n");
    if d.causes.is_empty() {
        o.push_str("<p class=\"note\">The analysis named no cause.</p>\n");
    } else {
        o.push_str("<ol class=\"causes\">\n");
        for c in &d.causes {
            let _ = write!(
                o,
                r#"<li data-kind="{}"><b>{}</b> (confidence {:.2})"#,
                esc(&c.kind),
                esc(&c.kind),
                c.confidence
            );
            if !c.evidence.is_empty() {
                o.push_str("<ul>");
                for e in &c.evidence {
                    let _ = write!(o, "<li>{}</li>", esc(e));
                }
                o.push_str("</ul>");
            }
            if !c.metrics.is_empty() {
                o.push_str("<table class=\"metrics\"><tr><th>metric</th><th>value</th></tr>");
                let mut names: Vec<&String> = c.metrics.keys().collect();
                names.sort();
                for k in names {
                    let x = c.metrics[k];
                    let _ = write!(
                        o,
                        r#"<tr data-metric="{}"><td>{}</td><td class="num" data-value="{x}">{}</td></tr>"#,
                        esc(k),
                        esc(k),
                        esc(&metric_text(k, Some(x), ""))
                    );
                }
                o.push_str("</table>");
            }
            if !c.processes.is_empty() {
                o.push_str("<table class=\"processes\"><tr><th>pid</th><th>device bytes</th><th>user</th><th>command</th></tr>");
                for p in &c.processes {
                    let _ = write!(
                        o,
                        r#"<tr><td>{}</td><td class="num" data-bytes="{}">{}</td><td>{}</td><td>{}</td></tr>"#,
                        p.pid,
                        p.bytes,
                        esc(&bytes_short(p.bytes)),
                        esc(p.user.as_deref().unwrap_or("")),
                        esc(p.command.as_deref().unwrap_or(""))
                    );
                }
                o.push_str("</table>");
            }
            o.push_str("</li>\n");
        }
        o.push_str("</ol>\n");
    }
    o.push_str("</section>\n");

    // Evidence.
    o.push_str("<section id=\"evidence\"><h2>Evidence</h2>\n");
    if d.evidence.is_empty() {
        o.push_str("<p class=\"note\">No evidence lines.</p>\n");
    } else {
        o.push_str("<ul>");
        for e in &d.evidence {
            let _ = write!(o, "<li>{}</li>", esc(e));
        }
        o.push_str("</ul>\n");
    }
    o.push_str("</section>\n");

    // Fixes.
    o.push_str("<section id=\"fixes\"><h2>Fixes (least risky first)</h2>\n");
    if d.fixes.is_empty() {
        o.push_str("<p class=\"note\">The analysis suggested no fix.</p>\n");
    } else {
        o.push_str("<ol class=\"fixes\">\n");
        for f in &d.fixes {
            let risk = match f.risk.as_str() {
                "low" | "medium" | "high" => f.risk.as_str(),
                _ => "medium",
            };
            let _ = write!(
                o,
                r#"<li><span class="risk risk-{risk}">{} risk</span>{}<div class="retest">Retest: {}</div>"#,
                esc(&f.risk),
                esc(&f.action),
                esc(&f.retest)
            );
            if let Some(c) = &f.caveat {
                let _ = write!(o, r#"<div class="caveat">Caveat: {}</div>"#, esc(c));
            }
            o.push_str("</li>\n");
        }
        o.push_str("</ol>\n");
    }
    o.push_str("</section>\n");

    let capacity = v.capacity();
    if !capacity.is_empty() {
        o.push_str("<section id=\"capacity\"><h2>Capacity estimate</h2><table>");
        for (k, val) in capacity {
            let _ = write!(o, "<tr><th>{}</th><td>{}</td></tr>", esc(&k), esc(&val));
        }
        o.push_str("</table></section>\n");
    }

    if !v.settings.is_empty() {
        o.push_str("<section id=\"config\"><h2>Configuration</h2><table>");
        for (k, val) in &v.settings {
            let _ = write!(o, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(val));
        }
        o.push_str("</table></section>\n");
    }
    let _ = writeln!(
        o,
        "<footer>Written by oomscope {}. This page is self-contained: no scripts, no network fetches.</footer>\n</body>\n</html>",
        env!("CARGO_PKG_VERSION")
    );
    o
}
