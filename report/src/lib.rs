//! Pure rendering of oomscope evidence for people: no I/O, like the analysis
//! crate. Every function takes the collector's answers (proto types) and
//! returns a string or a value.
//!
//! - the incident report (`html`, `markdown`): one incident, or one agent's
//!   timeline, as a self-contained page: HTML with inline SVG charts and CSS
//!   (no scripts, no fetches), or Markdown;
//! - `comparison`: two runs of one workload side by side;
//! - `format`: the query verbs' text renderings.

pub mod chart;
pub mod comparison;
pub mod domains;
pub mod error_text;
pub mod escape;
pub mod format;
mod html;
mod markdown;
pub mod memory;

pub use oomscope_proto::v1 as pb;

use oomscope_analysis::units::{bytes, bytes_short};
use oomscope_analysis::Domain;

use memory::MemoryTable;

/// One run as the collector knows it: the agent's timeline, the verdict, and
/// the incident it is about (None for a leak hunt on a timeline). The report,
/// `comparison` and the CLI share it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Run {
    pub timeline: pb::TimelineResponse,
    pub diagnosis: pb::Diagnosis,
    pub incident: Option<pb::Incident>,
}

/// Everything both forms show, computed once.
struct View<'a> {
    input: &'a Run,
    hello: pb::Hello,
    /// The failure's facts, as the analysis read them.
    failure: Option<&'a pb::Failure>,
    table: MemoryTable,
    /// The first cause's kind, "" when none.
    cause: String,
    /// "gpu_vram", ..., "" when nothing failed.
    domain: String,
    settings: Vec<(String, String)>,
}

impl<'a> View<'a> {
    fn new(input: &'a Run) -> View<'a> {
        let failure = input.diagnosis.failure.as_ref();
        let hello = input.timeline.hello.clone().unwrap_or_default();
        View {
            table: memory::table(&input.timeline, failure, input.diagnosis.device.as_ref()),
            cause: input
                .diagnosis
                .causes
                .first()
                .map(|c| c.kind.clone())
                .unwrap_or_default(),
            domain: input.diagnosis.domain.clone().unwrap_or_default(),
            settings: crate::comparison::settings(&hello).into_iter().collect(),
            hello,
            failure,
            input,
        }
    }

    fn title(&self) -> String {
        match &self.input.incident {
            Some(i) => format!("oomscope: incident {} ({})", i.id, self.hello.name),
            None => format!("oomscope: agent {}", self.hello.name),
        }
    }

    /// The verdict's headline facts, as (label, value) lines.
    fn verdict_lines(&self) -> Vec<(&'static str, String)> {
        let d = &self.input.diagnosis;
        let mut v = Vec::new();
        v.push((
            "Memory domain",
            match &d.domain {
                Some(dom) => format!("{dom}: {}", Domain::from_wire(dom).title()),
                None => format!("none: {}", oomscope_analysis::no_domain_reason(d)),
            },
        ));
        v.push((
            "Trigger",
            d.trigger.clone().unwrap_or_else(|| "not assessed".into()),
        ));
        v.push((
            "Most likely cause",
            match d.causes.first() {
                Some(c) => format!("{} (confidence {:.2})", c.kind, c.confidence),
                None => "none named".into(),
            },
        ));
        if let Some(f) = self.failure {
            let mut what = format!(
                "{} at {}",
                f.kind,
                oomscope_analysis::units::time(f.time_ns)
            );
            if let Some(p) = &f.phase {
                what.push_str(&format!(", phase {p}"));
            }
            v.push(("Failure", what));
            if let Some(r) = f.requested_bytes {
                v.push(("Requested", bytes(r)));
            }
            if let Some(o) = &f.stats {
                let when = match f.stats_from_ns {
                    Some(t) => format!(
                        " (the last reading, {} before the failure)",
                        gap(f.time_ns - t)
                    ),
                    None => String::new(),
                };
                v.push((
                    "Allocated at failure",
                    format!("{}{when}", bytes(o.allocated_bytes)),
                ));
                v.push((
                    "Reserved at failure",
                    format!("{}{when}", bytes(o.reserved_bytes)),
                ));
            }
            let load: Vec<String> = [
                ("active sequences", f.active_sequences),
                ("active tokens", f.active_tokens),
                ("requests done", f.requests_done),
            ]
            .iter()
            .filter_map(|(n, x)| x.map(|x| format!("{n} {x}")))
            .collect();
            if !load.is_empty() {
                v.push(("Load at failure", load.join(", ")));
            }
        }
        if let Some(line) = crate::format::exit_line(d) {
            v.push(("Exit", line));
        }
        if let Some(c) = &d.cgroup {
            v.push((
                "Cgroup",
                format!(
                    "{} (limit {} set on {})",
                    c.path,
                    bytes_short(c.limit_bytes),
                    c.owner_level
                ),
            ));
        }
        v
    }

    /// The capacity estimate's fields, when the analysis made one.
    fn capacity(&self) -> Vec<(String, String)> {
        let Ok(serde_json::Value::Object(m)) =
            serde_json::from_str::<serde_json::Value>(&self.input.diagnosis.capacity)
        else {
            return Vec::new();
        };
        m.iter()
            .map(|(k, v)| (k.clone(), metric_text(k, v.as_f64(), &v.to_string())))
            .collect()
    }
}

/// A short time gap for people: "0.5 ms", "3.2 s".
fn gap(ns: i64) -> String {
    if ns < 1_000_000_000 {
        format!("{:.1} ms", ns as f64 / 1e6)
    } else {
        format!("{:.1} s", ns as f64 / 1e9)
    }
}

/// A metric for people: byte counts with their unit, other numbers as they are.
fn metric_text(name: &str, v: Option<f64>, raw: &str) -> String {
    match v {
        Some(x)
            if name.ends_with("_bytes")
                || name == "bytes_per_request"
                || name == "bytes_per_token" =>
        {
            if x >= 0.0 && x.fract() == 0.0 && x < u64::MAX as f64 {
                bytes(x as u64)
            } else {
                format!("{x:.0} bytes")
            }
        }
        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{x:.0}"),
        Some(x) => format!("{x:.3}"),
        None => raw.trim_matches('"').to_string(),
    }
}

/// The page as self-contained HTML. Its root element carries `data-domain`
/// and `data-cause` (the first cause's kind; empty when none).
pub fn html(input: &Run) -> String {
    html::render(&View::new(input))
}

/// The same content as Markdown (tables instead of charts).
pub fn markdown(input: &Run) -> String {
    markdown::render(&View::new(input))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_input_renders_without_failure() {
        let input = Run::default();
        let page = html(&input);
        assert!(page.contains(r#"<html lang="en" data-domain="" data-cause="">"#));
        assert!(page.contains("no samples to chart"));
        assert!(page.ends_with("</html>\n"));
        let md = markdown(&input);
        assert!(md.contains("none: nothing failed"));
    }

    /// A server without an allocator that failed with 64 KB of load log on stderr.
    fn host_only_run() -> Run {
        let mut log: Vec<String> = (0..2000)
            .map(|i| format!("llama_model_loader: - tensor {i}: blk.{i}.attn_q.weight q4_K"))
            .collect();
        log.push("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 7734.13 MiB on device 0: cudaMalloc failed: out of memory".into());
        log.push("llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache".into());
        log.push("main: exiting due to model loading error".into());
        let sample = |t: i64| pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                process: Some(pb::ProcessMemory {
                    vm_rss_bytes: 700 << 20,
                    ..Default::default()
                }),
                tree_rss_bytes: 900 << 20,
                tree_pss_bytes: 800 << 20,
                ..Default::default()
            }),
            ..Default::default()
        };
        Run {
            timeline: pb::TimelineResponse {
                samples: vec![sample(1_000), sample(2_000)],
                ..Default::default()
            },
            diagnosis: pb::Diagnosis {
                domain: Some("gpu_vram".into()),
                failure: Some(pb::Failure {
                    time_ns: 3_000,
                    kind: "exit_oom_text".into(),
                    error_text: Some(log.join("\n")),
                    ..Default::default()
                }),
                ..Default::default()
            },
            incident: None,
        }
    }

    #[test]
    fn a_server_without_an_allocator_gets_host_rows_a_short_error_box_and_its_own_legend() {
        let input = host_only_run();
        let page = html(&input);
        assert!(!page.contains(r#"data-row="allocated""#), "no PyTorch rows");
        assert!(!page.contains("= PyTorch reserved"));
        assert!(page.contains(r#"data-row="host_rss""#));
        assert!(page.contains(r#"data-row="tree_pss""#));
        // The error box: the failure's lines up front, the load log folded away.
        let box_start = page.find(r#"<pre class="error">"#).unwrap();
        let box_end = box_start + page[box_start..].find("</pre>").unwrap();
        let shown = &page[box_start..box_end];
        assert!(shown.contains("failed to allocate buffer for kv cache"));
        assert!(shown.contains("cudaMalloc failed: out of memory"));
        assert!(!shown.contains("tensor 5: "), "the load log is folded");
        assert!(shown.len() < 4_000, "{} bytes", shown.len());
        assert!(page.contains(r#"<details class="error-full">"#));
        assert!(
            page[box_end..].contains("tensor 5: "),
            "the whole text is kept, folded"
        );
        // The charts come before the folded text would have pushed them down.
        assert!(page.find("<section id=\"charts\">").unwrap() - box_end < 200_000);
        // The legend: a failure and nothing else (no requests, no load, no limits).
        assert!(page.contains("Red line: the failure."));
        assert!(!page.contains("Grey ticks") && !page.contains("Blue dashes"));
        let md = markdown(&input);
        assert!(!md.contains("PyTorch allocated"));
        assert!(md.contains("process tree PSS"));
        assert!(md.contains("<details>"));
    }

    #[test]
    fn the_reports_exit_row_names_the_kernels_kill_first() {
        let input = Run {
            diagnosis: pb::Diagnosis {
                domain: Some("cgroup".into()),
                exit: Some(pb::ExitStatus {
                    code: Some(0),
                    signal: None,
                }),
                kernel_report: Some(pb::KernelReport {
                    pid: 123,
                    command: "VLLM::Worker".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let md = markdown(&input);
        assert!(
            md.contains("- **Exit**: the kernel killed pid 123 (VLLM::Worker), then the main process exited with code 0"),
            "{md}"
        );
        assert!(html(&input).contains(
            "<dt>Exit</dt><dd>the kernel killed pid 123 (VLLM::Worker), then the main process exited with code 0</dd>"
        ));
    }

    #[test]
    fn analysis_text_is_escaped_in_both_forms() {
        let d = pb::Diagnosis {
            domain: Some("gpu_vram\"><script>".into()),
            causes: vec![pb::Cause {
                kind: "leak<i>".into(),
                evidence: vec!["<img src=x onerror=alert(1)> | pipe".into()],
                ..Default::default()
            }],
            fixes: vec![pb::Fix {
                action: "cap **tokens**".into(),
                risk: "low".into(),
                retest: "`rerun`".into(),
                caveat: None,
            }],
            ..Default::default()
        };
        let input = Run {
            diagnosis: d,
            ..Default::default()
        };
        let page = html(&input);
        assert!(!page.contains("<script>") && !page.contains("<img") && !page.contains("<i>"));
        assert!(page.contains(r#"data-domain="gpu_vram&quot;&gt;&lt;script&gt;""#));
        assert!(page.contains("&lt;img src=x onerror=alert(1)&gt;"));
        let md = markdown(&input);
        assert!(
            md.contains(r"\<img src=x onerror=alert(1)\> \| pipe"),
            "{md}"
        );
        assert!(md.contains(r"cap \*\*tokens\*\*"));
        assert!(md.contains(r"\`rerun\`"));
    }
}
