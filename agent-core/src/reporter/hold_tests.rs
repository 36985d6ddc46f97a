//! The held start against a small collector on 127.0.0.1: held, nothing
//! connects and no spool directory appears; released, the Hello and every
//! queued message arrive in order; stopped while held, nothing is sent.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use super::{Reporter, ReporterConfig};
use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::agent_service_server::{AgentService, AgentServiceServer};
use crate::pb::collector_message::Body as Reply;

/// Streams opened, and each message's (seq, is Hello), acked one by one.
#[derive(Default, Clone)]
struct Seen {
    streams: Arc<AtomicU64>,
    messages: Arc<Mutex<Vec<(u64, bool)>>>,
}

#[tonic::async_trait]
impl AgentService for Seen {
    type ConnectStream = ReceiverStream<Result<pb::CollectorMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        self.streams.fetch_add(1, Ordering::SeqCst);
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(1024);
        let messages = self.messages.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                let hello = matches!(m.body, Some(Body::Hello(_)));
                messages.lock().unwrap().push((m.seq, hello));
                if hello {
                    continue;
                }
                let ack = Reply::Ack(pb::Ack {
                    from_seq: m.seq,
                    to_seq: m.seq,
                    changes_accepted: false,
                });
                let reply = pb::CollectorMessage { body: Some(ack) };
                if tx.send(Ok(reply)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A collector on a free port, serving until the runtime is dropped.
fn collector() -> (Seen, String, tokio::runtime::Runtime) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    let seen = Seen::default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let service = seen.clone();
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let _ = tonic::transport::Server::builder()
            .add_service(AgentServiceServer::new(service))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
    });
    (seen, url, runtime)
}

fn held(url: &str, spool: &std::path::Path) -> ReporterConfig {
    ReporterConfig {
        spool_dir: Some(spool.to_path_buf()),
        hold: true,
        backoff_initial: Duration::from_millis(20),
        ..ReporterConfig::new(url)
    }
}

fn hello(agent_id: &str) -> pb::Hello {
    pb::Hello {
        agent_id: agent_id.into(),
        ..Default::default()
    }
}

fn sample(step: u64) -> pb::Sample {
    pb::Sample {
        step,
        ..Default::default()
    }
}

fn spool_root_entries(root: &std::path::Path) -> usize {
    std::fs::read_dir(root).map_or(0, |d| d.count())
}

#[test]
fn held_it_sends_nothing_and_released_it_delivers_everything_in_order() {
    let (seen, url, _rt) = collector();
    let spool = tempfile::tempdir().unwrap();
    let root = spool.path().join("root");
    let reporter = Reporter::start(held(&url, &root), hello("held"));
    assert!(reporter.held());
    for step in 1..=5 {
        assert!(reporter.send_sample(sample(step)));
    }
    assert!(
        !reporter.flush(Duration::from_secs(5)),
        "held: nothing to wait for"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        seen.streams.load(Ordering::SeqCst),
        0,
        "no stream while held"
    );
    assert_eq!(
        spool_root_entries(&root),
        0,
        "no spool directory while held"
    );

    let t0 = Instant::now();
    reporter.release();
    reporter.release(); // twice is harmless
    assert!(!reporter.held());
    assert!(reporter.send_sample(sample(6)));
    assert!(
        reporter.flush(Duration::from_secs(10)),
        "{:?}",
        reporter.stats()
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    let messages = seen.messages.lock().unwrap().clone();
    assert_eq!(messages[0], (0, true), "Hello first");
    let seqs: Vec<u64> = messages[1..].iter().map(|m| m.0).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(spool_root_entries(&root), 1, "the spool opened at release");
    assert!(reporter.shutdown(pb::Goodbye::default(), Duration::from_secs(5)));
}

#[test]
fn stopped_while_held_it_sends_nothing_and_leaves_no_spool() {
    let (seen, url, _rt) = collector();
    let spool = tempfile::tempdir().unwrap();
    let root = spool.path().join("root");
    let reporter = Reporter::start(held(&url, &root), hello("helper"));
    for step in 1..=3 {
        assert!(reporter.send_sample(sample(step)));
    }
    let t0 = Instant::now();
    assert!(!reporter.shutdown(pb::Goodbye::default(), Duration::from_secs(5)));
    assert!(t0.elapsed() < Duration::from_secs(2), "no waiting for acks");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(seen.streams.load(Ordering::SeqCst), 0);
    assert!(!root.exists(), "no spool root either");
}

#[test]
fn an_urgent_message_releases_a_held_reporter() {
    let (seen, url, _rt) = collector();
    let spool = tempfile::tempdir().unwrap();
    let reporter = Reporter::start(held(&url, spool.path()), hello("urgent-held"));
    assert!(reporter.send_sample(sample(1)));
    let oom = pb::Event {
        time_ns: 1,
        kind: Some(pb::event::Kind::Oom(pb::Oom::default())),
    };
    assert!(reporter.send_urgent(oom, Duration::from_secs(10)));
    assert!(!reporter.held());
    assert_eq!(reporter.stats().spooled, 2, "{:?}", reporter.stats());
    assert!(reporter.flush(Duration::from_secs(10)));
    assert_eq!(seen.streams.load(Ordering::SeqCst), 1);
}

#[test]
fn held_over_a_previous_runs_spool_its_seqs_go_on_from_there() {
    let (seen, url, _rt) = collector();
    let spool = tempfile::tempdir().unwrap();
    // The previous run of this id, its collector away: two samples spooled.
    let away = ReporterConfig {
        spool_dir: Some(spool.path().to_path_buf()),
        ..ReporterConfig::new("http://127.0.0.1:9")
    };
    let first = Reporter::start(away, hello("again"));
    for step in 1..=2 {
        assert!(first.send_sample(sample(step)));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while first.stats().spooled < 2 {
        assert!(Instant::now() < deadline, "{:?}", first.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(first);

    let reporter = Reporter::start(held(&url, spool.path()), hello("again"));
    assert!(reporter.send_sample(sample(3)));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(seen.streams.load(Ordering::SeqCst), 0, "held all the same");
    reporter.release();
    assert!(
        reporter.flush(Duration::from_secs(10)),
        "{:?}",
        reporter.stats()
    );
    let seqs: Vec<u64> = seen
        .messages
        .lock()
        .unwrap()
        .iter()
        .filter(|m| !m.1)
        .map(|m| m.0)
        .collect();
    assert_eq!(seqs, vec![1, 2, 3]);
}
