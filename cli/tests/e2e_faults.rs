//! Faults and bad input at the real `oomscope` binary: each test reproduces a
//! failure found by trying oomscope as a hostile or unlucky user would, with
//! a real collector process on loopback over a real SQLite file.

mod common;

use std::process::Output;
use std::time::Duration;

use common::*;

/// `oomscope ARGS... --collector URL`, its output whatever the status.
fn verb(col: &Collector, args: &[&str]) -> Output {
    oomscope()
        .args(args)
        .args(["--collector", &col.url])
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A `--since` beyond what a nanosecond clock holds (about 292 years) is an
/// error, not a wrap into the future that shows an empty timeline.
#[test]
fn a_since_past_the_clock_range_is_an_error() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let out = run(&col.url, "since", &[], &["sh", "-c", "sleep 0.3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let recent = col.json(&["timeline", "since", "--since", "1h", "--max-points", "0"]);
    let samples = recent["samples"].as_array().unwrap().len();
    assert!(samples > 0, "the last hour holds the run: {recent}");
    for which in [
        &["timeline", "since"][..],
        &["diagnose", "--agent", "since"][..],
    ] {
        let mut args = which.to_vec();
        args.extend(["--since", "15000000000s"]);
        let out = verb(&col, &args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("--since") && stderr(&out).contains("292 years"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    // Too large for a duration at all: a usage error, not a panic.
    let out = verb(&col, &["timeline", "since", "--since", &"9".repeat(30)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

/// `oomscope incidents | head -1`: a reader that goes away is no error. Each
/// verb's stdout is a pipe whose read end is closed before the verb writes.
#[test]
fn a_closed_stdout_ends_quietly_with_status_0() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // A death by signal: an incident for diagnose and report to print.
    let out = run(&col.url, "piped", &[], &["sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(137), "{}", stderr(&out));
    assert_eq!(
        col.incidents_of("piped", 1, Duration::from_secs(10)).len(),
        1
    );
    for args in [
        &["incidents"][..],
        &["incidents", "--json"],
        &["agents"],
        &["timeline", "piped"],
        &["diagnose"],
        &["report", "--md"],
        &["bench", "ingest", "--agents", "1", "--samples", "20"],
    ] {
        let mut child = oomscope()
            .args(args)
            .args(["--collector", &col.url])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "{args:?} said something");
    }
}

/// A port someone else holds: the collector says so and exits non-zero,
/// having printed no "listening" and created no store.
#[test]
fn a_taken_port_is_a_clear_error_and_creates_no_store() {
    let tmp = tempdir();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let db = tmp.path().join("never.db");
    let out = oomscope()
        .args(["collector", "--listen", &addr, "--db"])
        .arg(&db)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&addr) && err.contains("in use"),
        "names the address and why: {err}"
    );
    assert!(!err.contains("listening on"), "{err}");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "no store files: {left:?}");
}

/// A second collector on a store another one serves refuses to start,
/// naming the first (its pid and address), and leaves the store to it.
#[test]
fn a_second_collector_on_the_same_store_refuses_and_names_the_first() {
    let tmp = tempdir();
    let db = tmp.path().join("db");
    let col = Collector::start(&db);
    let first = col.url.trim_start_matches("http://").to_string();
    let out = collector_refusing("127.0.0.1:0", &db);
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("already being written by another collector")
            && err.contains(&format!("listening on {first}"))
            && err.contains("pid "),
        "names the first collector: {err}"
    );
    assert!(!err.contains("listening on 127.0.0.1:0"), "{err}");
    // The first still serves.
    let out = verb(&col, &["agents"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// `report --html PATH` never writes through a planted symlink, and
/// replaces an existing file only with --force (the link itself, then, not
/// what it points to); the page goes through a temporary file in the
/// target directory, of which nothing is left behind.
#[test]
fn report_html_refuses_symlinks_and_existing_files_without_force() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let out = run(&col.url, "paged", &[], &["sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(137), "{}", stderr(&out));
    assert_eq!(
        col.incidents_of("paged", 1, Duration::from_secs(10)).len(),
        1
    );
    let pages = tmp.path().join("pages");
    std::fs::create_dir(&pages).unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let link = pages.join("link.html");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let existing = pages.join("existing.html");
    std::fs::write(&existing, "an earlier report").unwrap();
    let report = |path: &std::path::Path, force: bool| {
        let mut args = vec!["report", "--html", path.to_str().unwrap()];
        if force {
            args.push("--force");
        }
        verb(&col, &args)
    };

    let out = report(&link, false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("symlink"), "{}", stderr(&out));
    let out = report(&existing, false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(
        std::fs::read_to_string(&existing).unwrap(),
        "an earlier report"
    );

    let fresh = pages.join("fresh.html");
    for (path, force) in [(&fresh, false), (&existing, true), (&link, true)] {
        let out = report(path, force);
        assert!(out.status.success(), "{}: {}", path.display(), stderr(&out));
        let meta = std::fs::symlink_metadata(path).unwrap();
        assert!(meta.is_file(), "{} is a plain file now", path.display());
        let page = std::fs::read_to_string(path).unwrap();
        assert!(
            page.contains("<html") && page.contains("paged"),
            "{}",
            path.display()
        );
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let mut names: Vec<String> = std::fs::read_dir(&pages)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["existing.html", "fresh.html", "link.html"],
        "no temporary files left"
    );
}

/// The seqs of an agent's samples and events in `col`, by its name.
fn seqs(col: &Collector, name: &str) -> std::collections::BTreeSet<u64> {
    let t = col.json(&["timeline", name, "--max-points", "0"]);
    ["samples", "events"]
        .iter()
        .flat_map(|k| t[k].as_array().unwrap().clone())
        .map(|m| m["seq"].as_u64().unwrap())
        .collect()
}

fn last_seq(col: &Collector, name: &str) -> u64 {
    let agents = col.json(&["agents"]);
    agents
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["hello"]["name"] == name)
        .map(|a| a["last_seq"].as_u64().unwrap())
        .max()
        .unwrap_or(0)
}

/// A child killed when the test ends, passed or not.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The store's files deleted under a running collector: it acks nothing more
/// (the writes would go to the unlinked file), says why, and exits non-zero.
/// Started again, it opens a new store and the agent resends what was not
/// acked, so every seq is in the old file or the new one.
#[test]
fn a_store_deleted_while_serving_stops_the_acks_and_loses_nothing_acked() {
    let tmp = tempdir();
    let db = tmp.path().join("live.db");
    let log = tmp.path().join("collector.log");
    let mut col = Collector::start_free(&db, Some(&log));
    let port = col.port;
    let mark = tmp.path().join("stop");
    let mut sup = Reaped(
        oomscope()
            .args(run_args(&col.url, "watched"))
            .args(["--", "sh", "-c"])
            .arg(format!(
                "while [ ! -e {} ]; do sleep 0.05; done",
                mark.display()
            ))
            .spawn()
            .unwrap(),
    );
    let wait_for = |what: &str, mut ok: Box<dyn FnMut() -> bool + '_>| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "waited 30 s for {what}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_for("5 samples", Box::new(|| last_seq(&col, "watched") >= 5));
    // Keep the old inodes reachable under other names, to read afterwards
    // what the collector stored in them; the store's own names are gone.
    let aside = tmp.path().join("aside.db");
    for suffix in ["", "-wal"] {
        let from = format!("{}{suffix}", db.display());
        std::fs::hard_link(&from, format!("{}{suffix}", aside.display())).unwrap();
    }
    for suffix in ["", "-wal", "-shm"] {
        std::fs::remove_file(format!("{}{suffix}", db.display())).unwrap();
    }
    let old_child = col.child.as_mut().unwrap();
    wait_for(
        "the collector to exit",
        Box::new(|| old_child.try_wait().unwrap().is_some()),
    );
    let status = old_child.wait().unwrap();
    drop(col);
    let said = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(2), "{said}");
    assert!(
        said.contains(&format!("{} was deleted", db.display())),
        "says which file went: {said}"
    );

    let col = Collector::start_on(&db, port);
    // The agent reconnects after its backoff: until its Hello lands the
    // name is unknown, which the agents list says without failing.
    wait_for(
        "the agent to come back",
        Box::new(|| last_seq(&col, "watched") > 0),
    );
    std::fs::write(&mark, "").unwrap();
    let out = sup.0.wait().unwrap();
    assert!(out.success(), "the supervisor flushed everything: {out:?}");
    let new = seqs(&col, "watched");
    let last = last_seq(&col, "watched");
    drop(col);
    let old_col = Collector::start(&aside);
    let old = seqs(&old_col, "watched");
    let old_max = *old.last().unwrap();
    assert!(
        new.iter().all(|s| *s > old_max),
        "nothing stored twice: old up to {old_max}, new {new:?}"
    );
    let all: Vec<u64> = old.union(&new).copied().collect();
    let want: Vec<u64> = (1..=*all.last().unwrap()).collect();
    assert_eq!(all, want, "no seq missing in the old file and the new one");
    // Only the Goodbye (no sample, no event) may follow the last of them.
    assert!(
        last <= want.len() as u64 + 1,
        "last seq {last}, stored up to {}",
        want.len()
    );
}

/// A store whose header is valid but whose pages are not: the collector
/// refuses to start, with SQLite's findings, instead of serving and then
/// failing every write.
#[test]
fn a_store_with_corrupt_pages_is_refused_at_start() {
    use oomscope_proto::v1 as pb;
    let tmp = tempdir();
    let db = tmp.path().join("damaged.db");
    {
        let mut store = oomscope_collector::store::Store::open(&db).unwrap();
        let hello = pb::Hello {
            agent_id: "damaged-1".into(),
            name: "damaged".into(),
            ..Default::default()
        };
        store.upsert_agent(&hello, 1).unwrap();
        let batch: Vec<pb::AgentMessage> = (1..=2000u64)
            .map(|seq| pb::AgentMessage {
                seq,
                body: Some(pb::agent_message::Body::Sample(pb::Sample {
                    time_ns: seq as i64,
                    step: seq,
                    ..Default::default()
                })),
            })
            .collect();
        store.insert_batch("damaged-1", &batch).unwrap();
    } // closed: SQLite checkpoints the WAL into the file

    // The schema's own pages (the first, and those its text overflows
    // into), which must stay valid for SQLite to get as far as checking.
    let schema: Vec<usize> = {
        let conn = rusqlite::Connection::open(&db).unwrap();
        let mut stmt = conn
            .prepare("SELECT pageno FROM dbstat WHERE name = 'sqlite_schema'")
            .unwrap();
        let pages = stmt.query_map([], |r| r.get::<_, i64>(0)).unwrap();
        pages.map(|p| p.unwrap() as usize).collect()
    };
    let mut bytes = std::fs::read(&db).unwrap();
    let page = 4096;
    let pages = bytes.len() / page;
    assert!(pages >= 8, "a store of {pages} pages");
    // Every page but the schema's: the header and schema stay valid.
    let damaged: Vec<usize> = (1..pages).filter(|p| !schema.contains(&(p + 1))).collect();
    assert!(
        damaged.len() >= pages / 2,
        "{} of {pages} pages damaged",
        damaged.len()
    );
    for p in damaged {
        bytes[p * page..(p + 1) * page].fill(0xA5);
    }
    std::fs::write(&db, &bytes).unwrap();

    let mut child = oomscope()
        .args([
            "collector",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--db",
        ])
        .arg(&db)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let served = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(!served, "the collector served a damaged store: {err}");
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("damaged.db") && err.contains("quick_check") && !err.contains("listening"),
        "{err}"
    );
}

/// Strings an agent sends (its name, host, a phase label, an OOM's error
/// text, its Goodbye's reason) reach no terminal raw: every text verb shows
/// an escape, a bell or a newline in them visibly.
#[test]
fn agent_strings_are_escaped_for_terminals() {
    use oomscope_proto::v1 as pb;
    use pb::agent_message::Body;
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let evil = "\x1b]0;owned\x07evil\x1b[2J\nFAKE LINE";
    let hello = pb::Hello {
        agent_id: format!("id-{evil}"),
        name: format!("name-{evil}"),
        host: format!("host-{evil}"),
        runtime: format!("rt-{evil}"),
        pid: 4242,
        ..Default::default()
    };
    let event = |seq: u64, kind: pb::event::Kind| pb::AgentMessage {
        seq,
        body: Some(Body::Event(pb::Event {
            time_ns: oomscope_proto::now_ns(),
            kind: Some(kind),
        })),
    };
    stream(
        &col.url,
        hello,
        vec![
            event(
                1,
                pb::event::Kind::Phase(pb::Phase {
                    name: format!("phase-{evil}"),
                    start: true,
                    ..Default::default()
                }),
            ),
            event(
                2,
                pb::event::Kind::Oom(pb::Oom {
                    requested_bytes: 1 << 20,
                    error_type: format!("type-{evil}"),
                    error_text: format!("CUDA out of memory. {evil}"),
                    ..Default::default()
                }),
            ),
            pb::AgentMessage {
                seq: 3,
                body: Some(Body::Goodbye(pb::Goodbye {
                    reason: format!("bye-{evil}"),
                    exit_code: 1,
                })),
            },
        ],
    );
    assert_eq!(col.json(&["incidents"]).as_array().unwrap().len(), 1);
    let name = format!("name-{evil}");
    for args in [
        &["agents"][..],
        &["incidents"],
        &["timeline", &name],
        &["diagnose"],
        &["report", "--md"],
    ] {
        let out = verb(&col, args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let text = String::from_utf8(out.stdout).unwrap();
        let raw: Vec<char> = text
            .chars()
            .filter(|c| c.is_control() && *c != '\n')
            .collect();
        assert!(raw.is_empty(), "{args:?} printed {raw:?}: {text}");
        // Only inside a Markdown code block (an error text, verbatim) may
        // an agent's newline start a line.
        let mut fenced = false;
        for line in text.lines() {
            fenced ^= line.starts_with("```");
            assert!(
                fenced || !line.starts_with("FAKE LINE"),
                "{args:?} let an agent start a line: {text}"
            );
        }
        assert!(
            text.contains("evil"),
            "{args:?} shows the agent's strings: {text}"
        );
    }
    // The numbers still come through: the OOM's request and the agent's pid.
    let text = String::from_utf8(verb(&col, &["timeline", &name]).stdout).unwrap();
    assert!(
        text.contains("pid 4242") && text.contains("OOM requesting 1.00 MiB"),
        "{text}"
    );
    assert!(
        text.contains("\\u{1b}]0;owned\\u{7}evil"),
        "shown visibly: {text}"
    );
}

/// A connection the collector drops (here: HTTP/2 frames it cannot parse)
/// is logged with the reason, not only as a stream that ended, at the
/// default log level (where dependencies log only warnings).
#[test]
fn a_dropped_connection_is_logged_with_its_reason() {
    use std::io::Write;
    let tmp = tempdir();
    let log = tmp.path().join("collector.log");
    let col = Collector::start_free(&tmp.path().join("db"), Some(&log));
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", col.port)).unwrap();
    // The HTTP/2 preface, then a SETTINGS frame of a length no SETTINGS has.
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x05\x04\x00\x00\x00\x00\x00hello")
        .unwrap();
    let ours = format!("peer=Some({})", tcp.local_addr().unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    // Waits for this connection's line: the start-up's readiness check can
    // log a failed connection of its own first (a reset before the preface).
    let said = loop {
        let said = std::fs::read_to_string(&log).unwrap();
        if said
            .lines()
            .any(|l| l.contains("HTTP/2 protocol error") && l.contains(&ours))
            || std::time::Instant::now() > deadline
        {
            break said;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(col);
    assert!(
        said.lines()
            .any(|l| l.contains("HTTP/2 protocol error") && l.contains(&ours)),
        "no line for {ours}: {said}"
    );
}
