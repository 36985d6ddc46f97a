//! `oomscope report` on replayed H200 captures: the HTML page rendered in
//! headless Chromium (Debian's `chromium`; `scripts/setup-chromium` installs
//! it) must not be blank and must hold the verdict and the numbers of the
//! stored timeline; the Markdown form must hold the same numbers.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use oomscope_analysis::units::bytes_short;
use oomscope_proto::v1 as pb;
use serde_json::Value;

const CHROMIUM: &str = "/usr/bin/chromium";
/// The allocated line's and the OOM marker's colours (report/domains.rs, chart.rs).
const ALLOCATED_RGB: [u8; 3] = [0x1f, 0x77, 0xb4];
const OOM_RGB: [u8; 3] = [0xd6, 0x27, 0x28];

fn the_oom(t: &pb::TimelineResponse) -> pb::Oom {
    t.events
        .iter()
        .find_map(|e| match e.event.as_ref()?.kind.as_ref()? {
            pb::event::Kind::Oom(o) => Some(o.clone()),
            _ => None,
        })
        .expect("an OOM event")
}

fn report(col: &Collector, args: &[&str]) -> std::process::Output {
    oomscope()
        .arg("report")
        .args(args)
        .args(["--collector", &col.url])
        .output()
        .unwrap()
}

fn write_html(col: &Collector, dir: &Path, args: &[&str]) -> PathBuf {
    let page = dir.join("report.html");
    let mut all = args.to_vec();
    all.extend(["--html", page.to_str().unwrap()]);
    let out = report(col, &all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    page
}

fn markdown(col: &Collector, args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.push("--md");
    let out = report(col, &all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs headless Chromium on the page with `extra` args; returns its stdout.
fn chromium(page: &Path, extra: &[String]) -> Vec<u8> {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: run scripts/setup-chromium (scripts/test does)"
    );
    let profile = tempdir();
    let mut child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,2000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "chromium exited with {status}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium took more than 90 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    reader.join().unwrap()
}

/// An 8-bit RGB or RGBA PNG decoded to RGB pixels (what Chromium writes).
/// Small on purpose: zlib via flate2, the five scanline filters, no interlace.
fn decode_png(data: &[u8]) -> (usize, usize, Vec<[u8; 3]>) {
    assert_eq!(&data[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let (mut w, mut h, mut channels) = (0usize, 0usize, 0usize);
    let mut idat = Vec::new();
    let mut i = 8;
    while i + 8 <= data.len() {
        let len = u32::from_be_bytes(data[i..i + 4].try_into().unwrap()) as usize;
        let kind = &data[i + 4..i + 8];
        let body = &data[i + 8..i + 8 + len];
        match kind {
            b"IHDR" => {
                w = u32::from_be_bytes(body[0..4].try_into().unwrap()) as usize;
                h = u32::from_be_bytes(body[4..8].try_into().unwrap()) as usize;
                assert_eq!(body[8], 8, "8-bit depth");
                channels = match body[9] {
                    2 => 3,
                    6 => 4,
                    t => panic!("PNG colour type {t} not handled"),
                };
                assert_eq!(body[12], 0, "not interlaced");
            }
            b"IDAT" => idat.extend_from_slice(body),
            b"IEND" => break,
            _ => {}
        }
        i += 12 + len;
    }
    let mut raw = Vec::new();
    flate2::read::ZlibDecoder::new(&idat[..])
        .read_to_end(&mut raw)
        .unwrap();
    let stride = w * channels;
    assert_eq!(raw.len(), h * (stride + 1), "scanline bytes");
    let mut img = vec![0u8; h * stride];
    for y in 0..h {
        let filter = raw[y * (stride + 1)];
        let line = &raw[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
        for x in 0..stride {
            let a = if x >= channels {
                img[y * stride + x - channels] as i32
            } else {
                0
            };
            let b = if y > 0 {
                img[(y - 1) * stride + x] as i32
            } else {
                0
            };
            let c = if x >= channels && y > 0 {
                img[(y - 1) * stride + x - channels] as i32
            } else {
                0
            };
            let pred = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => (a + b) / 2,
                4 => {
                    let p = a + b - c;
                    let (pa, pb, pc) = ((p - a).abs(), (p - b).abs(), (p - c).abs());
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                f => panic!("PNG filter {f}"),
            };
            img[y * stride + x] = (line[x] as i32 + pred) as u8;
        }
    }
    let px = img.chunks(channels).map(|p| [p[0], p[1], p[2]]).collect();
    (w, h, px)
}

fn near(p: [u8; 3], q: [u8; 3]) -> bool {
    p.iter()
        .zip(q)
        .all(|(a, b)| (*a as i32 - b as i32).abs() <= 12)
}

/// The cells of one memory-table row in the dumped DOM: `data-bytes` or "—".
fn row_cells(dom: &str, row: &str) -> Vec<Option<u64>> {
    let start = dom
        .find(&format!("<tr data-row=\"{row}\""))
        .unwrap_or_else(|| panic!("row {row} in the DOM"));
    let end = start + dom[start..].find("</tr>").unwrap();
    dom[start..end]
        .split("<td")
        .skip(1)
        .map(|cell| {
            cell.split("data-bytes=\"")
                .nth(1)
                .map(|rest| rest[..rest.find('"').unwrap()].parse().unwrap())
        })
        .collect()
}

#[test]
fn fragmentation_report_renders_with_its_verdict_and_numbers() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    replay(&col, &fixture("fragmentation_oom.json"), "frag");
    let t = timeline(&col.url, "frag");
    let oom = the_oom(&t);
    let stats = oom.stats.clone().unwrap();
    let diagnosis = col.json(&["diagnose", "--agent", "frag"]);
    let domain = diagnosis["domain"].as_str().unwrap().to_string();
    let cause = diagnosis["causes"][0]["kind"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert_eq!(domain, "gpu_vram");

    let page = write_html(&col, tmp.path(), &["--agent", "frag"]);
    let html = std::fs::read_to_string(&page).unwrap();
    // Self-contained: nothing to fetch, nothing to run.
    for banned in [
        "<script", "<link", "<img", "src=", "url(", "@import", "<iframe",
    ] {
        assert!(!html.contains(banned), "the page holds {banned}");
    }
    assert!(html.contains("Content-Security-Policy"));

    let dom = String::from_utf8(chromium(&page, &["--dump-dom".into()])).unwrap();
    let root = &dom[dom.find("<html").unwrap()..];
    let root = &root[..root.find('>').unwrap()];
    assert!(
        root.contains(&format!("data-domain=\"{domain}\"")),
        "{root}"
    );
    assert!(root.contains(&format!("data-cause=\"{cause}\"")), "{root}");
    // The requested bytes and allocated-at-failure, exact and for people.
    assert_eq!(oom.requested_bytes, 100_663_296);
    for n in [oom.requested_bytes, stats.allocated_bytes] {
        assert!(dom.contains(&n.to_string()), "{n} in the DOM");
        assert!(
            dom.contains(&bytes_short(n)),
            "{} in the DOM",
            bytes_short(n)
        );
    }
    // The memory table at failure: the OOM's own reading.
    assert_eq!(row_cells(&dom, "allocated")[2], Some(stats.allocated_bytes));
    assert_eq!(
        row_cells(&dom, "cached")[2],
        Some(stats.reserved_bytes - stats.allocated_bytes)
    );
    assert_eq!(
        row_cells(&dom, "fragments")[2],
        Some(stats.inactive_split_bytes)
    );
    assert_eq!(row_cells(&dom, "fragments")[2], Some(1200 << 20));
    // Before load: the first sample (nothing allocated yet); no load recorded.
    let first = t.samples[0].sample.as_ref().unwrap().allocator[0].clone();
    assert_eq!(row_cells(&dom, "allocated")[0], Some(first.allocated_bytes));
    assert_eq!(row_cells(&dom, "allocated")[1], None);
    assert!(dom.contains("data-chart=\"gpu0\""));
    assert!(dom.contains("data-series=\"allocated\""));
    assert!(dom.contains("class=\"marker-oom\""));
    // The error text, escaped and whole.
    assert!(dom.contains("Tried to allocate 96.00 MiB"));

    // The screenshot shows a page, a chart's line and the OOM marker.
    let png = tmp.path().join("report.png");
    chromium(&page, &[format!("--screenshot={}", png.display())]);
    let (w, h, px) = decode_png(&std::fs::read(&png).unwrap());
    assert_eq!((w, h), (1280, 2000));
    let non_white = px.iter().filter(|p| p.iter().any(|&c| c < 235)).count();
    let fraction = non_white as f64 / px.len() as f64;
    assert!(
        fraction > 0.02,
        "only {:.2}% of the screenshot is not white",
        fraction * 100.0
    );
    let mut colours: Vec<[u8; 3]> = px.clone();
    colours.sort_unstable();
    colours.dedup();
    assert!(colours.len() > 20, "{} distinct colours", colours.len());
    assert!(
        px.iter().any(|p| near(*p, ALLOCATED_RGB)),
        "the allocated line is drawn"
    );
    assert!(
        px.iter().any(|p| near(*p, OOM_RGB)),
        "the OOM marker is drawn"
    );
}

#[test]
fn markdown_report_has_the_same_numbers() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    replay(&col, &fixture("fragmentation_oom.json"), "frag");
    let t = timeline(&col.url, "frag");
    let oom = the_oom(&t);
    let stats = oom.stats.clone().unwrap();
    let incidents = col.json(&["incidents"]);
    let id = incidents[0]["id"].as_str().unwrap().to_string();
    let diagnosis: Value = col.json(&["diagnose", &id]);

    let md = markdown(&col, &[&id]);
    assert!(md.contains(&format!("domain={}", diagnosis["domain"].as_str().unwrap())));
    for n in [oom.requested_bytes, stats.allocated_bytes] {
        assert!(md.contains(&n.to_string()), "{n} in the Markdown:\n{md}");
    }
    let cached = bytes_short(stats.reserved_bytes - stats.allocated_bytes);
    let row = md
        .lines()
        .find(|l| l.starts_with("| cached |"))
        .expect("the cached row");
    assert_eq!(row, format!("| cached | 0 B | — | {cached} |"));
    assert!(md.contains(&format!("gpu_vram: {}", "GPU memory (VRAM)")));
    for f in diagnosis["fixes"].as_array().unwrap() {
        let action = f["action"].as_str().unwrap();
        let first_word = action.split_whitespace().next().unwrap_or("");
        assert!(md.contains(first_word), "fix {action} in the Markdown");
    }
    // The latest incident is the default, and it is this one.
    assert_eq!(markdown(&col, &[]), md);
}

#[test]
fn kv_report_splits_live_memory_into_weights_kv_and_the_rest() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // A hostile name: it must come out as text, never as markup.
    let name = "kv<b>bold</b>&\"q\"";
    replay(&col, &fixture("kv_concurrency_oom.json"), name);
    let t = timeline(&col.url, name);
    let oom = the_oom(&t);
    let stats = oom.stats.clone().unwrap();
    let ctx = oom.context.clone().unwrap();
    let weights = t.samples[0]
        .sample
        .as_ref()
        .unwrap()
        .context
        .as_ref()
        .unwrap()
        .weight_bytes;
    assert_eq!(weights, 1 << 30);
    assert!(ctx.kv_cache_bytes > 0);

    let page = write_html(&col, tmp.path(), &["--agent", name]);
    let dom = String::from_utf8(chromium(&page, &["--dump-dom".into()])).unwrap();
    assert!(!dom.contains("<b>bold</b>"), "the agent name became markup");
    assert!(
        dom.contains("kv&lt;b&gt;bold&lt;/b&gt;&amp;"),
        "the name is shown as text"
    );
    let at_failure = |row: &str| row_cells(&dom, row)[2];
    assert_eq!(at_failure("weights"), Some(weights));
    assert_eq!(at_failure("kv"), Some(ctx.kv_cache_bytes));
    assert_eq!(
        at_failure("other_live"),
        Some(stats.allocated_bytes - weights - ctx.kv_cache_bytes)
    );
    // After load: the first sample that reports weights.
    let after = t.samples[0].sample.as_ref().unwrap().allocator[0].allocated_bytes;
    assert_eq!(row_cells(&dom, "allocated")[1], Some(after));
    assert!(dom.contains("data-series=\"KV cache\""));
}

#[test]
fn a_timeline_without_failure_reports_its_latest_reading() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    replay(&col, &fixture("leak_retained.json"), "leak");
    let t = timeline(&col.url, "leak");
    let last = t.samples.last().unwrap().sample.as_ref().unwrap().allocator[0].clone();

    let page = write_html(&col, tmp.path(), &["--agent", "leak"]);
    let html = std::fs::read_to_string(&page).unwrap();
    let root = &html[html.find("<html").unwrap()..];
    let root = &root[..root.find('>').unwrap()];
    assert!(root.contains("data-domain=\"\""), "nothing failed: {root}");
    assert_eq!(row_cells(&html, "allocated")[2], Some(last.allocated_bytes));
    assert!(html.contains("latest"));
    assert!(!html.contains("class=\"marker-oom\""));
    // Requests are marked on the chart.
    assert!(html.contains("class=\"marker-request\""));

    let md = markdown(&col, &["--agent", "leak"]);
    assert!(md.contains("none: nothing failed"), "{md}");

    // Bad input: a clear error.
    let out = report(&col, &["no-such-incident", "--md"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no incident \"no-such-incident\""), "{err}");
    let out = report(&col, &["--agent", "leak"]);
    assert!(!out.status.success(), "a form must be chosen");
}
