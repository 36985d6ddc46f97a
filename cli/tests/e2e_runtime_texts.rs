//! Every memory text of the analysis crate's table (vLLM, SGLang, llama.cpp,
//! TGI, and the generic CUDA, Python, C++ and libc texts), printed on stderr
//! by a child of `oomscope run` that then exits 1: the collector records the
//! failed exit as an incident, and `diagnose --json` names the domain and the
//! cause the table gives that text.

mod common;

use std::time::Duration;

use common::*;
use oomscope_analysis::{Domain, RUNTIME_TEXTS};
use serde_json::Value;

/// `oomscope run -- sh -c 'echo "$TEXT" >&2; exit 1'`, the text passed in
/// the environment so that no quoting can change it.
fn fail_with(col: &Collector, name: &str, text: &str) {
    let out = oomscope()
        .args([
            "run",
            "--collector",
            &col.url,
            "--name",
            name,
            "--interval",
            "50ms",
            "--",
            "sh",
            "-c",
            "echo \"$OOMSCOPE_TEST_TEXT\" >&2; exit 1",
        ])
        .env("OOMSCOPE_TEST_TEXT", text)
        .output()
        .expect("oomscope run");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn each_runtime_text_in_a_failed_exit_is_an_incident_with_its_verdict() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    for (i, t) in RUNTIME_TEXTS.iter().enumerate() {
        let name = format!("text-{i}");
        fail_with(&col, &name, t.example);

        let incs = col.incidents_of(&name, 1, Duration::from_secs(10));
        assert_eq!(incs.len(), 1, "{} {:?}: {incs:#?}", t.runtime, t.example);
        assert_eq!(incs[0]["kind"], "exit_oom_text", "{:#?}", incs[0]);

        // A runtime's own memory is the GPU where the agent saw one.
        let tl = timeline(&col.url, &name);
        let gpu_seen = tl.hello.as_ref().is_some_and(|h| !h.gpus.is_empty())
            || tl
                .samples
                .iter()
                .any(|s| s.sample.as_ref().is_some_and(|s| !s.gpus.is_empty()));
        let want = t.memory.domain(gpu_seen).unwrap_or(Domain::Unknown);

        let id = incs[0]["id"].as_str().unwrap();
        let d: Value = col.json(&["diagnose", id]);
        assert_eq!(
            d["domain"],
            want.as_str(),
            "{} {:?}: {d:#}",
            t.runtime,
            t.example
        );
        assert_eq!(d["exit"]["code"], 1);
        assert!(
            d["evidence"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e.as_str().unwrap().contains("stderr: ")),
            "the evidence quotes the text: {d:#}"
        );
        assert!(d["victim"]["pid"].as_u64().unwrap() > 0, "{d:#}");
        if let Some(kind) = t.cause {
            let kinds: Vec<&str> = d["causes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["kind"].as_str().unwrap())
                .collect();
            assert_eq!(kinds.first(), Some(&kind), "{:?}: {d:#}", t.example);
            assert!(
                d["fixes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|f| f["action"] == t.fix),
                "the table's fix: {d:#}"
            );
        }
    }
}
