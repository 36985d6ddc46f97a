//! A certain host growth with no limit in the evidence (no cgroup limit, no
//! system reading, so no MemTotal) is still a finding: the limit only sets
//! its urgency. Shaped like a supervisor's replay of a CPU server: process
//! RSS samples and RequestBoundary events, no request context.

use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const MS: i64 = 1_000_000;

fn boundary(t: i64, start: bool) -> pb::Event {
    pb::Event {
        time_ns: t,
        kind: Some(Kind::Request(pb::RequestBoundary {
            request_id: format!("r{t}"),
            start,
            ..Default::default()
        })),
    }
}

fn rss_sample(t: i64, rss: u64) -> pb::Sample {
    pb::Sample {
        time_ns: t,
        process: Some(pb::ProcessMemory {
            pid: 7,
            vm_rss_bytes: rss,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `requests` requests 200 ms apart: a reading inside each (its
/// temporaries, 64 MiB over the baseline) and one after it, at 1 GiB +
/// `per_request` × requests done, give or take a few allocator pages.
fn replay(requests: u64, per_request: u64) -> Evidence {
    let mut samples = Vec::new();
    let mut events = Vec::new();
    for i in 1..=requests {
        let t = i as i64 * 200 * MS;
        let jitter = (i * 7919 % 5) * 4096;
        let baseline = GIB + per_request * i + jitter;
        events.push(boundary(t, true));
        samples.push(rss_sample(t + 20 * MS, baseline + 64 * MIB));
        events.push(boundary(t + 50 * MS, false));
        samples.push(rss_sample(t + 100 * MS, baseline));
    }
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(pb::Hello {
            agent_id: "cpu".into(),
            name: "cpu".into(),
            ..Default::default()
        }),
        samples,
        events,
        incident: None,
    }
}

fn rss_of(s: Option<&pb::Sample>) -> u64 {
    s.and_then(|s| s.process.as_ref())
        .map_or(0, |p| p.vm_rss_bytes)
}

#[test]
fn certain_growth_without_a_limit_is_host_growth_with_unknown_runway() {
    // 100 requests: past the warm-up window (the first 50), where a growth
    // states its runway, known or not.
    let d = diagnose(&replay(100, 4 * MIB));
    let kinds: Vec<&str> = d.causes.iter().map(|c| c.kind.as_str()).collect();
    assert_eq!(kinds, ["host_growth"], "{:?}", d.causes);
    let c = &d.causes[0];
    let got = c.metrics["bytes_per_request"];
    let want = (4 * MIB) as f64;
    assert!((got - want).abs() < 0.1 * want, "bytes_per_request {got}");
    assert_eq!(c.evidence[0], "runway unknown: no limit in the evidence");
    assert!(
        c.evidence[1].starts_with("between requests host RSS rose from 1.0 GiB to 1.4 GiB"),
        "{:?}",
        c.evidence
    );
    // No limit, so no runway figures to claim.
    for key in ["requests_to_limit", "limit_bytes", "seconds_to_limit"] {
        assert!(!c.metrics.contains_key(key), "{key}: {:?}", c.metrics);
    }
    // The trigger agrees with the cause.
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
    assert!(
        d.evidence
            .iter()
            .any(|l| l == "trigger repeated_requests: between requests host RSS grew 4.0 MiB per request over 99 requests"),
        "{:?}",
        d.evidence
    );
    assert!(d.domain.is_none(), "nothing failed");
    assert!(!d.fixes.is_empty(), "a cause gets its fixes");
}

#[test]
fn the_same_timeline_flat_gives_no_cause_and_no_trigger() {
    let d = diagnose(&replay(40, 0));
    assert!(d.causes.is_empty(), "{:?}", d.causes);
    assert_eq!(d.trigger, None);
    assert!(d.fixes.is_empty());
}

#[test]
fn with_memtotal_the_same_growth_keeps_its_runway() {
    let mut e = replay(100, 4 * MIB);
    e.samples.last_mut().unwrap().system = Some(pb::SystemMemory {
        mem_total_bytes: 16 * GIB,
        ..Default::default()
    });
    let d = diagnose(&e);
    let c = d.causes.iter().find(|c| c.kind == "host_growth").unwrap();
    assert!(c.evidence[0].starts_with("runway: "), "{:?}", c.evidence);
    assert!(c.evidence[0].contains("of MemTotal is gone in"));
    assert_eq!(c.metrics["limit_bytes"], (16 * GIB) as f64);
    // (16 GiB - the last RSS) / the fitted growth.
    let last = rss_of(e.samples.last()) as f64;
    let left = ((16 * GIB) as f64 - last) / c.metrics["bytes_per_request"];
    assert!((c.metrics["requests_to_limit"] - left.floor()).abs() <= 1.0);
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
    // At 200 ms a request that is 20 s of serving (2 s of it in requests):
    // think time is part of the serving rate.
    assert!(
        (c.metrics["requests_per_s"] - 5.0).abs() < 1e-6,
        "{:?}",
        c.metrics
    );
}

#[test]
fn inside_the_warm_up_window_the_same_growth_is_possible_warm_up_without_a_runway() {
    let mut e = replay(40, 4 * MIB);
    e.samples.last_mut().unwrap().system = Some(pb::SystemMemory {
        mem_total_bytes: 16 * GIB,
        ..Default::default()
    });
    let d = diagnose(&e);
    let kinds: Vec<&str> = d.causes.iter().map(|c| c.kind.as_str()).collect();
    assert_eq!(kinds, ["host_growth"], "{:?}", d.causes);
    let c = &d.causes[0];
    assert!(
        c.evidence[0].starts_with("possible warm-up: the warm-up window ended at request 40"),
        "{:?}",
        c.evidence
    );
    assert_eq!(c.metrics["possible_warmup"], 1.0);
    assert!(c.confidence < 0.5, "{}", c.confidence);
    let got = c.metrics["bytes_per_request"];
    assert!(
        (got - (4 * MIB) as f64).abs() < 0.1 * (4 * MIB) as f64,
        "{got}"
    );
    for key in ["requests_to_limit", "seconds_to_limit", "limit_bytes"] {
        assert!(!c.metrics.contains_key(key), "{key}: {:?}", c.metrics);
    }
    assert!(
        !d.evidence.iter().any(|l| l.starts_with("runway")),
        "{:?}",
        d.evidence
    );
}
