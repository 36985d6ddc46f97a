//! A CPU-only Python agent: no allocator stats, so the heap census is the
//! live baseline and host RSS the proof. Evidence shaped like the reference
//! server's (agent-python): an `after_request` sample per request, a
//! `census` sample just before each HeapCensus event, the first census
//! listing only the largest types, GcCollection events by generation.

use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};
use oomscope_testkit::readings::host_reading;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const MS: i64 = 1_000_000;
/// One response's logits in the reference server's tests: 8 × 8000 float32.
const LOGITS: u64 = 8 * 8000 * 4;
/// torch.Tensor[cpu] bytes of the model's weights before any request.
const WEIGHTS: u64 = 9_768_960;
const RSS0: u64 = 520 * MIB;
const MEM_TOTAL: u64 = 16 * GIB;

/// What the server retains per request and how the host moves.
#[derive(Clone, Copy)]
struct Shape {
    requests: u64,
    census_every: u64,
    /// Bytes of torch.Tensor[cpu] kept per request (one tensor each).
    kept_bytes: u64,
    /// A response object (`__main__.Completion`) kept per request.
    kept_objects: bool,
    /// RSS growth per request beside arena noise.
    rss_per_request: u64,
    /// RSS jumps by this much at the first census (the scan's own lists).
    census_warm_up: u64,
}

const LEAKY: Shape = Shape {
    requests: 40,
    census_every: 10,
    kept_bytes: LOGITS,
    kept_objects: true,
    rss_per_request: 2 * LOGITS,
    census_warm_up: 5 * MIB,
};

/// A few pages now and then, as glibc arenas move: deterministic, up to 48 KiB.
fn arena_noise(i: u64) -> u64 {
    (i * 7919 % 13) * 4 * KIB
}

struct Run {
    samples: Vec<pb::Sample>,
    events: Vec<pb::Event>,
    t: i64,
    rss: u64,
}

impl Run {
    fn sample(&mut self, phase: &str, done: u64) {
        self.t += MS;
        self.samples
            .push(host_reading(self.t, 42, self.rss, MEM_TOTAL, phase, done));
    }

    fn event(&mut self, kind: Kind) {
        self.t += 80 * MS; // a census scan takes about this long
        self.events.push(pb::Event {
            time_ns: self.t,
            kind: Some(kind),
        });
    }

    fn census(&mut self, done: u64, kept: u64, s: Shape, first: bool, chain: &[&str]) {
        self.sample("census", done);
        let mut types = vec![
            tc(
                "torch.Tensor[cpu]",
                18 + kept,
                WEIGHTS + kept * s.kept_bytes,
            ),
            tc("dict", 15_984, 6_721_904),
            tc("function", 26_322, 3_579_792),
        ];
        // The first census has no baseline: it lists only the largest types.
        if s.kept_objects && !first && kept > 0 {
            types.push(tc("__main__.Completion", kept, 24 * kept));
        }
        self.event(Kind::HeapCensus(pb::HeapCensus {
            types,
            gc_gen2: 8,
            referrer_chain: chain.iter().map(|c| c.to_string()).collect(),
            ..Default::default()
        }));
    }
}

impl Run {
    /// A census the agent cut short: a third of the tensors, and its mark.
    fn census_partial(&mut self, done: u64) {
        self.sample("census", done);
        self.event(Kind::HeapCensus(pb::HeapCensus {
            types: vec![tc("torch.Tensor[cpu]", 6, WEIGHTS / 3)],
            referrer_chain: vec!["(partial census: the 250 ms budget ran out)".into()],
            ..Default::default()
        }));
    }
}

fn tc(name: &str, count: u64, bytes: u64) -> pb::TypeCount {
    pb::TypeCount {
        type_name: name.into(),
        count,
        bytes,
        ..Default::default()
    }
}

const CHAIN: &[&str] = &[
    "module __main__ global RESPONSE_LOG",
    "list[30] (40 items)",
    "__main__.Completion.logits",
    "torch.Tensor[cpu] torch.Size([8, 8000])",
];

/// `s.requests` requests, a census every `s.census_every`, kept objects
/// still held at the end.
fn serve(s: Shape) -> Run {
    let mut r = Run {
        samples: Vec::new(),
        events: Vec::new(),
        t: 61_000 * MS,
        rss: RSS0,
    };
    r.sample("load", 0);
    // The collection right after load (generation 0) frees the loader's garbage.
    r.event(Kind::Gc(pb::GcCollection {
        generation: 0,
        collected: 116,
        ..Default::default()
    }));
    for i in 1..=s.requests {
        r.rss = RSS0 + i * s.rss_per_request + arena_noise(i);
        if i > s.census_every {
            r.rss += s.census_warm_up;
        }
        r.sample("after_request", i);
        if i % s.census_every == 0 {
            let chain = if i > s.census_every && s.kept_bytes > 0 {
                CHAIN
            } else {
                &[]
            };
            r.census(
                i,
                if s.kept_bytes > 0 { i } else { 0 },
                s,
                i == s.census_every,
                chain,
            );
        }
    }
    r
}

fn evidence(r: Run) -> Evidence {
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(pb::Hello {
            agent_id: "py-leaky".into(),
            name: "leaky".into(),
            // The agent started with the process, which loaded its model
            // for a minute before serving: its warm-up window (the first
            // 30 s) ended before the first request (`warmup`).
            start_time_ns: r.samples.first().map_or(0, |s| s.time_ns) - 60_000 * MS,
            ..Default::default()
        }),
        samples: r.samples,
        events: r.events,
        incident: None,
    }
}

fn cause<'a>(d: &'a pb::Diagnosis, kind: &str) -> Option<&'a pb::Cause> {
    d.causes.iter().find(|c| c.kind == kind)
}

fn kinds(d: &pb::Diagnosis) -> Vec<&str> {
    d.causes.iter().map(|c| c.kind.as_str()).collect()
}

#[test]
fn a_cpu_leak_is_the_census_type_growing_per_request() {
    let run = serve(LEAKY);
    let last_rss = run.rss;
    let d = diagnose(&evidence(run));
    let leak = cause(&d, "leak").unwrap_or_else(|| panic!("{:?}", d.causes));
    assert_eq!(d.causes[0].kind, "leak", "{:?}", kinds(&d));
    // The census bytes are exact: the slope is the kept tensor, not RSS.
    assert_eq!(leak.metrics["bytes_per_request"], LOGITS as f64);
    assert_eq!(leak.metrics["retained_objects_per_request"], 1.0);
    assert_eq!(leak.metrics["requests_seen"], 30.0);
    assert!(leak.metrics["p_value"] < 1e-6, "{:?}", leak.metrics);
    let left = ((MEM_TOTAL - last_rss) as f64 / LOGITS as f64).floor();
    assert_eq!(leak.metrics["requests_to_limit"], left);
    let text = leak.evidence.join("\n");
    assert!(
        text.contains("Python heap's torch.Tensor[cpu] rose from 11.8 MiB to 19.1 MiB over 30 requests: 250.0 KiB per request"),
        "{text}"
    );
    assert!(text.contains("__main__.Completion +1.0"), "{text}");
    assert!(
        text.contains("held by module __main__ global RESPONSE_LOG -> list[30] (40 items)"),
        "{text}"
    );
    assert!(
        text.contains("host RSS between requests rose with it"),
        "{text}"
    );
    assert!(cause(&d, "gc_retained").is_none());
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
    assert!(d.domain.is_none());
    assert!(!d.fixes.is_empty());
}

#[test]
fn a_partial_census_is_left_out() {
    // The last census's budget ran out a third into the heap: its counts are
    // a part of it, not a fall.
    let mut run = serve(LEAKY);
    run.census_partial(40);
    let d = diagnose(&evidence(run));
    let leak = cause(&d, "leak").unwrap_or_else(|| panic!("{:?}", d.causes));
    assert_eq!(leak.metrics["bytes_per_request"], LOGITS as f64);
    assert_eq!(leak.metrics["requests_seen"], 30.0);
}

#[test]
fn cycles_freed_by_a_full_collection_are_gc_retained_not_a_leak() {
    let mut run = serve(LEAKY);
    // POST /admin/gc: a full collection, then a census with the weights only.
    run.event(Kind::Gc(pb::GcCollection {
        generation: 2,
        collected: 256,
        ..Default::default()
    }));
    run.rss -= 3 * MIB; // glibc keeps most freed pages: RSS barely moves
    run.census(40, 0, LEAKY, false, &[]);
    let d = diagnose(&evidence(run));
    assert_eq!(kinds(&d), ["gc_retained"]);
    let gc = &d.causes[0];
    assert_eq!(gc.metrics["bytes_per_request"], LOGITS as f64);
    assert_eq!(gc.metrics["reclaimed_bytes"], (40 * LOGITS) as f64);
    assert_eq!(gc.metrics["growth_bytes"], (30 * LOGITS) as f64);
    assert_eq!(gc.metrics["collected_objects"], 256.0);
    let text = gc.evidence.join("\n");
    assert!(
        text.contains("generation 2, 256 objects collected) then dropped torch.Tensor[cpu] from 19.1 MiB to 9.3 MiB"),
        "{text}"
    );
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
}

#[test]
fn a_collection_that_frees_nothing_leaves_the_leak() {
    let mut run = serve(LEAKY);
    run.event(Kind::Gc(pb::GcCollection {
        generation: 2,
        collected: 30,
        ..Default::default()
    }));
    run.census(40, 40, LEAKY, false, CHAIN);
    let d = diagnose(&evidence(run));
    assert!(cause(&d, "leak").is_some(), "{:?}", kinds(&d));
    assert!(cause(&d, "gc_retained").is_none(), "{:?}", kinds(&d));
}

#[test]
fn before_any_collection_garbage_cycles_look_like_a_leak() {
    // With automatic gc off nothing tells cycles from a leak yet; a full
    // collection with no census after it says nothing either way.
    let mut run = serve(LEAKY);
    run.event(Kind::Gc(pb::GcCollection {
        generation: 2,
        collected: 256,
        ..Default::default()
    }));
    let d = diagnose(&evidence(run));
    assert!(cause(&d, "leak").is_some(), "{:?}", kinds(&d));
    assert!(cause(&d, "gc_retained").is_none());
}

#[test]
fn host_growth_names_the_census_type() {
    let host_leak = Shape {
        kept_objects: false,
        ..LEAKY
    };
    let d = diagnose(&evidence(serve(host_leak)));
    let host = cause(&d, "host_growth").unwrap_or_else(|| panic!("{:?}", kinds(&d)));
    // RSS is what the host is charged: twice the copy here (Theil–Sen over
    // arena noise and the step at the first census: within 2%).
    let rss_slope = host.metrics["bytes_per_request"] / (2 * LOGITS) as f64;
    assert!((0.98..=1.02).contains(&rss_slope), "{:?}", host.metrics);
    assert_eq!(
        host.metrics["retained_type_bytes_per_request"],
        LOGITS as f64
    );
    let text = host.evidence.join("\n");
    assert!(
        text.contains("the heap census names the retaining type: torch.Tensor[cpu] grew 250.0 KiB per request ("),
        "{text}"
    );
    assert!(text.contains("no device allocator readings"), "{text}");
    // The same bytes are a leak of live objects on a CPU process.
    assert!(cause(&d, "leak").is_some());
}

#[test]
fn host_growth_on_a_gpu_server_names_the_census_type_and_is_no_device_leak() {
    let mut run = serve(Shape {
        kept_objects: false,
        ..LEAKY
    });
    for s in &mut run.samples {
        s.allocator = vec![pb::AllocatorStats {
            allocated_bytes: 2 * GIB,
            reserved_bytes: 2 * GIB,
            allocated_peak_bytes: 3 * GIB,
            ..Default::default()
        }];
    }
    let d = diagnose(&evidence(run));
    assert_eq!(kinds(&d), ["host_growth"]);
    let text = d.causes[0].evidence.join("\n");
    assert!(
        text.contains("device live bytes between requests stayed flat"),
        "{text}"
    );
    assert!(
        text.contains("torch.Tensor[cpu] grew 250.0 KiB per request"),
        "{text}"
    );
}

/// The run with its clock slowed `k` times: the same requests, `k` times
/// fewer a second.
fn slowed(mut r: Run, k: i64) -> Run {
    let t0 = r.samples.first().map_or(0, |s| s.time_ns);
    for t in r
        .samples
        .iter_mut()
        .map(|s| &mut s.time_ns)
        .chain(r.events.iter_mut().map(|e| &mut e.time_ns))
    {
        *t = t0 + (*t - t0) * k;
    }
    r
}

#[test]
fn a_clean_server_with_censuses_has_only_slow_growth_where_its_runway_is_long() {
    // RSS still creeps (the census's own lists, arenas), the census is flat:
    // certain growth, but a thousandth of a percent of MemTotal per request.
    // At about 111 requests a second that fills the 16 GiB in about 5 hours:
    // host growth to hunt, with its runway (runway::URGENT_RUNWAY_S), never a
    // leak. A thousand times slower it lasts months: slow growth with its
    // runway. Over 1,000 requests the creep adds up past the host's grain
    // (growth::MIN_HOST_GROWTH_BYTES); over 100 it would not.
    let clean = Shape {
        requests: 1000,
        kept_bytes: 0,
        kept_objects: false,
        rss_per_request: 8 * KIB,
        ..LEAKY
    };
    // Over the first 40 requests the first census's 5 MiB step is sixteen
    // times the creep: a settling series, no growth yet.
    let short = diagnose(&evidence(serve(Shape {
        requests: 40,
        ..clean
    })));
    assert_eq!(kinds(&short), Vec::<&str>::new(), "{:?}", short.causes);
    let fast = diagnose(&evidence(serve(clean)));
    assert_eq!(kinds(&fast), ["host_growth"], "{:?}", fast.causes);
    let hours = fast.causes[0].metrics["seconds_to_limit"] / 3_600.0;
    assert!((3.0..8.0).contains(&hours), "{hours} h");
    let run = slowed(serve(clean), 1_000);
    let last_rss = run.rss;
    let d = diagnose(&evidence(run));
    assert_eq!(kinds(&d), ["slow_growth"], "{:?}", d.causes);
    assert!(d.trigger.is_none(), "{:?}", d.trigger);
    let slow = &d.causes[0];
    let per_request = slow.metrics["bytes_per_request"];
    // 8 KiB a request plus the census's one 5 MiB step, spread by Theil–Sen.
    assert!(
        (8.0 * KIB as f64..=12.0 * KIB as f64).contains(&per_request),
        "{per_request}"
    );
    // The metric's bytes per request is rounded to a byte; the runway is not.
    let left = (MEM_TOTAL - last_rss) as f64 / per_request;
    let got = slow.metrics["requests_to_limit"];
    assert!(
        (got - left).abs() <= 1.0 + left * 0.5 / per_request,
        "{got} vs {left}"
    );
    assert!(slow.metrics["limit_share_per_request"] < 1e-5);
    assert!(
        slow.evidence[0].starts_with("runway: at "),
        "{:?}",
        slow.evidence
    );
    assert!(slow.evidence[0].contains("the 16.0 GiB of MemTotal is gone in about"));
    assert_eq!(
        d.evidence.first(),
        Some(&slow.evidence[0]),
        "the runway leads"
    );
}

#[test]
fn census_growth_below_the_minimum_effect_is_no_leak() {
    // 16 KiB per request: a real, exact rise, too small to be worth a verdict.
    let small = Shape {
        kept_bytes: 16 * KIB,
        rss_per_request: 64 * KIB,
        ..LEAKY
    };
    let d = diagnose(&evidence(serve(small)));
    assert!(cause(&d, "leak").is_none(), "{:?}", kinds(&d));
}

#[test]
fn census_growth_without_a_rising_host_is_not_significant() {
    // Four censuses alone cannot reach the leak's significance level.
    let mut run = serve(LEAKY);
    for (i, s) in run.samples.iter_mut().enumerate() {
        if let Some(p) = s.process.as_mut() {
            p.vm_rss_bytes = RSS0 + arena_noise(i as u64 * 31);
        }
    }
    let d = diagnose(&evidence(run));
    assert!(cause(&d, "leak").is_none(), "{:?}", kinds(&d));
    assert!(cause(&d, "host_growth").is_none(), "{:?}", kinds(&d));
}

#[test]
fn enough_censuses_are_significant_on_their_own() {
    // A census after every request: the censuses carry the trend test.
    let mut run = serve(Shape {
        census_every: 1,
        ..LEAKY
    });
    for s in &mut run.samples {
        s.process = None;
    }
    let d = diagnose(&evidence(run));
    let leak = cause(&d, "leak").unwrap_or_else(|| panic!("{:?}", kinds(&d)));
    assert_eq!(leak.metrics["bytes_per_request"], LOGITS as f64);
    assert!(
        leak.evidence
            .iter()
            .any(|l| l.contains("significant across 40 censuses")),
        "{:?}",
        leak.evidence
    );
}

#[test]
fn warm_up_growth_that_levels_off_is_no_leak() {
    // A cache of tensors filled over the first 15 requests, then full.
    let mut run = serve(LEAKY);
    for e in &mut run.events {
        if let Some(Kind::HeapCensus(h)) = e.kind.as_mut() {
            for t in &mut h.types {
                if t.type_name == "torch.Tensor[cpu]" {
                    t.bytes = t.bytes.min(WEIGHTS + 15 * LOGITS);
                }
            }
        }
    }
    let d = diagnose(&evidence(run));
    assert!(cause(&d, "leak").is_none(), "{:?}", kinds(&d));
}

/// A clean CPU server under load: each census catches the in-flight
/// requests' temporaries (KV caches, logits: 0 to 32 MiB of tensors), and
/// RSS creeps `creep` bytes per request on average as arenas grow and are
/// never given back, with a wobble on top.
fn noisy_clean(seed: u64, creep: f64) -> Evidence {
    let mut rng = Rng(seed);
    let mut r = Run {
        samples: Vec::new(),
        events: Vec::new(),
        t: 1_000 * MS,
        rss: RSS0,
    };
    let mut floor = RSS0 as f64;
    for i in 1..=40u64 {
        floor += 2.0 * creep * rng.unit();
        r.rss = (floor + 256.0 * KIB as f64 * rng.unit()) as u64;
        r.sample("after_request", i);
        if i % 10 == 0 {
            r.sample("census", i);
            let temporaries = (32.0 * MIB as f64 * rng.unit()) as u64;
            let count = 18 + (40.0 * rng.unit()) as u64;
            r.event(Kind::HeapCensus(pb::HeapCensus {
                types: vec![
                    tc("torch.Tensor[cpu]", count, WEIGHTS + temporaries),
                    tc("dict", 15_984 + (50.0 * rng.unit()) as u64, 6_721_904),
                ],
                ..Default::default()
            }));
        }
    }
    evidence(r)
}

#[test]
fn census_noise_is_almost_never_a_leak() {
    for creep in [16.0 * KIB as f64, 64.0 * KIB as f64, 256.0 * KIB as f64] {
        let verdicts = (0..1000u64)
            .filter(|&seed| {
                let d = diagnose(&noisy_clean(seed, creep));
                d.causes
                    .iter()
                    .any(|c| c.kind == "leak" || c.kind == "gc_retained")
            })
            .count();
        println!(
            "RSS creep {} KiB per request: {verdicts} of 1000 noise-only CPU timelines reported a leak",
            creep as u64 / KIB
        );
        assert!(verdicts <= 1, "creep {creep}: {verdicts} of 1000");
    }
}
