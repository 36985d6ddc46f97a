//! A death while `oomscope probe` drove the instance: the probe member's
//! requests give the trigger. A longer prompt than any answered is
//! size_dependent, with the prompt's size at the kill by the server's count
//! where it gave one; more requests at once at no longer a prompt is
//! concurrency_dependent; a death after the probe's requests is neither.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const OWN: &str = "/jobs/server";
const MS: i64 = 1_000_000;

/// The server (no agent of its own) killed in its 2 GiB cgroup at `T0 + 3 s`.
fn killed_server() -> Evidence {
    let before = counters(
        T0,
        vec![v1(OWN, 2 * GIB, 900 * MIB, 900 * MIB, 0, 0)],
        system(3, 12 * GIB),
    );
    let after = counters(
        T0 + 3 * SEC,
        vec![v1(OWN, 2 * GIB, 300 * MIB, 2 * GIB, 41, 1)],
        system(4, 12 * GIB),
    );
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    if let Some(Kind::ChildExit(x)) = &mut e.events[0].kind {
        x.runtime_ns = 300 * SEC as u64;
    }
    e
}

/// One probe request: id, start and end (ms after T0), the probe's count,
/// the count its end carried, and its error.
struct Req(u32, i64, i64, u64, u64, &'static str);

fn boundary(at_ms: i64, b: pb::RequestBoundary) -> pb::Event {
    pb::Event {
        time_ns: T0 + at_ms * MS,
        kind: Some(Kind::Request(b)),
    }
}

/// The probe's member: its Hello and its requests' boundaries.
fn probe(reqs: &[Req]) -> Evidence {
    let mut events = Vec::new();
    for Req(id, start, end, est, counted, error) in reqs {
        let request_id = format!("probe-{id}");
        events.push(boundary(
            *start,
            pb::RequestBoundary {
                request_id: request_id.clone(),
                start: true,
                prompt_tokens: *est,
                max_tokens: 16,
                ..Default::default()
            },
        ));
        events.push(boundary(
            *end,
            pb::RequestBoundary {
                request_id,
                start: false,
                prompt_tokens: *counted,
                output_tokens: if error.is_empty() { 16 } else { 0 },
                error: error.to_string(),
                ..Default::default()
            },
        ));
    }
    events.sort_by_key(|e| e.time_ns);
    Evidence {
        hello: Some(pb::Hello {
            agent_id: "probe-1".into(),
            name: "oomtest.probe".into(),
            role: "probe".into(),
            pid: 9000,
            ..Default::default()
        }),
        events,
        ..Default::default()
    }
}

fn with_probe(reqs: &[Req]) -> pb::Diagnosis {
    let mut e = killed_server();
    e.members.push(probe(reqs));
    diagnose(&e)
}

fn trigger_line(d: &pb::Diagnosis) -> String {
    d.evidence
        .iter()
        .find(|l| l.starts_with("trigger "))
        .cloned()
        .unwrap_or_else(|| panic!("no trigger line in {:#?}", d.evidence))
}

const RESET: &str = "connection reset by peer";

#[test]
fn the_longer_prompt_at_the_kill_is_size_dependent_by_the_servers_count() {
    // Prompts of 512, 1024 and 2048 words answered, the server counting
    // about five tokens a word (the median ratio 5170 / 1024 scales the
    // 4096 words of the prompt in flight to 20680 tokens).
    let d = with_probe(&[
        Req(0, 100, 400, 512, 2590, ""),
        Req(1, 500, 1000, 1024, 5170, ""),
        Req(2, 1100, 2000, 2048, 10330, ""),
        Req(3, 2100, 3050, 4096, 4096, RESET),
    ]);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert_eq!(d.trigger.as_deref(), Some("size_dependent"));
    let line = trigger_line(&d);
    assert!(
        line.contains("the probe's prompt of about 20680 tokens by the server's counts of the earlier prompts (5.05 of the probe's estimate of 4096)"),
        "{line}"
    );
    assert!(
        line.contains(
            "answered 3 of the probe's requests, prompts of up to 10330 tokens, at most 1 at once"
        ),
        "{line}"
    );
    // Where the server counted the fatal prompt itself, that count is quoted.
    let d = with_probe(&[
        Req(0, 100, 400, 512, 2590, ""),
        Req(1, 2100, 3050, 4096, 20652, RESET),
    ]);
    assert_eq!(d.trigger.as_deref(), Some("size_dependent"));
    assert!(
        trigger_line(&d).contains("20652 tokens (the server's count; the probe estimated 4096)"),
        "{:#?}",
        d.evidence
    );
}

#[test]
fn more_requests_at_once_at_a_served_size_is_concurrency_dependent() {
    // Eight at once of 1024 tokens answered; then 32 at once of 1024.
    let mut reqs: Vec<Req> = (0..8).map(|i| Req(i, 100, 900, 1024, 1024, "")).collect();
    reqs.extend((8..40).map(|i| Req(i, 1000 + i as i64, 3020, 1024, 1024, RESET)));
    let d = with_probe(&reqs);
    assert_eq!(d.trigger.as_deref(), Some("concurrency_dependent"));
    let line = trigger_line(&d);
    assert!(
        line.contains("with 32 of the probe's requests in flight, prompts of up to 1024 tokens"),
        "{line}"
    );
    assert!(line.contains("at most 8 at once"), "{line}");
}

#[test]
fn a_death_after_the_probes_requests_or_at_a_served_load_is_neither() {
    // The probe's last request ended 2 s before the kill.
    let d = with_probe(&[
        Req(0, 100, 400, 512, 512, ""),
        Req(1, 500, 1000, 4096, 4096, ""),
    ]);
    assert!(
        !["size_dependent", "concurrency_dependent"].contains(&d.trigger.as_deref().unwrap_or("")),
        "{:#?}",
        d.evidence
    );
    // One request of a size already answered, alone: no step went past.
    let d = with_probe(&[
        Req(0, 100, 400, 2048, 2048, ""),
        Req(1, 2500, 3050, 1024, 1024, RESET),
    ]);
    assert!(
        !["size_dependent", "concurrency_dependent"].contains(&d.trigger.as_deref().unwrap_or("")),
        "{:#?}",
        d.evidence
    );
}
