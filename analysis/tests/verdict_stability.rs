//! Verdicts as a leak hunt polls them: a growing series replayed through
//! `diagnose` as it arrives. Warm-up is no alarm (no runway at any poll), a
//! leak is named within 100 requests at 36 requests/s, a reported growth
//! keeps its kind while it grows and says when it stopped, a 1-in-10 leak
//! is judged over requests, and the runway's rate is the rate while serving.

use oomscope_analysis::pb;
use oomscope_analysis::{diagnose, Evidence};
use oomscope_testkit::readings::{host_reading, page_jitter as jitter};

const MIB: u64 = 1 << 20;
/// A 23.5 GiB host, as in the runs.
const MEM_TOTAL: u64 = 25_232_932_864;
const BASE_RSS: u64 = 500 * MIB;
const GROWTH_CAUSES: [&str; 3] = ["leak", "host_growth", "slow_growth"];

/// A request's end reading: the server's RSS after `done` requests.
fn after_request(t_ns: i64, done: u64, rss: u64) -> pb::Sample {
    reading(t_ns, done, rss, "after_request")
}

fn reading(t_ns: i64, done: u64, rss: u64, phase: &str) -> pb::Sample {
    host_reading(t_ns, 7, rss, MEM_TOTAL, phase, done)
}

/// One end reading a request at `per_s` requests a second, RSS from `rss`.
fn served(requests: u64, per_s: f64, rss: impl Fn(u64) -> u64) -> Evidence {
    let samples = (1..=requests)
        .map(|i| after_request((i as f64 * 1e9 / per_s) as i64, i, rss(i)))
        .collect();
    Evidence {
        hello: Some(pb::Hello {
            agent_id: "py".into(),
            name: "py".into(),
            ..Default::default()
        }),
        samples,
        ..Default::default()
    }
}

/// The evidence a poll after `done` requests sees.
fn poll(e: &Evidence, done: u64) -> Evidence {
    let mut cut = e.clone();
    cut.samples
        .retain(|s| s.context.as_ref().is_some_and(|c| c.requests_done <= done));
    cut
}

fn growth(d: &pb::Diagnosis) -> Vec<&pb::Cause> {
    d.causes
        .iter()
        .filter(|c| GROWTH_CAUSES.contains(&c.kind.as_str()))
        .collect()
}

fn has_runway(d: &pb::Diagnosis) -> bool {
    d.evidence.iter().any(|l| l.starts_with("runway: "))
        || d.causes.iter().any(|c| {
            c.metrics.contains_key("requests_to_limit")
                || c.metrics.contains_key("seconds_to_limit")
                || c.evidence.iter().any(|l| l.starts_with("runway: "))
        })
}

fn is_warm_up(c: &pb::Cause) -> bool {
    c.metrics.get("possible_warmup") == Some(&1.0)
        && c.evidence[0].starts_with("possible warm-up")
        && c.confidence < 0.5
}

#[test]
fn a_300_mb_warm_up_over_50_requests_then_flat_has_no_runway_at_any_poll() {
    let per_request = 6_000_000u64;
    let e = served(600, 36.0, |i| {
        BASE_RSS + per_request * i.min(50) + jitter(i)
    });
    let mut warned = 0;
    for done in (10..=600).step_by(10) {
        let d = diagnose(&poll(&e, done));
        assert!(!has_runway(&d), "request {done}: {d:#?}");
        let found = growth(&d);
        if done <= 50 {
            // Inside the window: named, at its size, as possible warm-up.
            assert_eq!(found.len(), 1, "request {done}: {:?}", d.causes);
            let c = found[0];
            assert_eq!(c.kind, "host_growth");
            assert!(is_warm_up(c), "request {done}: {c:?}");
            let got = c.metrics["bytes_per_request"];
            assert!(
                (got - per_request as f64).abs() < 0.01 * per_request as f64,
                "request {done}: {got}"
            );
            warned += 1;
        } else if done >= 100 {
            // Past the plateau: warm-up, no growth at all.
            assert!(found.is_empty(), "request {done}: {:?}", d.causes);
        } else {
            // Levelling off: nothing but the warm-up label.
            assert!(
                found.iter().all(|c| is_warm_up(c)),
                "request {done}: {found:?}"
            );
        }
    }
    assert_eq!(warned, 5);
}

#[test]
fn a_leak_at_36_requests_per_second_is_named_within_100_requests() {
    let per_request = 550_000u64;
    let e = served(100, 36.0, |i| BASE_RSS + per_request * i + jitter(i));
    let mut kinds = Vec::new();
    for done in (10..=100).step_by(10) {
        let d = diagnose(&poll(&e, done));
        let found = growth(&d);
        assert_eq!(found.len(), 1, "request {done}: {:?}", d.causes);
        let c = found[0];
        kinds.push(c.kind.clone());
        let got = c.metrics["bytes_per_request"];
        assert!(
            (got - per_request as f64).abs() < 0.01 * per_request as f64,
            "request {done}: {got}"
        );
        if done <= 50 {
            assert!(is_warm_up(c), "request {done}: {c:?}");
            assert!(!has_runway(&d), "request {done}: {d:#?}");
        }
    }
    assert!(kinds.iter().all(|k| k == "host_growth"), "{kinds:?}");
    // By request 100: its runway, at the rate while serving.
    let d = diagnose(&e);
    let c = growth(&d)[0];
    assert!(c.confidence >= 0.6, "{c:?}");
    let rate = c.metrics["requests_per_s"];
    assert!((rate - 36.0).abs() < 0.01, "{rate}");
    let last = BASE_RSS + per_request * 100 + jitter(100);
    let left = ((MEM_TOTAL - last) as f64 / c.metrics["bytes_per_request"]).floor();
    assert!(
        (c.metrics["requests_to_limit"] - left).abs() <= 1.0,
        "{:?}",
        c.metrics
    );
    let secs = c.metrics["seconds_to_limit"];
    assert!((secs - left / 36.0).abs() < 0.01 * secs, "{secs}");
    // About 44,800 requests: 21 minutes at 36 a second.
    assert!((1_100.0..1_300.0).contains(&secs), "{secs}");
    assert!(
        c.evidence[0].starts_with("runway: at 36 requests/s while serving, the 23.5 GiB of MemTotal is gone in about 21 minutes"),
        "{:?}",
        c.evidence
    );
    assert_eq!(d.evidence[0], c.evidence[0], "the runway leads");
}

/// The kinds of growth at each poll, point by point.
fn replay(e: &Evidence, polls: impl Iterator<Item = u64>) -> Vec<(u64, pb::Diagnosis)> {
    polls.map(|done| (done, diagnose(&poll(e, done)))).collect()
}

#[test]
fn a_growing_series_keeps_its_kind_while_it_grows_and_says_when_it_stopped() {
    let per_request = 550_000u64;
    let stop = 150u64;
    let e = served(300, 36.0, |i| {
        BASE_RSS + per_request * i.min(stop) + jitter(i)
    });
    let polls = replay(&e, 1..=300);
    let first = polls
        .iter()
        .position(|(_, d)| !growth(d).is_empty())
        .expect("the leak is reported");
    let kind = growth(&polls[first].1)[0].kind.clone();
    assert_eq!(kind, "host_growth");
    let mut stopped_from = None;
    for (done, d) in &polls[first..] {
        let found = growth(d);
        assert_eq!(found.len(), 1, "request {done}: {:?}", d.causes);
        let c = found[0];
        assert_eq!(c.kind, kind, "request {done}: the kind changed");
        let stopped = c.evidence[0].starts_with("the growth stopped");
        if *done <= stop {
            assert!(!stopped, "request {done}: {:?}", c.evidence);
            continue;
        }
        match stopped_from {
            // Once said, it stays said.
            Some(from) => assert!(stopped, "request {done} (stopped from {from}): {c:?}"),
            None if stopped => stopped_from = Some(*done),
            None => {}
        }
        if stopped {
            let at = c.metrics["stopped_at_request"];
            // The first reading at the plateau's level: the allocator's
            // scatter puts it a few requests late.
            assert!((at - stop as f64).abs() <= 5.0, "request {done}: {at}");
            assert!(
                c.evidence[0].starts_with(&format!("the growth stopped at about request {at} (")),
                "{:?}",
                c.evidence
            );
            assert!(
                !has_runway(d),
                "request {done}: a stopped growth has no runway"
            );
            // The growth it had: 550 kB a request.
            let got = c.metrics["bytes_per_request"];
            assert!((got - per_request as f64).abs() < 0.01 * per_request as f64);
        }
    }
    let from = stopped_from.expect("the stop is said");
    println!(
        "reported from request {}; stopped said from {from}",
        polls[first].0
    );
    assert!(from <= 2 * stop, "said only at {from}");
}

#[test]
fn a_one_in_ten_leak_is_judged_over_requests_not_per_request() {
    // 2 MiB kept by one request in ten (numpy arrays), 100 requests a second.
    let step = 2 * MIB;
    let e = served(250, 100.0, |i| BASE_RSS + step * (i / 10) + jitter(i));
    let polls = replay(&e, 1..=250);
    let past_warm_up = polls
        .iter()
        .position(|(_, d)| growth(d).iter().any(|c| !is_warm_up(c)))
        .expect("the leak is reported past warm-up");
    assert!(
        polls[past_warm_up].0 <= 100,
        "named at {}",
        polls[past_warm_up].0
    );
    for (done, d) in &polls[past_warm_up..] {
        let found = growth(d);
        assert_eq!(found.len(), 1, "request {done}: {:?}", d.causes);
        let c = found[0];
        assert_eq!(c.kind, "host_growth", "request {done}");
        assert!(!is_warm_up(c), "request {done}: {c:?}");
        // Per request over many: 2 MiB / 10.
        let got = c.metrics["bytes_per_request"];
        let want = step as f64 / 10.0;
        assert!((got - want).abs() < 0.05 * want, "request {done}: {got}");
        assert!(c.evidence[1].contains(" per request ("), "{:?}", c.evidence);
        let left = c.metrics["requests_to_limit"];
        assert!((c.metrics["seconds_to_limit"] - left / c.metrics["requests_per_s"]).abs() < 1e-6);
    }
    // Before it, inside the window: the same kind, as possible warm-up.
    // Once said, it stays said: the flat stretch between two steps takes
    // nothing back (it once went quiet at requests 28 and 29).
    let said = polls
        .iter()
        .position(|(_, d)| !growth(d).is_empty())
        .expect("said inside the window");
    let quiet: Vec<u64> = polls[said..]
        .iter()
        .filter(|(_, d)| growth(d).is_empty())
        .map(|(n, _)| *n)
        .collect();
    assert!(quiet.is_empty(), "quiet again at requests {quiet:?}");
    assert!(polls[said].0 <= 30, "first said at {}", polls[said].0);
    for (done, d) in &polls[..past_warm_up] {
        assert!(
            growth(d)
                .iter()
                .all(|c| c.kind == "host_growth" && is_warm_up(c)),
            "request {done}"
        );
        assert!(!has_runway(d), "request {done}");
    }
}

/// 100 requests at 36/s, an hour idle with a periodic reading every 10 s,
/// 100 more at 36/s; 550 kB kept a request.
fn bursts() -> Evidence {
    let per_request = 550_000u64;
    let gap = 1e9 / 36.0;
    let mut samples = Vec::new();
    for i in 1..=100u64 {
        samples.push(after_request(
            (i as f64 * gap) as i64,
            i,
            BASE_RSS + per_request * i + jitter(i),
        ));
    }
    let idle_from = (100.0 * gap) as i64;
    let idle_rss = BASE_RSS + per_request * 100 + jitter(100);
    for k in 1..=360i64 {
        samples.push(reading(
            idle_from + k * 10_000_000_000,
            100,
            idle_rss,
            "periodic",
        ));
    }
    let back = idle_from + 3_600_000_000_000;
    for i in 101..=200u64 {
        let t = back + ((i - 100) as f64 * gap) as i64;
        samples.push(after_request(t, i, BASE_RSS + per_request * i + jitter(i)));
    }
    Evidence {
        samples,
        ..Default::default()
    }
}

#[test]
fn a_burst_an_idle_hour_and_a_burst_get_the_runway_at_the_serving_rate() {
    let e = bursts();
    let d = diagnose(&e);
    let found = growth(&d);
    assert_eq!(found.len(), 1, "{:?}", d.causes);
    let c = found[0];
    assert_eq!(c.kind, "host_growth");
    // 199 requests over the 199 gaps of 1/36 s that were serving.
    let rate = c.metrics["requests_per_s"];
    assert!((rate - 36.0).abs() < 0.01, "{rate}");
    let left = c.metrics["requests_to_limit"];
    let secs = c.metrics["seconds_to_limit"];
    assert!(
        (secs - left / 36.0).abs() < 1e-3 * secs,
        "{secs} for {left}"
    );
    // Averaged over the idle hour the rate would be 199 / 3605.5 s.
    let averaged = left / (199.0 / 3605.5);
    assert!(averaged > 600.0 * secs, "{averaged} against {secs}");
    assert!(
        c.evidence[0].starts_with("runway: at 36 requests/s while serving, "),
        "{:?}",
        c.evidence
    );
    assert!(
        c.evidence.iter().any(|l| l.starts_with(
            "the runway's rate is 36 requests/s while serving: 199 requests completed over 5.5 s of serving; 60 minutes idle"
        )),
        "{:?}",
        c.evidence
    );
}

#[test]
fn think_time_between_requests_stays_in_the_serving_rate() {
    // A request every 5 s (a person reading each reply), with a periodic
    // reading every second between them: all of it is serving.
    let mut samples = Vec::new();
    for i in 1..=200u64 {
        let t = i as i64 * 5_000_000_000;
        let rss = BASE_RSS + 550_000 * i + jitter(i);
        samples.push(after_request(t, i, rss));
        for k in 1..=4 {
            samples.push(reading(t + k * 1_000_000_000, i, rss, "periodic"));
        }
    }
    let d = diagnose(&Evidence {
        samples,
        ..Default::default()
    });
    let c = growth(&d)[0];
    let rate = c.metrics["requests_per_s"];
    assert!((rate - 0.2).abs() < 1e-6, "{rate}");
    assert!(
        c.evidence[0].starts_with("runway: at 12.0 requests/min while serving"),
        "{:?}",
        c.evidence
    );
    assert!(
        !c.evidence.iter().any(|l| l.contains("idle (no request")),
        "{:?}",
        c.evidence
    );
}

/// The 550 kB/request leak with a heap census every 10 requests naming
/// the kept tensors (a CPU server: the census's type is the leak).
fn census_leak(requests: u64) -> Evidence {
    let per_request = 550_000u64;
    let mut e = served(requests, 36.0, |i| BASE_RSS + per_request * i + jitter(i));
    let censuses: Vec<(i64, u64)> = e
        .samples
        .iter()
        .filter_map(|s| Some((s.time_ns, s.context.as_ref()?.requests_done)))
        .filter(|(_, done)| done % 10 == 0)
        .collect();
    for (t, done) in censuses {
        e.events.push(pb::Event {
            time_ns: t + 1_000_000,
            kind: Some(pb::event::Kind::HeapCensus(pb::HeapCensus {
                types: vec![pb::TypeCount {
                    type_name: "torch.Tensor[cpu]".into(),
                    count: 18 + done,
                    bytes: 9_768_960 + per_request * done,
                    ..Default::default()
                }],
                referrer_chain: vec!["module __main__ global keep".into(), "list".into()],
                ..Default::default()
            })),
        });
    }
    e
}

#[test]
fn a_census_leak_inside_the_window_is_possible_warm_up_and_past_it_has_its_runway() {
    let d = diagnose(&census_leak(40));
    let leak = d.causes.iter().find(|c| c.kind == "leak");
    let leak = leak.unwrap_or_else(|| panic!("{:?}", d.causes));
    assert!(is_warm_up(leak), "{leak:?}");
    assert!(!has_runway(&d), "{d:#?}");
    assert_eq!(leak.metrics["retained_type_bytes_per_request"], 550_000.0);
    let d = diagnose(&census_leak(100));
    let leak = d.causes.iter().find(|c| c.kind == "leak").expect("leak");
    assert!(!is_warm_up(leak) && leak.confidence >= 0.75, "{leak:?}");
    assert_eq!(leak.metrics["retained_type_bytes_per_request"], 550_000.0);
    assert!(
        leak.evidence[0].starts_with("runway: at 36 requests/s while serving"),
        "{:?}",
        leak.evidence
    );
    let left = leak.metrics["requests_to_limit"];
    assert!((leak.metrics["seconds_to_limit"] - left / 36.0).abs() < 1e-3 * left);
}

/// A device leak: live bytes between requests rise 8 MiB a request for
/// `grows` requests at 36/s, then stay flat.
fn device_leak(requests: u64, grows: u64) -> Evidence {
    let mut e = served(requests, 36.0, |i| BASE_RSS + jitter(i));
    for s in &mut e.samples {
        let done = s.context.as_ref().map_or(0, |c| c.requests_done);
        let live = (2u64 << 30) + 8 * MIB * done.min(grows);
        s.allocator = vec![pb::AllocatorStats {
            allocated_bytes: live,
            allocated_peak_bytes: live,
            reserved_bytes: live + 64 * MIB,
            ..Default::default()
        }];
    }
    e
}

#[test]
fn a_device_leak_has_no_warm_up_window_and_says_when_it_stopped() {
    // Inside the first 50 requests: a leak, not possible warm-up.
    let d = diagnose(&device_leak(40, 40));
    let leak = d.causes.iter().find(|c| c.kind == "leak").expect("leak");
    assert!(!is_warm_up(leak) && leak.confidence >= 0.75, "{leak:?}");
    assert_eq!(leak.metrics["bytes_per_request"], (8 * MIB) as f64);
    // Grown for 100 requests, then flat for 100: the same kind, stopped.
    let d = diagnose(&device_leak(200, 100));
    let leak = d.causes.iter().find(|c| c.kind == "leak").expect("leak");
    assert!(
        leak.evidence[0].starts_with("the growth stopped at about request 100 ("),
        "{:?}",
        leak.evidence
    );
    assert_eq!(leak.metrics["stopped_at_request"], 100.0);
    assert_eq!(leak.metrics["bytes_per_request"], (8 * MIB) as f64);
    assert!(!has_runway(&d), "{d:#?}");
    // A shorter rise that levelled off is read as before: no leak.
    let d = diagnose(&device_leak(200, 30));
    assert!(d.causes.iter().all(|c| c.kind != "leak"), "{:?}", d.causes);
}
