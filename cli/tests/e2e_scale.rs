//! A collector holding a long history (issue #14): an agent with 200k
//! real-size samples (the allocator counters of a real H200 capture, 250 ms
//! apart: 14 hours), seeded through the store's own writer, then every
//! reading verb through a real `oomscope collector` over loopback. The
//! collector's RSS is read from its /proc status throughout; each verb's
//! time is printed (BENCHMARKS.md records them), never asserted, except a
//! loose bound on `agents` answering beside a heavy timeline.
//!
//! `OOMSCOPE_SCALE_SAMPLES` changes the count (for a quick local run), and
//! `OOMSCOPE_SCALE_DB=PATH` seeds the store there and keeps it (to time
//! another build's verbs on the same history by hand).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bin, fixture, Collector};
use oomscope_collector::store::Store;
use oomscope_proto::v1 as pb;
use oomscope_replay::capture;
use pb::agent_message::Body;

const DEFAULT_SAMPLES: u64 = 200_000;
const INTERVAL_NS: i64 = 250_000_000;
const AGENT: &str = "scale";
/// The bound on the collector's memory, whatever the history.
const RSS_LIMIT_BYTES: u64 = 300 << 20;

fn samples_wanted() -> u64 {
    std::env::var("OOMSCOPE_SCALE_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_SAMPLES)
}

/// Seeds `n` samples ending now (the capture's samples in a loop, each
/// re-timed), returning the time of the first and of the last.
fn seed(db: &Path, n: u64) -> (i64, i64, Vec<pb::Sample>) {
    let cap = capture::load(&fixture("leak_retained.json"), 0).unwrap();
    let looped: Vec<pb::Sample> = cap
        .samples()
        .filter(|s| !s.allocator.is_empty())
        .cloned()
        .collect();
    assert!(!looped.is_empty(), "the capture has allocator samples");
    let size = pb::AgentMessage {
        seq: 1,
        body: Some(Body::Sample(looped[0].clone())),
    };
    println!(
        "a seeded sample is {} bytes encoded ({} allocator counters)",
        prost::Message::encoded_len(&size),
        looped[0].allocator[0].raw.len()
    );
    let last = oomscope_proto::now_ns();
    let first = last - (n as i64 - 1) * INTERVAL_NS;
    let mut store = Store::open(db).unwrap();
    let hello = pb::Hello {
        agent_id: "scale-agent".into(),
        name: AGENT.into(),
        ..cap.hello
    };
    store.upsert_agent(&hello, first).unwrap();
    // One batch of the capture's samples in a loop, re-timed and re-numbered
    // in place for each insert (cloning 200k dicts would be most of the time).
    let per_batch = (1000 / looped.len()).max(1) as u64 * looped.len() as u64;
    let mut batch: Vec<pb::AgentMessage> = (0..per_batch)
        .map(|i| pb::AgentMessage {
            seq: 0,
            body: Some(Body::Sample(looped[i as usize % looped.len()].clone())),
        })
        .collect();
    for start in (0..n).step_by(per_batch as usize) {
        let len = per_batch.min(n - start) as usize;
        for (k, msg) in batch[..len].iter_mut().enumerate() {
            let i = start + k as u64;
            msg.seq = i + 1;
            if let Some(Body::Sample(s)) = &mut msg.body {
                s.time_ns = first + i as i64 * INTERVAL_NS;
            }
        }
        store.insert_batch("scale-agent", &batch[..len]).unwrap();
    }
    store
        .set_state("scale-agent", "disconnected", last)
        .unwrap();
    (first, last, looped)
}

/// The highest VmRSS of `pid` seen while it runs (polled every 20 ms).
struct RssWatch {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssWatch {
    fn start(pid: u32) -> RssWatch {
        let peak = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(rss) = vm_rss(pid) {
                    p.fetch_max(rss, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        RssWatch {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn vm_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Runs `oomscope ARGS --collector URL`, printing its time and the
/// collector's peak RSS so far; fails the test when the verb fails.
fn verb(col: &Collector, watch: &RssWatch, args: &[&str]) -> Output {
    let started = Instant::now();
    let out = Command::new(bin())
        .args(args)
        .args(["--collector", &col.url])
        .env_remove("OOMSCOPE_COLLECTOR")
        .output()
        .unwrap();
    println!(
        "oomscope {:<40} {:>8.3} s   collector peak RSS {:>4} MiB",
        args.join(" "),
        started.elapsed().as_secs_f64(),
        watch.peak() >> 20
    );
    assert!(
        out.status.success(),
        "oomscope {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn times(timeline: &serde_json::Value) -> Vec<i64> {
    timeline["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sample"]["time_ns"].as_i64().unwrap())
        .collect()
}

#[test]
fn every_verb_answers_on_a_long_history_with_bounded_memory() {
    let n = samples_wanted();
    let dir = tempfile::tempdir().unwrap();
    let db = match std::env::var_os("OOMSCOPE_SCALE_DB") {
        Some(path) => path.into(),
        None => dir.path().join("scale.db"),
    };
    let started = Instant::now();
    let (first, last, looped) = seed(&db, n);
    println!(
        "seeded {n} samples in {:.1} s; the store is {} MiB",
        started.elapsed().as_secs_f64(),
        std::fs::metadata(&db).unwrap().len() >> 20
    );
    let col = Collector::start(&db);
    let pid = col.child.as_ref().unwrap().id();
    let watch = RssWatch::start(pid);

    // The whole history, thinned: its ends are kept, and the newest sample's
    // figures are the ones seeded.
    let t = json(&verb(&col, &watch, &["timeline", AGENT, "--json"]));
    let ts = times(&t);
    assert!(ts.len() <= 200 && ts.len() >= 100, "{} samples", ts.len());
    assert_eq!((ts[0], *ts.last().unwrap()), (first, last));
    let newest = &looped[(n as usize - 1) % looped.len()].allocator[0];
    let shown = t["samples"].as_array().unwrap().last().unwrap();
    let shown = &shown["sample"]["allocator"][0];
    assert_eq!(shown["allocated_bytes"], newest.allocated_bytes);
    assert_eq!(shown["reserved_bytes"], newest.reserved_bytes);
    // Each point carries its stretch's lowest and highest (the rollups), so
    // the capture's extremes, which every stretch repeats, are all drawn
    // though few of the points themselves hold them. (The newest point
    // stands for itself alone.)
    let points = &t["samples"].as_array().unwrap()[..ts.len() - 1];
    let figure = |p: &serde_json::Value, key: &str| {
        p[key]["allocator"][0]["allocated_bytes"].as_u64().unwrap()
    };
    let (lo, hi) = looped.iter().fold((u64::MAX, 0), |(lo, hi), s| {
        let a = s.allocator[0].allocated_bytes;
        (lo.min(a), hi.max(a))
    });
    assert!(
        points
            .iter()
            .all(|p| figure(p, "low") == lo && figure(p, "high") == hi),
        "every point's envelope spans the capture's {lo}..{hi}: {:.2000}",
        serde_json::to_string(&points[..3]).unwrap()
    );
    let on_points = points
        .iter()
        .filter(|p| p["sample"]["allocator"][0]["allocated_bytes"].as_u64() == Some(hi))
        .count();
    println!(
        "{} of {} points hold the peak themselves; every envelope holds it",
        on_points,
        points.len()
    );

    // The newest ten minutes only, in full: every sample in the window.
    let asked = oomscope_proto::now_ns();
    let t = json(&verb(
        &col,
        &watch,
        &[
            "timeline",
            AGENT,
            "--since",
            "10m",
            "--max-points",
            "0",
            "--json",
        ],
    ));
    let ts = times(&t);
    let window_from = asked - 600_000_000_000;
    let in_window = (last - window_from.max(first)) / INTERVAL_NS;
    assert!(ts.iter().all(|&t| t >= window_from), "only the window");
    assert!(
        (ts.len() as i64 - in_window).abs() <= 4 * 20,
        "{} samples for a window holding ~{in_window}",
        ts.len()
    );
    assert_eq!(*ts.last().unwrap(), last);

    // The analysis reads the newest window at full resolution and says where it starts.
    let d = json(&verb(
        &col,
        &watch,
        &["diagnose", "--agent", AGENT, "--json"],
    ));
    let text = d.to_string();
    let window = 20_000i64.min(n as i64);
    let note = format!(
        "read the newest {window} samples in full, from {}, and {} earlier ones thinned evenly from {}",
        oomscope_analysis::units::time(first + (n as i64 - window) * INTERVAL_NS),
        2_000.min(n as i64 - window),
        oomscope_analysis::units::time(first),
    );
    assert!(n <= 20_000 || text.contains(&note), "{note}: {text:.3000}");

    let page = dir.path().join("scale.html");
    verb(
        &col,
        &watch,
        &["report", "--agent", AGENT, "--html", page.to_str().unwrap()],
    );
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains(AGENT) && html.contains("<svg"),
        "a page with charts"
    );
    println!("report page: {} KiB", html.len() >> 10);

    let c = json(&verb(&col, &watch, &["compare", AGENT, AGENT, "--json"]));
    assert!(c.get("outcome").is_some(), "{c}");

    // Everything, unthinned as asked: the reply stays under the gRPC limit
    // (the collector thins it to fit and keeps both ends).
    let t = json(&verb(
        &col,
        &watch,
        &["timeline", AGENT, "--max-points", "0", "--json"],
    ));
    let ts = times(&t);
    assert_eq!((ts[0], *ts.last().unwrap()), (first, last));
    assert!(
        ts.windows(2).all(|w| w[0] < w[1]),
        "oldest first, no repeats"
    );
    println!("timeline --max-points 0 returned {} samples", ts.len());

    // `agents` beside the heaviest timeline: it does not wait for it.
    let heavy = Command::new(bin())
        .args(["timeline", AGENT, "--max-points", "0", "--json"])
        .args(["--collector", &col.url])
        .env_remove("OOMSCOPE_COLLECTOR")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    let a = json(&verb(&col, &watch, &["agents", "--json"]));
    let beside = started.elapsed();
    let mut heavy = heavy;
    let still_running = heavy.try_wait().unwrap().is_none();
    assert!(heavy.wait().unwrap().success());
    println!(
        "agents answered in {:.3} s beside a full timeline (still running when it answered: {still_running})",
        beside.as_secs_f64()
    );
    assert_eq!(a[0]["samples"], n, "{a}");
    assert!(beside < Duration::from_secs(2), "agents waited {beside:?}");

    let peak = watch.peak();
    println!("collector peak RSS over every verb: {} MiB", peak >> 20);
    assert!(
        peak > 0 && peak < RSS_LIMIT_BYTES,
        "the collector's RSS reached {} MiB",
        peak >> 20
    );
}
