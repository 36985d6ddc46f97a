//! Graceful shutdown of a real `oomscope collector` process with agents
//! streaming to it: SIGTERM stops it accepting, every seq an agent saw
//! acked is in the store and nothing stored went unacked, the store is
//! closed (its write-ahead log checkpointed away), and the agents, spooling
//! meanwhile, continue on the next collector with every seq stored once.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use oomscope_agent_core::pb;
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_testkit::store_rows::stored_seqs;

const AGENTS: [&str; 2] = ["term-a", "term-b"];

/// An agent-core reporter sampling every 5 ms until told to stop; the
/// thread returns the reporter and how many samples it took.
fn streaming(
    url: &str,
    id: &str,
    spool: &Path,
    stop: Arc<AtomicBool>,
) -> JoinHandle<(Reporter, u64)> {
    let mut cfg = ReporterConfig::new(url.to_string());
    cfg.spool_dir = Some(spool.to_path_buf());
    cfg.backoff_max = Duration::from_millis(200);
    let hello = pb::Hello {
        agent_id: id.into(),
        name: id.into(),
        ..Default::default()
    };
    let reporter = Reporter::start(cfg, hello);
    std::thread::spawn(move || {
        let mut step = 0;
        while !stop.load(Ordering::Relaxed) {
            step += 1;
            assert!(reporter.send_sample(pb::Sample {
                time_ns: oomscope_agent_core::now_ns(),
                step,
                ..Default::default()
            }));
            std::thread::sleep(Duration::from_millis(5));
        }
        (reporter, step)
    })
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_acks_what_it_stored_closes_the_store_and_agents_continue_without_loss() {
    let tmp = tempdir();
    let db = tmp.path().join("c.db");
    let log = tmp.path().join("collector.log");
    let mut col = Collector::start_free(&db, Some(&log));
    let (port, url) = (col.port, col.url.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let mut agents: Vec<_> = AGENTS
        .iter()
        .map(|id| streaming(&url, id, &tmp.path().join("spool"), stop.clone()))
        .collect();
    wait_until(
        "both agents stored 20 samples",
        Duration::from_secs(20),
        || AGENTS.iter().all(|id| stored_seqs(&db, id).len() >= 20),
    );

    let mut child = col.child.take().expect("the collector's process");
    // SIGTERM to the collector this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the collector did not stop within 15 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "a clean exit");
    col.kill(); // joins the thread copying its log
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("shutting down"), "{said}");
    // Closed: its last connection checkpointed and removed the write-ahead
    // log (checked before this test opens the file).
    let wal = db.with_file_name("c.db-wal");
    assert!(!wal.exists(), "the store was left open: {}", wal.display());
    // Stopped accepting: nothing listens on its port now.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());

    // The agents keep sampling into their spools while no collector runs.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let finished: Vec<(Reporter, u64)> = agents.drain(..).map(|h| h.join().unwrap()).collect();
    for (reporter, _) in &finished {
        let acked = reporter.stats().acked;
        let id = reporter.agent_id().to_string();
        // Each ack is a promise: what the agents saw acked is stored, and
        // the drain acked every batch it stored (no stored seq unacked).
        assert!(acked >= 20, "{id}: {:?}", reporter.stats());
        assert_eq!(
            stored_seqs(&db, &id),
            (1..=acked).collect::<Vec<_>>(),
            "{id}: stored = acked at shutdown, {:?}",
            reporter.stats()
        );
    }

    // The next collector on the same port and file: the agents reconnect
    // and resend what was not acked; every seq is stored once.
    let col = Collector::start_on(&db, port);
    for (reporter, taken) in &finished {
        let id = reporter.agent_id();
        assert!(
            reporter.flush(Duration::from_secs(30)),
            "{id}: {:?}",
            reporter.stats()
        );
        assert_eq!(
            stored_seqs(&db, id),
            (1..=*taken).collect::<Vec<_>>(),
            "{id}: every sample stored once"
        );
        assert!(reporter.stats().reconnects >= 1, "{:?}", reporter.stats());
    }
    let agents = col.json(&["agents"]);
    for id in AGENTS {
        let a = agents
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["hello"]["agent_id"] == id)
            .unwrap_or_else(|| panic!("{id} in {agents}"));
        assert_eq!(a["state"], "connected", "{a}");
    }
}
