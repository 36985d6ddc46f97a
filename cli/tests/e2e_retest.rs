//! `oomscope retest` against the real Python reference server in v1 memory
//! cgroups of `--memory-limit`, overrun by KV concurrency: the baseline
//! reproduces; each candidate's outcome is the one the memory model below
//! predicts from the fixture's sizes and the cgroup's limit; a candidate
//! that cannot start is one failed row; the chosen fix is the lowest-risk
//! one that vanished. A fixture that does not fail stops the run.
//!
//! The memory model of the reference server (its defaults: vocab 32000,
//! d_model 256, 2 layers, float32, CPU): each request in service holds its
//! prefill logits (prompt x vocab x 4 bytes; the server keeps a view of
//! them) and its KV (2 x layers x d_model x 4 bytes a token), on top of
//! the process at rest (measured in its cgroup: about 370 MiB; the model
//! takes 400 MiB for the first request's one-time buffers).

mod common;

use std::path::Path;

use common::*;

const MIB: u64 = 1 << 20;
const LIMIT_MIB: u64 = 1100;
const AT_REST: u64 = 400 * MIB;
const VOCAB: u64 = 32000;
const D_MODEL: u64 = 256;
const LAYERS: u64 = 2;
const PROMPT: u64 = 1000;
const OUTPUT: u64 = 16;
const CONCURRENCY: u64 = 8;
const MAX_QUEUE: u64 = 8;

/// Bytes one request holds in service, with `kv_bytes` an element of its KV.
fn per_request_with(kv_bytes: u64) -> u64 {
    PROMPT * VOCAB * 4 + (PROMPT + OUTPUT) * 2 * LAYERS * D_MODEL * kv_bytes
}

fn per_request() -> u64 {
    per_request_with(4)
}

/// What the model predicts when the server lets `in_service` of the
/// fixture's requests run at once and refuses `refused` of them.
fn predicted(in_service: u64, refused: u64) -> &'static str {
    let need = AT_REST + in_service * per_request();
    match (need > LIMIT_MIB * MIB, refused) {
        (true, _) => "same",
        (false, 0) => "vanished",
        // Nothing ran out, but the server turned part of the workload away.
        (false, _) => "moved",
    }
}

fn write_fixture(dir: &Path, n: u64) -> std::path::PathBuf {
    let reqs: Vec<_> = (0..n)
        .map(|_| serde_json::json!({"prompt_tokens": PROMPT, "output_tokens": OUTPUT}))
        .collect();
    let f = serde_json::json!({"schema": "oomscope.fixture/v1", "source": "test",
        "requests": reqs, "concurrency": n, "repeats": 1});
    let p = dir.join(format!("fixture-{n}.json"));
    std::fs::write(&p, f.to_string()).unwrap();
    p
}

fn server_args(port: u16) -> Vec<String> {
    format!("--port {port} --max-queue {MAX_QUEUE} --restore-seconds 0")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn retest(col: &Collector, fixture: &Path, tries: &[String]) -> (i32, serde_json::Value) {
    retest_with(col, fixture, tries, &[])
}

/// `retest` of the reference server started with `server_args` and `extra`.
fn retest_with(
    col: &Collector,
    fixture: &Path,
    tries: &[String],
    extra: &[&str],
) -> (i32, serde_json::Value) {
    let port = free_port();
    let mut c = oomscope();
    c.args([
        "retest",
        "--json",
        "--collector",
        &col.url,
        "--memory-limit",
    ])
    .arg(format!("{LIMIT_MIB}M"))
    .args([
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v1"),
        "--fixture",
    ])
    .arg(fixture);
    for t in tries {
        c.arg("--try").arg(t);
    }
    c.arg("--")
        .arg(python())
        .arg(repo().join("runtimes/pytorch-server/server.py"))
        .args(server_args(port))
        .args(extra);
    let out = c.output().unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "retest printed no JSON ({e}): {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

#[test]
fn each_candidate_measures_what_the_memory_model_predicts() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let fixture = write_fixture(tmp.path(), CONCURRENCY);
    let max_context = PROMPT / 2;
    let max_total = 3 * (PROMPT + OUTPUT) + 100;
    let tries = [
        "--max-active=3".to_string(),
        format!("--max-context={max_context}"),
        format!("--max-total-tokens={max_total}"),
        // argparse refuses it: the server never starts.
        "--layers=two".to_string(),
        // Half the KV bytes, rounded: the numerics change.
        "--kv-dtype=bfloat16".to_string(),
    ];
    let (code, r) = retest(&col, &fixture, &tries);
    assert_eq!(r["schema"], "oomscope.retest/v1", "{r:#}");
    // The baseline reproduces: all 8 at once overrun the limit.
    assert_eq!(predicted(CONCURRENCY, 0), "same");
    let base = &r["baseline"];
    assert!(base["answered"].as_u64().unwrap() < CONCURRENCY, "{r:#}");
    assert_eq!(base["domain"], "cgroup", "{r:#}");
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "{r:#}");
    let outcome = |i: usize| rows[i]["outcome"].as_str().unwrap();
    // --max-active 3: three in service, five queued behind them, none refused.
    assert_eq!(outcome(0), predicted(3, 0), "{r:#}");
    // A shorter context than the prompt: every request refused.
    let too_long = (PROMPT + OUTPUT > max_context) as u64 * CONCURRENCY;
    assert_eq!(
        outcome(1),
        predicted(CONCURRENCY - too_long, too_long),
        "{r:#}"
    );
    assert_eq!(rows[1]["domain"], "max_context_setting", "{r:#}");
    // Tokens in flight capped: as many as fit run, the rest are refused.
    let admitted = (max_total / (PROMPT + OUTPUT)).min(CONCURRENCY);
    assert_eq!(
        outcome(2),
        predicted(admitted, CONCURRENCY - admitted),
        "{r:#}"
    );
    assert_eq!(rows[2]["answered"], admitted, "{r:#}");
    // The candidate that never started is one failed row, and the run went on after it.
    assert_eq!(outcome(3), "failed_start", "{r:#}");
    // A bfloat16 KV: the logits still dominate, 8 at once still overrun the limit.
    let bf16_need = AT_REST + CONCURRENCY * per_request_with(2);
    assert!(bf16_need > LIMIT_MIB * MIB);
    assert_eq!(outcome(4), "same", "{r:#}");
    // The quality check: the KV type's change is flagged (the logprobs moved),
    // the changes that alter no numerics are not, and show no drift at all.
    let q = |i: usize| &rows[i]["quality_drift"];
    assert_eq!(q(4)["flagged"], true, "{r:#}");
    assert!(
        q(4)["mean_abs_logprob_delta"].as_f64().unwrap()
            > oomscope_probe::quality::MAX_MEAN_LOGPROB_DELTA,
        "{r:#}"
    );
    assert_eq!(rows[4]["risk"], "high", "{r:#}");
    for i in 0..3 {
        assert_eq!(q(i)["flagged"], false, "row {i}: {r:#}");
        assert_eq!(q(i)["identical_share"], 1.0, "row {i}: {r:#}");
        assert_eq!(q(i)["mean_abs_logprob_delta"], 0.0, "row {i}: {r:#}");
    }
    // Chosen: the lowest-risk row that vanished (with overload clean).
    let vanished: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|row| row["outcome"] == "vanished")
        .collect();
    let rank = |r: &str| {
        ["low", "medium", "high"]
            .iter()
            .position(|x| *x == r)
            .unwrap()
    };
    let lowest = vanished
        .iter()
        .min_by_key(|row| rank(row["risk"].as_str().unwrap()))
        .expect("a row vanished");
    assert_eq!(lowest["overload"], "clean", "{r:#}");
    assert_eq!(lowest["chosen"], true, "{r:#}");
    assert_eq!(
        r["chosen"],
        format!(
            "{}={}",
            lowest["setting"].as_str().unwrap(),
            lowest["value"].as_str().unwrap()
        )
    );
    assert_eq!(rows.iter().filter(|row| row["chosen"] == true).count(), 1);
    assert_eq!(code, 0, "{r:#}");
    assert!(
        r["regression"].as_str().unwrap().contains("--fixture"),
        "{r:#}"
    );
}

#[test]
fn a_chat_only_server_gets_the_quality_check_through_chat() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let fixture = write_fixture(tmp.path(), CONCURRENCY);
    // No /v1/completions: the replay and the quality prompts go through chat.
    let tries = [
        "--max-active=3".to_string(),
        "--kv-dtype=bfloat16".to_string(),
    ];
    let (_, r) = retest_with(&col, &fixture, &tries, &["--chat-only"]);
    assert_eq!(r["baseline"]["domain"], "cgroup", "{r:#}");
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{r:#}");
    let q = |i: usize| &rows[i]["quality_drift"];
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(
            row["quality_drift"]["via"], "/chat/completions",
            "row {i}: {r:#}"
        );
        // The server returned chat logprobs, so nothing is left unmeasured.
        assert!(row["quality_note"].is_null(), "row {i}: {r:#}");
    }
    // A change with no numeric effect: every answer and logprob the same.
    assert_eq!(q(0)["identical_share"], 1.0, "{r:#}");
    assert_eq!(q(0)["mean_abs_logprob_delta"], 0.0, "{r:#}");
    assert_eq!(q(0)["flagged"], false, "{r:#}");
    // A bfloat16 KV moves the chat logprobs past the threshold: flagged.
    assert!(
        q(1)["mean_abs_logprob_delta"].as_f64().unwrap()
            > oomscope_probe::quality::MAX_MEAN_LOGPROB_DELTA,
        "{r:#}"
    );
    assert_eq!(q(1)["flagged"], true, "{r:#}");
    assert_eq!(rows[0]["outcome"], predicted(3, 0), "{r:#}");
}

#[test]
fn a_fixture_that_does_not_fail_stops_the_run() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // Two at once fit: the model says the baseline does not fail.
    assert_eq!(predicted(2, 0), "vanished");
    let fixture = write_fixture(tmp.path(), 2);
    let (code, r) = retest(&col, &fixture, &["--max-active=1".to_string()]);
    assert_eq!(code, 2, "{r:#}");
    assert!(
        r["why"].as_str().unwrap().contains("does not reproduce"),
        "{r:#}"
    );
    assert_eq!(
        r["rows"].as_array().unwrap().len(),
        0,
        "no candidate ran: {r:#}"
    );
}

#[test]
fn candidates_from_an_incident_come_from_its_diagnosis() {
    let _serial = serial();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let fixture = write_fixture(tmp.path(), CONCURRENCY);
    // The incident: the fixture replayed against the server in its cgroup.
    let port = free_port();
    let mut srv = oomscope()
        .args(run_args(&col.url, "retest-from"))
        .args(["--memory-limit", &format!("{LIMIT_MIB}M"), "--", &python()])
        .arg(repo().join("runtimes/pytorch-server/server.py"))
        .args(server_args(port))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    await_health(port);
    let (code, _) = probe(&[
        "--endpoint",
        &format!("http://127.0.0.1:{port}/v1"),
        "--fixture",
        fixture.to_str().unwrap(),
        "--quiet",
    ]);
    assert_ne!(code, 0);
    let _ = srv.wait();
    let incs = col.incidents_of("retest-from", 1, std::time::Duration::from_secs(10));
    let id = incs[0]["id"].as_str().unwrap().to_string();
    let d = col.json(&["diagnose", &id]);
    let actions: Vec<&str> = d["fixes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["action"].as_str().unwrap())
        .collect();
    // The candidates retest takes are the reference server's settings its fixes name.
    let expected = oomscope_probe::retest::candidates_from_fixes(
        actions.iter().copied(),
        Some(oomscope_analysis::settings::Runtime::ReferencePytorch),
        &oomscope_probe::fixture::Fixture::parse(&std::fs::read_to_string(&fixture).unwrap())
            .unwrap(),
    );
    assert!(!expected.is_empty(), "the diagnosis names a setting: {d:#}");
    let port = free_port();
    let page = tmp.path().join("closed.html");
    let out = oomscope()
        .args([
            "retest",
            "--json",
            "--collector",
            &col.url,
            "--from",
            &id,
            "--memory-limit",
        ])
        .arg(format!("{LIMIT_MIB}M"))
        .args([
            "--endpoint",
            &format!("http://127.0.0.1:{port}/v1"),
            "--fixture",
        ])
        .arg(&fixture)
        .arg("--html")
        .arg(&page)
        .arg("--")
        .arg(python())
        .arg(repo().join("runtimes/pytorch-server/server.py"))
        .args(server_args(port))
        .output()
        .unwrap();
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows: Vec<(String, String)> = r["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row["setting"].as_str().unwrap().to_string(),
                row["value"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(rows, expected, "{r:#}");
    // One document closes the incident: its report (the verdict's domain on
    // the page), then each retest and the choice.
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains("data-domain=\"cgroup\""),
        "the incident's report"
    );
    let retests = &html[html.find("<section id=\"retest\">").expect("the retests")..];
    assert!(html.find("data-domain").unwrap() < html.find("<section id=\"retest\">").unwrap());
    for (setting, value) in &rows {
        assert!(retests.contains(&format!("{setting} {value}")), "{retests}");
    }
    assert!(
        retests.contains("Regression test: oomscope probe"),
        "{retests}"
    );
    // Every row measured: an outcome each, none a failed start.
    for row in r["rows"].as_array().unwrap() {
        assert!(
            ["vanished", "moved", "shrank", "same"].contains(&row["outcome"].as_str().unwrap()),
            "{r:#}"
        );
    }
}
