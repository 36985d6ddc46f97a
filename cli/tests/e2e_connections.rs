//! Connections that cannot pin the collector (#35), against the real
//! `oomscope collector` process: out of file descriptors it backs off
//! instead of spinning, logs the failure at most once a second (no colour
//! codes in a log file), and answers queries once the connections close.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

/// The collector's CPU time so far (user + system), from /proc.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

#[test]
fn out_of_descriptors_the_collector_backs_off_and_answers_once_they_close() {
    const CONNECTIONS: usize = 400;
    const WINDOW: Duration = Duration::from_secs(10);
    let tmp = tempdir();
    let log = tmp.path().join("collector.log");
    let col = Collector::start_free(&tmp.path().join("db"), Some(&log));
    let pid = col.child.as_ref().unwrap().id();
    let limited = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), "--nofile=256:256"])
        .status()
        .expect("run prlimit");
    assert!(limited.success(), "prlimit failed");

    let started = Instant::now();
    // Past the listen backlog (128) the kernel drops the SYNs of those the
    // collector cannot accept; a short timeout leaves them to retry alone.
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], col.port));
    let conns: Vec<TcpStream> = (0..CONNECTIONS)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(50)).ok())
        .collect();
    assert!(
        conns.len() > 256,
        "only {} connections were established",
        conns.len()
    );
    let log_before = std::fs::metadata(&log).unwrap().len();
    let cpu_before = cpu_time(pid);
    // The measured window: the collector is out of descriptors throughout.
    std::thread::sleep(WINDOW);
    let cpu = cpu_time(pid) - cpu_before;
    let grew = std::fs::metadata(&log).unwrap().len() - log_before;
    let pinned_for = started.elapsed();
    let text = std::fs::read_to_string(&log).unwrap();
    let accept_lines = text
        .lines()
        .filter(|l| l.contains("cannot accept connections"))
        .count();
    eprintln!(
        "{} of {CONNECTIONS} connections at nofile 256: {accept_lines} accept-error lines in \
         {pinned_for:?}, log +{grew} B and {cpu:?} of collector CPU in {WINDOW:?}",
        conns.len()
    );
    assert!(
        accept_lines >= 1,
        "the collector never ran out of descriptors: the test tested nothing\n{text}"
    );
    assert!(
        accept_lines as u64 <= pinned_for.as_secs() + 2,
        "{accept_lines} accept-error lines in {pinned_for:?}: more than one a second"
    );
    assert!(
        grew < 1024 * 1024,
        "the log grew {grew} bytes in {WINDOW:?}"
    );
    assert!(
        !text.contains('\u{1b}'),
        "colour codes in a log that is not a terminal"
    );

    drop(conns);
    let asked = Instant::now();
    let agents = col.json(&["agents"]);
    assert!(
        agents.as_array().is_some_and(|a| a.is_empty()),
        "agents answered {agents}"
    );
    eprintln!(
        "`agents` answered {:?} after the connections closed",
        asked.elapsed()
    );
}
