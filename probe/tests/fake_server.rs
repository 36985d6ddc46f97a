//! The probe against a small OpenAI-compatible server of the test's own
//! (tests/support/fake.rs): what it sends (distinct prompts, the API key,
//! over TLS, the chat API when completions are not offered), how it counts
//! tokens (the server's tokenizer, not words), and how it reads the
//! server's concurrency (its metrics, its first tokens).

#[path = "support/fake.rs"]
mod fake;

use std::collections::HashSet;
use std::time::Duration;

use fake::{Fake, Spec};
use oomscope_probe::report::ProbeReport;
use oomscope_probe::{ApiChoice, Probe, ProbeConfig};

fn config(fake: &Fake, suites: &[&str]) -> ProbeConfig {
    let mut c = ProbeConfig::new(&fake.endpoint());
    c.suites = suites.iter().map(|s| s.to_string()).collect();
    c.seed = Some(42);
    c.min_context = 16;
    c.max_context = 256;
    c.typical_context = 32;
    c.overload_context = 32;
    c.output_tokens = 4;
    c.max_concurrency = 8;
    c.repeat = 10;
    c.burst = Some(16);
    c.request_timeout = Duration::from_secs(10);
    c.settle = Duration::from_millis(50);
    c.metrics_poll = Duration::from_millis(10);
    c
}

fn run(c: ProbeConfig) -> ProbeReport {
    Probe::new(c, None).unwrap().run()
}

fn figure(r: &ProbeReport, name: &str) -> serde_json::Value {
    serde_json::to_value(r.envelope.as_ref().expect("an envelope")).unwrap()[name].clone()
}

#[test]
fn every_prompt_is_distinct_unless_a_shared_prefix_is_asked_for() {
    let f = Fake::start(Spec::default());
    let r = run(config(
        &f,
        &[
            "smoke",
            "long-context",
            "concurrency",
            "repeated",
            "overload",
        ],
    ));
    assert_eq!(r.verdict, "ok", "{}", oomscope_probe::report::text(&r));
    let prompts = f.prompts();
    assert!(prompts.len() > 50, "{}", prompts.len());
    let distinct: HashSet<&String> = prompts.iter().collect();
    assert_eq!(distinct.len(), prompts.len(), "a prompt was sent twice");
    // No two share their first words either: no prefix cache answers any of them.
    let firsts: HashSet<String> = prompts
        .iter()
        .map(|p| p.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(firsts.len(), prompts.len());
    assert_eq!(
        (r.prompts.sent, r.prompts.distinct),
        (prompts.len() as u64, prompts.len() as u64)
    );
    assert!(r.envelope.as_ref().unwrap().shared_prefix_tokens.is_none());

    // --shared-prefix 20: the cached case, on purpose, and said so.
    let f = Fake::start(Spec::default());
    let mut c = config(&f, &["smoke", "concurrency"]);
    c.shared_prefix = Some(20);
    let r = run(c);
    let prompts = f.prompts();
    // The tiny prompts (the smoke's, the token calibration's, the pace's, an
    // idle check's) are shorter than the prefix.
    let long: Vec<&String> = prompts
        .iter()
        .filter(|p| p.split(' ').count() > 20)
        .collect();
    assert!(long.len() > 10, "{}", long.len());
    let prefixes: HashSet<String> = long
        .iter()
        .map(|p| p.split(' ').take(20).collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        prefixes.len(),
        1,
        "every prompt long enough shares its first 20 tokens"
    );
    assert_eq!(
        prompts.iter().collect::<HashSet<_>>().len(),
        prompts.len(),
        "still distinct prompts"
    );
    assert_eq!(r.envelope.as_ref().unwrap().shared_prefix_tokens, Some(20));
    assert!(oomscope_probe::report::text(&r).contains("the cached case"));
}

#[test]
fn contexts_are_tokens_as_the_servers_tokenizer_counts_them() {
    // Two tokens a word, a 1000-token model: a word-counting probe would
    // report 2x, or stop at half.
    let f = Fake::start(Spec {
        tokens_per_word: 2,
        tokenize: true,
        max_model_len: Some(1000),
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "long-context"]);
    c.max_context = 4096;
    let r = run(c);
    assert!(
        r.server.tokenizer && r.server.max_model_len == Some(1000),
        "{:?}",
        r.server
    );
    let fig = figure(&r, "max_context_at_concurrency_1");
    let v = fig["value"].as_u64().unwrap();
    // The ramp stops at the model's limit less the output tokens: 996.
    assert!((946..=996).contains(&v), "{fig:#}");
    assert_eq!(fig["bounded_by"], "max_context_setting", "{fig:#}");
    // Each rung asked for its tokens, not words.
    let steps = &r.suite("long-context").unwrap().steps;
    for st in steps.iter().filter(|s| s.ok == s.calls) {
        let (asked, counted) = (
            st.context_tokens.unwrap() as f64,
            st.prompt_tokens.unwrap() as f64,
        );
        assert!((counted - asked).abs() <= 0.02 * asked + 2.0, "{st:?}");
        assert!(st.prompt_words as f64 <= 0.6 * asked + 2.0, "{st:?}");
    }
}

#[test]
fn without_a_tokenizer_usage_calibrates_and_the_bound_is_bisected_to_5_percent() {
    // No /tokenize; 3 tokens a word; the model takes 700 tokens.
    let f = Fake::start(Spec {
        tokens_per_word: 3,
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "long-context"]);
    c.max_context = 600;
    let r = run(c);
    let fig = figure(&r, "max_context_at_concurrency_1");
    let v = fig["value"].as_u64().unwrap();
    assert!(
        (570..=600).contains(&v),
        "the last rung is the limit, in tokens: {fig:#}"
    );
    assert_eq!(fig["bounded_by"], "probe_limit");

    // /v1/models without the limit: only the 400 tells.
    let f = Fake::start(Spec {
        tokens_per_word: 3,
        max_model_len: Some(700),
        hide_limit: true,
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "long-context"]);
    c.max_context = 4096;
    let r = run(c);
    let fig = figure(&r, "max_context_at_concurrency_1");
    let v = fig["value"].as_u64().unwrap() as f64;
    // Prompt + 4 output tokens <= 700: the bound is 696 prompt tokens.
    assert!((0.95 * 696.0..=696.0).contains(&v), "{fig:#}");
}

#[test]
fn https_with_an_api_key_sends_the_key_to_the_endpoint() {
    let key = "sk-test-0123";
    let f = Fake::start(Spec {
        tls: true,
        api_key: Some(key.into()),
        ..Spec::default()
    });
    let dir = std::env::temp_dir().join(format!("oomscope-probe-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, f.ca_pem.as_ref().unwrap()).unwrap();

    let mut c = config(&f, &["smoke", "concurrency"]);
    c.api_key = Some(key.into());
    c.ca_cert = Some(ca.clone());
    c.max_concurrency = 2;
    let r = run(c);
    assert_eq!(r.verdict, "ok", "{}", oomscope_probe::report::text(&r));
    let seen = f.seen();
    assert!(seen.len() >= 4);
    assert!(
        seen.iter()
            .all(|s| s.header("authorization") == Some(&format!("Bearer {key}"))),
        "every request carries the key"
    );
    // Without the key: the server refuses, which is the environment.
    let mut c = config(&f, &["smoke"]);
    c.ca_cert = Some(ca.clone());
    let r = run(c);
    assert_eq!(r.verdict, "environment");
    // Without trusting its certificate: no request gets through.
    let before = f.seen().len();
    let mut c = config(&f, &["smoke"]);
    c.api_key = Some(key.into());
    let r = run(c);
    assert_eq!(r.verdict, "environment");
    assert_eq!(
        f.seen().len(),
        before,
        "nothing reached the server over an untrusted TLS session"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A server that wants a key says so with 401 (or 403 behind some
/// gateways): the probe's error names --api-key and OOMSCOPE_API_KEY, to
/// give a missing key or to check a wrong one.
#[test]
fn a_refused_key_is_answered_with_how_to_give_one() {
    for refusal in [401, 403] {
        let f = Fake::start(Spec {
            api_key: Some("sk-right".into()),
            key_refusal: refusal,
            ..Spec::default()
        });
        for (key, advice) in [
            (None, "wants an API key"),
            (Some("sk-wrong"), "check the key"),
        ] {
            let mut c = config(&f, &["smoke"]);
            c.api_key = key.map(str::to_string);
            let r = run(c);
            let text = oomscope_probe::report::text(&r);
            assert_eq!(r.verdict, "environment", "{text}");
            let reason = r.suites[0].reason.as_deref().unwrap_or_default();
            for needle in [
                &format!("HTTP {refusal}") as &str,
                "--api-key",
                "OOMSCOPE_API_KEY",
                advice,
            ] {
                assert!(reason.contains(needle), "{needle:?} not in {reason:?}");
            }
            assert!(text.contains(reason), "the report shows it: {text}");
        }
    }
    // Any other failure of the smoke says nothing of keys.
    let f = Fake::start(Spec {
        completions: false,
        chat: false,
        ..Spec::default()
    });
    let r = run(config(&f, &["smoke"]));
    let reason = r.suites[0].reason.as_deref().unwrap_or_default();
    assert_eq!(r.verdict, "environment");
    assert!(!reason.contains("--api-key"), "{reason}");
}

#[test]
fn a_chat_only_endpoint_is_driven_through_chat_under_api_auto() {
    let f = Fake::start(Spec {
        completions: false,
        chat_overhead: 9,
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "long-context", "concurrency"]);
    c.api = ApiChoice::Auto;
    let r = run(c);
    assert_eq!(r.verdict, "ok", "{}", oomscope_probe::report::text(&r));
    assert_eq!(r.server.api, "chat");
    let seen = f.seen();
    let posts: Vec<&str> = seen
        .iter()
        // (/v1/tokenize is SGLang's tokenizer, tried once when /tokenize is missing.)
        .filter(|s| s.method == "POST" && s.path.starts_with("/v1/") && s.path != "/v1/tokenize")
        .map(|s| s.path.as_str())
        .collect();
    let after_first_chat = posts.iter().skip_while(|p| **p != "/v1/chat/completions");
    assert!(after_first_chat.clone().count() > 10);
    assert!(
        after_first_chat
            .into_iter()
            .all(|p| *p == "/v1/chat/completions"),
        "{posts:?}"
    );
    // The template's tokens count: the figure is what the server counted.
    let fig = figure(&r, "max_context_at_concurrency_1");
    assert!(
        (240..=270).contains(&fig["value"].as_u64().unwrap()),
        "{fig:#}"
    );
    // --api completions on it is the environment.
    let mut c = config(&f, &["smoke"]);
    c.api = ApiChoice::Completions;
    assert_eq!(run(c).verdict, "environment");
}

#[test]
fn a_serializing_server_is_serialized_by_its_first_tokens() {
    let f = Fake::start(Spec {
        slots: 1,
        stream: true,
        service: Duration::from_millis(40),
        ..Spec::default()
    });
    let r = run(config(&f, &["smoke", "concurrency"]));
    assert!(r.server.streaming);
    let fig = figure(&r, "max_concurrency_at_typical_context");
    assert_eq!(
        (fig["value"].as_u64(), fig["bounded_by"].as_str()),
        (Some(1), Some("serialized")),
        "{fig:#}"
    );
    assert_eq!(fig["offered"], 8);
    assert_eq!(fig["method"], "first_token");
    let text = oomscope_probe::report::text(&r);
    assert!(text.contains("1 sequences of 8 sent at once"), "{text}");
}

#[test]
fn a_full_kv_pool_bounds_concurrency_and_names_the_runtimes_setting() {
    let f = Fake::start(Spec {
        slots: 3,
        metrics: true,
        kv_full: true,
        service: Duration::from_millis(150),
        ..Spec::default()
    });
    let r = run(config(&f, &["smoke", "concurrency"]));
    assert_eq!(r.server.load_source.as_deref(), Some("vLLM /metrics"));
    let fig = figure(&r, "max_concurrency_at_typical_context");
    assert_eq!(
        (fig["value"].as_u64(), fig["bounded_by"].as_str()),
        (Some(3), Some("kv_pool")),
        "{fig:#}"
    );
    assert_eq!(fig["method"], "server_metrics");
    assert!(
        fig["evidence"][0]
            .as_str()
            .unwrap()
            .contains("--gpu-memory-utilization"),
        "{fig:#}"
    );
    // Without a full pool, the same cap is a sequence cap.
    let f = Fake::start(Spec {
        slots: 3,
        metrics: true,
        service: Duration::from_millis(150),
        ..Spec::default()
    });
    let r = run(config(&f, &["smoke", "concurrency"]));
    let fig = figure(&r, "max_concurrency_at_typical_context");
    assert_eq!(
        (fig["value"].as_u64(), fig["bounded_by"].as_str()),
        (Some(3), Some("max_sequences_setting")),
        "{fig:#}"
    );
    assert!(
        fig["evidence"][0]
            .as_str()
            .unwrap()
            .contains("--max-num-seqs"),
        "{fig:#}"
    );
}

#[test]
fn a_spent_budget_is_incomplete_and_a_suite_not_run_is_not_measured() {
    let f = Fake::start(Spec {
        service: Duration::from_millis(300),
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "long-context"]);
    c.suite_budget = Some(Duration::from_millis(500));
    let r = run(c);
    assert_eq!(r.verdict, "incomplete");
    assert_eq!(oomscope_probe::report::exit_code(&r.verdict), 4);
    let fig = figure(&r, "max_context_at_concurrency_1");
    assert_eq!(fig["bounded_by"], "suite_budget", "{fig:#}");
    // The concurrency suite did not run: no figure, and no empty bound.
    let conc = figure(&r, "max_concurrency_at_typical_context");
    assert_eq!(
        (conc["value"].is_null(), conc["bounded_by"].as_str()),
        (true, Some("not_measured"))
    );
    let text = oomscope_probe::report::text(&r);
    assert!(
        text.contains("max concurrency at typical context   not measured"),
        "{text}"
    );
    assert!(!text.contains("bounded by \n"), "{text}");
}

#[test]
fn the_deadline_cuts_each_ramp_to_a_lower_bound_that_says_where() {
    let f = Fake::start(Spec {
        slots: 1,
        service: Duration::from_millis(300),
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "long-context", "concurrency"]);
    // The smoke and the pace take about 1.5 s of it; a default run's budgets far more.
    c.deadline = Duration::from_secs(3);
    let r = run(c);
    assert_eq!(r.verdict, "incomplete", "{r:#?}");
    assert!(r.duration_s < 6.0, "{r:#?}");
    let lc = r.suite("long-context").unwrap();
    let last = lc.steps.last().unwrap();
    assert_eq!((last.not_measured, last.timeouts), (1, 0), "{lc:#?}");
    let fig = figure(&r, "max_context_at_concurrency_1");
    assert_eq!(fig["bounded_by"], "deadline", "{fig:#}");
    let passed = lc.steps[lc.steps.len() - 2].prompt_tokens;
    assert_eq!(fig["value"].as_u64(), passed, "{fig:#}");
    let why = format!(
        "the run's 3 s deadline was reached at {} tokens",
        last.context_tokens.unwrap()
    );
    assert!(
        fig["evidence"][0].as_str().unwrap().contains(&why),
        "{fig:#}"
    );
    // The suite after it had what the deadline left it (its share, kept
    // for it when the long-context suite began), and says so.
    let conc = r.suite("concurrency").unwrap();
    assert_eq!(
        conc.status,
        oomscope_probe::report::Status::Error,
        "{conc:#?}"
    );
    assert!(conc.verdict.contains("deadline was reached"), "{conc:#?}");
    assert!(conc.steps.iter().all(|s| s.timeouts == 0), "{conc:#?}");
    let fig = figure(&r, "max_concurrency_at_typical_context");
    assert!(
        ["deadline", "not_measured"].contains(&fig["bounded_by"].as_str().unwrap()),
        "{fig:#}"
    );
}

#[test]
fn a_rung_first_waits_until_the_servers_running_count_clears_the_cut_request() {
    // One at a time, 1 s each, vLLM-style /metrics: the long-context
    // ramp's third rung is cut by the 2.2 s budget and runs on at the
    // server for 0.8 s more.
    let f = Fake::start(Spec {
        slots: 1,
        service: Duration::from_millis(1000),
        metrics: true,
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "long-context", "concurrency"]);
    c.suite_budget = Some(Duration::from_millis(2200));
    c.max_concurrency = 1;
    let r = run(c);
    assert_eq!(r.verdict, "incomplete", "{r:#?}");
    let lc = r.suite("long-context").unwrap();
    let last = lc.steps.last().unwrap();
    assert_eq!(
        (last.not_measured, last.timeouts, last.ok),
        (1, 0, 0),
        "{lc:#?}"
    );
    assert!(
        last.failure.is_none(),
        "a cut request is no failure: {last:#?}"
    );
    let first = &r.suite("concurrency").unwrap().steps[0];
    // Served at once, not behind the cut request: one service time, not 1.8 s.
    assert_eq!(first.ok, 1, "{first:#?}");
    assert!(first.p99_ms.unwrap() < 1500.0, "{first:#?}");
    let w = first.idle_wait.as_ref().expect("the rung waited");
    assert_eq!(
        (w.method.as_str(), w.still_busy),
        ("server_metrics", false),
        "{w:#?}"
    );
    assert!(w.waited_ms > 100.0, "{w:#?}");
}

#[test]
fn the_latency_bound_reports_the_last_rung_within_it() {
    // One at a time, 60 ms each: rung n takes about n x 60 ms.
    let f = Fake::start(Spec {
        slots: 1,
        service: Duration::from_millis(60),
        ..Spec::default()
    });
    let mut c = config(&f, &["smoke", "concurrency"]);
    c.latency_bound = Duration::from_millis(300);
    let r = run(c);
    let fig = figure(&r, "max_concurrency_at_typical_context");
    let steps = &r.suite("concurrency").unwrap().steps;
    let offered = fig["offered"].as_u64().unwrap() as usize;
    let within = steps
        .iter()
        .filter(|s| s.p99_ms.unwrap() <= 300.0)
        .map(|s| s.concurrency)
        .max()
        .unwrap();
    assert_eq!(offered, within, "{fig:#}");
    assert!(steps.last().unwrap().p99_ms.unwrap() > 300.0);
    assert!(
        fig["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().contains("latency bound")),
        "{fig:#}"
    );
}
