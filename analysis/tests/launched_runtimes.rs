//! A runtime's own text, whichever way the runtime was launched (its binary,
//! `python -m` behind any interpreter, `uv run`), gives a fix in that
//! runtime's own setting, spelled as the command line typed it, with the
//! value computed from the text's figures.

mod common;

use common::*;
use oomscope_analysis::{diagnose, Evidence};

fn argv(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

/// `command` exited 1 with `stderr`, on a quiet host.
fn exited(command: &str, stderr: &str) -> Evidence {
    let levels = vec![v1(
        "/oomtest/child",
        V1_UNLIMITED,
        200 * MIB,
        210 * MIB,
        0,
        0,
    )];
    let before = counters(T0, levels.clone(), system(7, 12 * GIB));
    let after = counters(T0 + 3 * SEC, levels, system(7, 12 * GIB));
    let mut e = supervised(
        exit(Some(1), None, stderr, before, after, None),
        "exit_oom_text",
    );
    e.hello.as_mut().unwrap().command = argv(command);
    e
}

const VLLM_CONTEXT: &str = "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be stored in KV cache (19632). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.\n";

#[test]
fn the_context_fix_names_the_flag_as_typed_for_every_launch() {
    let cases = [
        ("vllm serve m --max-model-len 32768", "--max-model-len"),
        ("python -m vllm.entrypoints.openai.api_server --model m --max_model_len 32768", "--max_model_len"),
        ("/venv/bin/python3.11 -X dev -m vllm.entrypoints.openai.api_server --model m --max-model-len=32768", "--max-model-len"),
        ("uv run --with vllm vllm serve m --max_model_len=32768", "--max_model_len"),
    ];
    for (command, typed) in cases {
        let d = diagnose(&exited(command, VLLM_CONTEXT));
        let c = cause(&d, "context_over_kv");
        // The KV cache holds the text's 19632 tokens: that is the context proposed.
        let tokens = metric(c, "proposed_max_context");
        assert_eq!(tokens, 19632.0, "{command}");
        let want = format!(
            "Lower the context to what the KV cache holds: `{typed} {}` (now 32768), the tokens vLLM measured for its pool",
            tokens as u64
        );
        assert!(
            d.fixes.iter().any(|f| f.action == want),
            "{command}: {:#?}",
            d.fixes
        );
        assert!(
            d.fixes.iter().all(|f| !f.action.contains("`-m")),
            "{command}"
        );
    }
}
