//! The trigger of a cgroup kill of a server with no in-process agent: its
//! supervisor's samples, with the request context that `oomscope probe`
//! sent joined to them (as the collector joins it). Host memory that rises
//! with the prompt at one sequence is size-dependent; with the sequences in
//! service, concurrency-dependent; readings that say nothing leave it
//! unknown.

mod common;

use common::*;
use oomscope_analysis::diagnose;
use oomscope_analysis::pb;

const LIMIT: u64 = 1024 * MIB;
const BASE: u64 = 600 * MIB;

/// A supervisor's sample at `t` with the cgroup at `usage` and the probe's
/// context: `sequences` in service, `tokens` in all, the longest prompt `prompt`.
fn at(t: i64, usage: u64, sequences: u64, tokens: u64, prompt: u64) -> pb::Sample {
    let mut s = sample(
        t,
        vec![v1("/probe/srv", LIMIT, usage, usage, 0, 0)],
        system(10, 12 * GIB),
    );
    s.context = Some(pb::RequestContext {
        phase: "probe".into(),
        active_sequences: sequences,
        active_tokens: tokens,
        prompt_tokens: prompt,
        ..Default::default()
    });
    s
}

/// The kill: exit by SIGKILL with the cgroup's oom_kill counted, at T0 + 3 s.
fn killed(samples: Vec<pb::Sample>) -> pb::Diagnosis {
    let before = counters(
        T0,
        vec![v1("/probe/srv", LIMIT, BASE, BASE, 0, 0)],
        system(10, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![v1("/probe/srv", LIMIT, LIMIT - MIB, LIMIT, 40, 1)],
        system(11, 12 * GIB),
    );
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    e.samples = samples;
    diagnose(&e)
}

fn trigger_line(d: &pb::Diagnosis) -> &str {
    d.evidence
        .iter()
        .find(|l| l.starts_with("trigger "))
        .map_or("", String::as_str)
}

/// The ramp before the kill, 100 ms apart: each step's reading.
fn ramp(steps: &[(u64, u64, u64, u64)]) -> Vec<pb::Sample> {
    steps
        .iter()
        .enumerate()
        .map(|(i, &(usage, seqs, tokens, prompt))| {
            at(T0 + SEC + i as i64 * SEC / 10, usage, seqs, tokens, prompt)
        })
        .collect()
}

#[test]
fn host_memory_rising_with_the_prompt_at_one_sequence_is_size_dependent() {
    // 64..4096 tokens, 40 MiB more per doubling, then the kill at 8192.
    let mut steps = Vec::new();
    for (i, tokens) in [64u64, 128, 256, 512, 1024, 2048, 4096, 8192]
        .iter()
        .enumerate()
    {
        steps.push((BASE + i as u64 * 40 * MIB, 1, *tokens, *tokens));
        steps.push((BASE, 0, 0, 0)); // between requests
    }
    steps.pop(); // it died during the last one
    let d = killed(ramp(&steps));
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{d:#?}");
    assert_eq!(d.trigger.as_deref(), Some("size_dependent"), "{d:#?}");
    let line = trigger_line(&d);
    assert!(line.contains("from 64 to 8192 tokens"), "{line}");
    assert!(line.ends_with("the failure came at 8192 tokens"), "{line}");
}

#[test]
fn host_memory_rising_with_sequences_in_service_is_concurrency_dependent() {
    // 1, 2, 4, 8 sequences of 256 tokens, 60 MiB each, then the kill at 8.
    let steps: Vec<_> = [1u64, 2, 4, 8]
        .iter()
        .map(|&n| (BASE + n * 60 * MIB, n, n * 256, 256))
        .collect();
    let d = killed(ramp(&steps));
    assert_eq!(
        d.trigger.as_deref(),
        Some("concurrency_dependent"),
        "{d:#?}"
    );
    let line = trigger_line(&d);
    assert!(
        line.contains("at 1 sequence(s)") && line.contains("at 8"),
        "{line}"
    );
    assert!(line.ends_with("the failure came at 8 sequences"), "{line}");
}

#[test]
fn flat_host_memory_or_an_idle_server_at_the_kill_is_no_size_trigger() {
    let prompts = [64u64, 128, 256, 512, 1024, 2048, 4096, 8192];
    // Flat: the prompts grew, memory did not (a few pages of noise).
    let flat: Vec<_> = prompts
        .iter()
        .map(|&t| (BASE + (t % 3) * MIB, 1, t, t))
        .collect();
    let d = killed(ramp(&flat));
    assert_ne!(d.trigger.as_deref(), Some("size_dependent"), "{d:#?}");
    // Rising with the prompt, but the server was idle when it was killed:
    // something else set it off.
    let mut idle: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, &t)| (BASE + i as u64 * 40 * MIB, 1, t, t))
        .collect();
    let d = killed(ramp(&idle));
    assert_eq!(
        d.trigger.as_deref(),
        Some("size_dependent"),
        "the same ramp, killed in service: {d:#?}"
    );
    idle.push((BASE, 0, 0, 0));
    let d = killed(ramp(&idle));
    assert_ne!(d.trigger.as_deref(), Some("size_dependent"), "{d:#?}");
}
