//! Faults and bad input at the real `oomscope` binary: each test reproduces a
//! failure found by trying oomscope as a hostile or unlucky user would, with
//! a real collector process on loopback over a real SQLite file.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;

/// `oomscope ARGS... --collector URL`, its output whatever the status.
fn oomscope(col: &Collector, args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .args(["--collector", &col.url])
        .env_remove("OOMSCOPE_COLLECTOR")
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
    for verb in [
        &["timeline", "since"][..],
        &["diagnose", "--agent", "since"][..],
    ] {
        let mut args = verb.to_vec();
        args.extend(["--since", "15000000000s"]);
        let out = oomscope(&col, &args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("--since") && stderr(&out).contains("292 years"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    // Too large for a duration at all: a usage error, not a panic.
    let out = oomscope(&col, &["timeline", "since", "--since", &"9".repeat(30)]);
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
    assert_eq!(col.incidents_of("piped", 1, Duration::from_secs(10)).len(), 1);
    for args in [
        &["incidents"][..],
        &["incidents", "--json"],
        &["agents"],
        &["timeline", "piped"],
        &["diagnose"],
        &["report", "--md"],
    ] {
        let mut child = Command::new(bin())
            .args(args)
            .args(["--collector", &col.url])
            .env_remove("OOMSCOPE_COLLECTOR")
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
    let out = Command::new(bin())
        .args(["collector", "--listen", &addr, "--db"])
        .arg(&db)
        .env_remove("OOMSCOPE_DB")
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
    assert_eq!(col.incidents_of("paged", 1, Duration::from_secs(10)).len(), 1);
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
        oomscope(&col, &args)
    };

    let out = report(&link, false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("symlink"), "{}", stderr(&out));
    let out = report(&existing, false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(std::fs::read_to_string(&existing).unwrap(), "an earlier report");

    let fresh = pages.join("fresh.html");
    for (path, force) in [(&fresh, false), (&existing, true), (&link, true)] {
        let out = report(path, force);
        assert!(out.status.success(), "{}: {}", path.display(), stderr(&out));
        let meta = std::fs::symlink_metadata(path).unwrap();
        assert!(meta.is_file(), "{} is a plain file now", path.display());
        let page = std::fs::read_to_string(path).unwrap();
        assert!(page.contains("<html") && page.contains("paged"), "{}", path.display());
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let mut names: Vec<String> = std::fs::read_dir(&pages)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["existing.html", "fresh.html", "link.html"], "no temporary files left");
}
