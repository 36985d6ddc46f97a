//! The probe reads other servers' answers right, against the real Python
//! reference server (CPU torch) in the test modes that show what vLLM does
//! not: a prompt over the context answered 200 with an event stream that
//! carries no event, a tokenizer of 5 tokens a word, and no tokenize
//! endpoint or usage in streams. In each, the long-context figure is within
//! 5 % of the server's true limit and the report says how tokens were counted.

mod common;

use std::process::{Child, Command, Stdio};

use common::*;
use serde_json::Value;

/// The reference server (no agent: only its answers matter here), until dropped.
struct Server(Child);

impl Server {
    fn start(port: u16, flags: &str) -> Server {
        let mut c = Command::new(python());
        isolate(&mut c)
            .arg(repo().join("runtimes/pytorch-server/server.py"))
            .args(
                format!("--port {port} --no-agent --restore-seconds 0 {flags}").split_whitespace(),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let srv = Server(c.spawn().unwrap());
        await_health(port);
        srv
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The server this test started, and only it.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// The long-context suite up to 4096 tokens, seeded so a failure repeats.
fn long_context(port: u16, extra: &[&str]) -> Value {
    let ep = format!("http://127.0.0.1:{port}/v1");
    let mut args = vec![
        "--seed",
        "13",
        "--endpoint",
        &ep,
        "--suite",
        "long-context",
        "--max-context",
        "4096",
    ];
    args.extend_from_slice(extra);
    let (code, r) = probe(&args);
    assert_eq!(code, 0, "{r:#}");
    r
}

/// The figure is within 5 % of `max_context` (prompt + 16 output tokens), never over it.
fn assert_within_5_percent(r: &Value, max_context: f64) -> f64 {
    let fig = &r["envelope"]["max_context_at_concurrency_1"];
    let v = fig["value"].as_f64().unwrap_or_else(|| panic!("{fig:#}"));
    assert!(v <= max_context - 16.0, "over the true bound: {fig:#}");
    assert!(
        (v - max_context).abs() <= 0.05 * max_context,
        "within 5 % of {max_context} tokens: {fig:#}"
    );
    assert_eq!(fig["bounded_by"], "max_context_setting", "{fig:#}");
    assert!(
        fig.get("estimated").is_none(),
        "counted, not estimated: {fig:#}"
    );
    v
}

#[test]
fn an_over_context_prompt_answered_200_with_an_empty_stream_is_a_refusal_at_that_size() {
    let _serial = serial();
    let port = free_port();
    let _srv = Server::start(
        port,
        "--max-context 2000 --tokens-per-word 5 --empty-stream-over-context",
    );
    let r = long_context(port, &[]);
    assert_within_5_percent(&r, 2000.0);
    // Counted by the server's tokenizer, streamed (its streams carry usage).
    assert_eq!(r["server"]["token_count"], "tokenize", "{:#}", r["server"]);
    assert_eq!(r["server"]["tokenize_path"], "/tokenize");
    assert_eq!(r["server"]["strict_fields"], false);
    assert_eq!(r["server"]["streaming"], true);
    // The rungs over the limit were empty answers, none counted as ok.
    let steps = suite(&r, "long-context")["steps"].as_array().unwrap();
    let empty: Vec<&Value> = steps
        .iter()
        .filter(|s| s["empty"].as_u64() > Some(0))
        .collect();
    assert!(!empty.is_empty(), "{steps:#?}");
    for s in &empty {
        assert_eq!(s["ok"], 0, "{s:#}");
        // Only over the limit (a prompt is sized in words of 5 tokens each).
        assert!(
            s["context_tokens"].as_u64().unwrap() + 5 > 2000 - 16,
            "{s:#}"
        );
        assert!(
            s["failure"]
                .as_str()
                .unwrap()
                .contains("no generated token"),
            "{s:#}"
        );
    }
    for s in steps.iter().filter(|s| s["ok"] == 1) {
        assert!(s["prompt_tokens"].as_u64().unwrap() <= 2000 - 16, "{s:#}");
    }
}

#[test]
fn five_tokens_a_word_without_a_tokenizer_or_usage_in_streams_are_counted_from_answers() {
    let _serial = serial();
    let port = free_port();
    let _srv = Server::start(
        port,
        "--streams --max-context 2000 --tokens-per-word 5 --no-tokenize",
    );
    let r = long_context(port, &[]);
    let v = assert_within_5_percent(&r, 2000.0);
    // /tokenize answered 404: the non-streamed answers' usage counted, so
    // the run did not stream (its streams carry no usage).
    assert_eq!(r["server"]["token_count"], "usage", "{:#}", r["server"]);
    assert_eq!(r["server"]["tokenize_path"], Value::Null);
    assert_eq!(r["server"]["streaming"], false);
    // The prompts were sized in tokens: about a fifth as many words.
    let steps = suite(&r, "long-context")["steps"].as_array().unwrap();
    let first = &steps[0];
    assert_eq!(first["context_tokens"], 64, "{first:#}");
    let words = first["prompt_words"].as_f64().unwrap();
    assert!((words - 64.0 / 5.0).abs() <= 2.0, "{first:#}");
    // The text report says how.
    let text = {
        let ep = format!("http://127.0.0.1:{port}/v1");
        let out = oomscope()
            .args([
                "probe",
                "--seed",
                "14",
                "--endpoint",
                &ep,
                "--suite",
                "smoke",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        text.contains("Tokens counted by: usage; streaming off"),
        "{text}"
    );
    // Streaming forced on: the counts come from the calibration, and the figure holds.
    let r = long_context(port, &["--stream", "on"]);
    assert_eq!(r["server"]["streaming"], true, "{:#}", r["server"]);
    assert_eq!(r["server"]["token_count"], "usage");
    let forced = assert_within_5_percent(&r, 2000.0);
    // Its streams carried no count: the largest size was counted again, unstreamed.
    let fig = &r["envelope"]["max_context_at_concurrency_1"];
    assert!(
        fig["evidence"].as_array().unwrap().iter().any(|e| e
            .as_str()
            .unwrap()
            .starts_with("re-checked at the largest size")),
        "{fig:#}"
    );
    assert!((forced - v).abs() <= 0.05 * 2000.0, "{forced} vs {v}");
}

#[test]
fn a_server_that_counts_no_tokens_gets_figures_labelled_estimated() {
    let _serial = serial();
    let port = free_port();
    let _srv = Server::start(
        port,
        "--streams --max-context 2000 --no-tokenize --no-usage",
    );
    let r = long_context(port, &[]);
    assert_eq!(r["server"]["token_count"], "none", "{:#}", r["server"]);
    // Bisected from the server's own refusals, in words at 1 token a word
    // (which this server's tokenizer happens to make), and labelled so.
    let fig = &r["envelope"]["max_context_at_concurrency_1"];
    assert_eq!(fig["estimated"], true, "{fig:#}");
    assert_eq!(fig["bounded_by"], "max_context_setting", "{fig:#}");
    let v = fig["value"].as_f64().unwrap();
    assert!((v - 2000.0).abs() <= 0.05 * 2000.0, "{fig:#}");
    assert!(
        fig["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().contains("tokens estimated from words")),
        "{fig:#}"
    );
    // No refusal up to the probe's ceiling: not claimed as its limit.
    let ep = format!("http://127.0.0.1:{port}/v1");
    let (code, r) = probe(&[
        "--seed",
        "15",
        "--endpoint",
        &ep,
        "--suite",
        "long-context",
        "--max-context",
        "512",
    ]);
    assert_eq!(code, 0, "{r:#}");
    let fig = &r["envelope"]["max_context_at_concurrency_1"];
    assert_eq!(
        (fig["bounded_by"].as_str(), fig["estimated"].as_bool()),
        (Some("estimated"), Some(true)),
        "{fig:#}"
    );
}

/// Five tokens a word and no count anywhere but in its refusals, which
/// state the prompt's length as llama-cpp-python's do: the rate is fitted to
/// those, so the figure is in the server's tokens (at an assumed 1 token a
/// word it would be a fifth of them), still labelled estimated.
#[test]
fn a_server_whose_refusals_state_the_count_gets_its_rate_from_them() {
    let _serial = serial();
    let port = free_port();
    let _srv = Server::start(
        port,
        "--streams --max-context 2000 --no-tokenize --no-usage --tokens-per-word 5 --refusal-counts",
    );
    let r = long_context(port, &[]);
    assert_eq!(r["server"]["token_count"], "none", "{:#}", r["server"]);
    let fig = &r["envelope"]["max_context_at_concurrency_1"];
    assert_eq!(fig["estimated"], true, "{fig:#}");
    assert_eq!(fig["bounded_by"], "max_context_setting", "{fig:#}");
    let v = fig["value"].as_f64().unwrap_or_else(|| panic!("{fig:#}"));
    assert!((v - 2000.0).abs() <= 0.05 * 2000.0, "{fig:#}");
    let rate = fig["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.as_str())
        .find(|e| e.contains("prompts it refused for their length"))
        .unwrap_or_else(|| panic!("{fig:#}"));
    assert!(rate.contains("5.0"), "{rate}: {v}");
}

#[test]
fn a_strict_fastapi_server_without_done_is_probed_like_any_other() {
    let _serial = serial();
    let port = free_port();
    // As transformers serve answers: unknown fields refused (422 naming
    // ignore_eos), {"detail": ...} errors, streams without [DONE].
    let _srv = Server::start(
        port,
        "--streams --fastapi-shapes --max-context 2000 --tokens-per-word 3",
    );
    let r = long_context(port, &[]);
    assert_within_5_percent(&r, 2000.0);
    assert_eq!(r["server"]["token_count"], "tokenize", "{:#}", r["server"]);
    assert_eq!(r["server"]["streaming"], true);
    // ignore_eos was refused by name, so the run dropped the optional fields.
    assert_eq!(r["server"]["strict_fields"], true);
    // The refusal's text came from FastAPI's detail.
    let fig = &r["envelope"]["max_context_at_concurrency_1"];
    assert!(
        fig["evidence"][0]
            .as_str()
            .unwrap()
            .contains("> --max-context 2000"),
        "{fig:#}"
    );
    // Every rung under the limit was answered, streamed to its finish reason.
    let steps = suite(&r, "long-context")["steps"].as_array().unwrap();
    for s in steps.iter().filter(|s| s["ok"] == 1) {
        assert!(s["first_token_p50_ms"].as_f64().is_some(), "{s:#}");
    }
    assert_eq!(suite(&r, "smoke")["status"], "pass");
}
