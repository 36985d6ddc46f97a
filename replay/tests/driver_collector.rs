//! The replay driver against a real collector in this process (gRPC over
//! loopback, a SQLite store in a temporary directory): what it says it sent
//! is what the capture holds and what the store then has; with no collector
//! it says the messages went unacked instead of failing or hanging.

use std::path::{Path, PathBuf};
use std::time::Duration;

use oomscope_collector::ingest::Collector;
use oomscope_collector::store::Store;
use oomscope_replay::{capture, driver, ingest_load};
use tokio::sync::oneshot;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/torch-h200")
        .join(name)
}

/// A collector on an ephemeral loopback port over `db`, served by its own
/// runtime so the driver's blocking calls run outside it.
struct Running {
    url: String,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    rt: tokio::runtime::Runtime,
}

fn start(db: &Path) -> Running {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::new(Store::open(db).unwrap(), Duration::from_secs(5));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = rt.spawn(oomscope_collector::serve::serve_with_listener(
        listener,
        collector,
        async move {
            let _ = stopped.await;
        },
    ));
    Running {
        url,
        stop,
        task,
        rt,
    }
}

impl Running {
    fn stop(self) {
        let _ = self.stop.send(());
        let task = self.task;
        self.rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), task).await })
            .expect("the collector stops within 10 s")
            .unwrap()
            .unwrap();
    }
}

#[test]
fn a_replay_delivers_every_message_of_the_capture_to_the_store() {
    let tmp = tempfile::tempdir().unwrap();
    let db = tmp.path().join("c.db");
    let col = start(&db);
    let file = fixture("fragmentation_oom.json");
    let r = driver::replay(
        &file,
        &col.url,
        Some("rp-frag".into()),
        0.0,
        Duration::from_secs(30),
    )
    .unwrap();
    col.stop();

    // The counts are the capture's own, read here from the file.
    let cap = capture::load(&file, 0).unwrap();
    assert!(r.acked, "{r:?}");
    assert_eq!(r.scenario, cap.scenario);
    assert_eq!(r.samples, cap.samples().count() as u64);
    assert_eq!(r.events, cap.events().count() as u64);
    assert!(r.samples > 0 && r.events > 0, "{r:?}");
    assert!(r.agent_id.starts_with("replay-rp-frag-"), "{}", r.agent_id);

    // And the store holds each of them once, under the name asked for.
    let store = Store::open_reader(&db).unwrap();
    let history = store.history(&r.agent_id, 0, i64::MAX).unwrap();
    assert_eq!(history.hello.name, "rp-frag");
    assert_eq!(history.samples.len() as u64, r.samples);
    assert_eq!(history.events.len() as u64, r.events);
}

#[test]
fn a_replay_with_no_collector_reports_the_messages_unacked() {
    // A port this test held and let go: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let file = fixture("weights_too_large.json");
    let started = std::time::Instant::now();
    let r = driver::replay(
        &file,
        &format!("http://127.0.0.1:{port}"),
        None,
        0.0,
        Duration::from_secs(1),
    )
    .unwrap();
    assert!(!r.acked, "{r:?}");
    // Every item still went to the reporter, under the capture's name.
    let cap = capture::load(&file, 0).unwrap();
    assert_eq!(r.samples + r.events, cap.items.len() as u64);
    assert!(r.agent_id.contains(&cap.scenario), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(20), "it waited on");
}

#[test]
fn bad_arguments_are_errors_before_any_connection() {
    let file = fixture("weights_too_large.json");
    for speed in [-1.0, f64::NAN, f64::INFINITY] {
        let err = driver::replay(&file, "http://127.0.0.1:9", None, speed, Duration::ZERO)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--speed"), "{speed}: {err}");
    }
    let load = ingest_load::Load {
        agents: 1,
        samples: 0,
        window: 1,
        complete_counters: false,
        rate: None,
    };
    let err = ingest_load::measure("http://127.0.0.1:9", load)
        .unwrap_err()
        .to_string();
    assert!(err.contains("at least 1"), "{err}");
    for rate in [0.0, -1.0, f64::NAN] {
        let load = ingest_load::Load {
            samples: 1,
            rate: Some(rate),
            ..load
        };
        let err = ingest_load::measure("http://127.0.0.1:9", load)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--rate"), "{rate}: {err}");
    }
}
