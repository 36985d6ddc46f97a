//! The reporter against a real tonic collector on 127.0.0.1: delivery,
//! collector down at start, collector killed mid-stream, a full queue, and
//! a crashed agent's spool resent by the next run.
//!
//! The in-test collector runs in its own tokio runtime; "killing" it shuts
//! that runtime down, which closes its listener and every connection, as a
//! dead process would.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oomscope_agent_core::pb;
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use pb::agent_message::Body;
use pb::agent_service_server::{AgentService, AgentServiceServer};
use pb::collector_message::Body as Reply;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

/// What the collector stored: (agent id, seq) -> the message, once each.
#[derive(Default)]
struct Store {
    stored: Mutex<BTreeMap<(String, u64), pb::AgentMessage>>,
    /// Seqs in the order they were first stored.
    arrivals: Mutex<Vec<u64>>,
    duplicates: AtomicU64,
    hellos: AtomicU64,
}

impl Store {
    fn seqs(&self, agent: &str) -> Vec<u64> {
        let stored = self.stored.lock().unwrap();
        stored
            .keys()
            .filter(|(a, _)| a == agent)
            .map(|(_, s)| *s)
            .collect()
    }
    fn len(&self) -> usize {
        self.stored.lock().unwrap().len()
    }
}

struct TestCollector {
    store: Arc<Store>,
    /// Per-message delay, to keep messages in flight when the collector dies.
    delay: Duration,
    directive: Option<pb::Directive>,
}

#[tonic::async_trait]
impl AgentService for TestCollector {
    type ConnectStream = ReceiverStream<Result<pb::CollectorMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(1024);
        let store = self.store.clone();
        let delay = self.delay;
        let directive = self.directive;
        tokio::spawn(async move {
            let mut agent: Option<String> = None;
            while let Ok(Some(message)) = inbound.message().await {
                let reply = match &message.body {
                    Some(Body::Hello(hello)) => {
                        assert_eq!(message.seq, 0, "Hello is seq 0");
                        store.hellos.fetch_add(1, Ordering::SeqCst);
                        agent = Some(hello.agent_id.clone());
                        directive.map(Reply::Directive)
                    }
                    _ => match &agent {
                        None => Some(Reply::Reject(pb::Reject {
                            seq: message.seq,
                            reason: "no Hello first".into(),
                        })),
                        Some(agent) => {
                            if !delay.is_zero() {
                                tokio::time::sleep(delay).await;
                            }
                            let key = (agent.clone(), message.seq);
                            let fresh = store
                                .stored
                                .lock()
                                .unwrap()
                                .insert(key, message.clone())
                                .is_none();
                            if fresh {
                                store.arrivals.lock().unwrap().push(message.seq);
                            } else {
                                store.duplicates.fetch_add(1, Ordering::SeqCst);
                            }
                            Some(Reply::Ack(pb::Ack {
                                from_seq: message.seq,
                                to_seq: message.seq,
                                // Like a collector before delta encoding.
                                changes_accepted: false,
                            }))
                        }
                    },
                };
                if let Some(body) = reply {
                    if tx
                        .send(Ok(pb::CollectorMessage { body: Some(body) }))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A collector serving in its own runtime, so that it can be killed.
struct Collector {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Collector {
    fn start(addr: SocketAddr, service: TestCollector) -> Collector {
        // The port may still be held for a moment by a killed collector.
        let deadline = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match TcpListener::bind(addr) {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("bind {addr}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("cannot bind {addr}: {e}"),
            }
        };
        listener.set_nonblocking(true).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            tonic::transport::Server::builder()
                .add_service(AgentServiceServer::new(service))
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        Collector {
            runtime: Some(runtime),
        }
    }

    fn kill(mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn service(store: &Arc<Store>) -> TestCollector {
    TestCollector {
        store: store.clone(),
        delay: Duration::ZERO,
        directive: None,
    }
}

/// A plain collector at `addr`, and what it stores.
fn collector_up(addr: SocketAddr) -> (Arc<Store>, Collector) {
    let store = Arc::new(Store::default());
    let collector = Collector::start(addr, service(&store));
    (store, collector)
}

/// A loopback port nobody listens on (bound, then released).
fn reserved_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], oomscope_testkit::free_port()))
}

fn config(addr: SocketAddr) -> ReporterConfig {
    ReporterConfig {
        connect_timeout: Duration::from_secs(2),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..ReporterConfig::new(format!("http://{addr}"))
    }
}

/// [`config`] with a spool in `dir`.
fn spooled(addr: SocketAddr, dir: &std::path::Path) -> ReporterConfig {
    ReporterConfig {
        spool_dir: Some(dir.to_path_buf()),
        ..config(addr)
    }
}

fn hello(agent_id: &str) -> pb::Hello {
    pb::Hello {
        agent_id: agent_id.into(),
        name: "reporter-test".into(),
        pid: std::process::id(),
        ..Default::default()
    }
}

/// A sample of about 250 bytes, to fill memory and disk bounds quickly.
fn bulky_sample(step: u64) -> pb::Sample {
    pb::Sample {
        context: Some(pb::RequestContext {
            request_id: format!("{step:08}-{}", "r".repeat(220)),
            ..Default::default()
        }),
        ..sample(step)
    }
}

fn sample(step: u64) -> pb::Sample {
    pb::Sample {
        time_ns: 1_700_000_000_000_000_000 + step as i64,
        step,
        ..Default::default()
    }
}

/// Every stored message for `agent` is the sample whose step is its seq.
fn assert_contents(store: &Store, agent: &str) {
    for ((a, seq), message) in store.stored.lock().unwrap().iter() {
        if a != agent {
            continue;
        }
        match &message.body {
            Some(Body::Sample(s)) => assert_eq!(s.step, *seq, "seq {seq} carries step {}", s.step),
            Some(Body::Goodbye(_)) => {}
            other => panic!("seq {seq}: unexpected {other:?}"),
        }
    }
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `samples` while no collector listens, and waits until the spool
/// holds them all.
fn spool_offline(reporter: &Reporter, samples: Vec<pb::Sample>, timeout: Duration) {
    let n = samples.len() as u64;
    for s in samples {
        assert!(reporter.send_sample(s));
    }
    wait_until(&format!("{n} spooled"), timeout, || {
        reporter.stats().spooled == n
    });
}

/// Fails the test unless everything sent is acked within `timeout`.
fn assert_flushes(reporter: &Reporter, timeout: Duration) {
    assert!(reporter.flush(timeout), "flush: {:?}", reporter.stats());
}

#[test]
fn five_hundred_samples_are_all_acked_exactly_once() {
    let store = Arc::new(Store::default());
    let addr = reserved_port();
    let directive = pb::Directive {
        kind: Some(pb::directive::Kind::TakeSnapshot(pb::TakeSnapshot {
            device: 3,
        })),
    };
    let _collector = Collector::start(
        addr,
        TestCollector {
            directive: Some(directive),
            ..service(&store)
        },
    );
    let reporter = Reporter::start(config(addr), hello("steady"));
    assert_eq!(reporter.agent_id(), "steady");
    assert_eq!(reporter.pid(), std::process::id());
    let directives = reporter.directives().expect("first call gets the receiver");
    assert!(reporter.directives().is_none());

    for step in 1..=500 {
        assert!(
            reporter.send_sample(sample(step)),
            "queue of 4096 refused sample {step}"
        );
    }
    assert_flushes(&reporter, Duration::from_secs(30));

    assert_eq!(store.seqs("steady"), (1..=500).collect::<Vec<_>>());
    assert_eq!(store.duplicates.load(Ordering::SeqCst), 0);
    assert_contents(&store, "steady");
    let stats = reporter.stats();
    assert_eq!(stats.acked, 500);
    assert_eq!(stats.sent, 500);
    assert_eq!(stats.dropped, 0);
    assert_eq!(stats.reconnects, 0);
    assert!(stats.connected);
    assert_eq!(
        directives
            .recv_timeout(Duration::from_secs(5))
            .expect("the collector's directive"),
        directive
    );

    // Shutdown sends Goodbye as seq 501 and waits for its ack.
    assert!(reporter.shutdown(
        pb::Goodbye {
            reason: "test over".into(),
            exit_code: 0
        },
        Duration::from_secs(10)
    ));
    let goodbye = store
        .stored
        .lock()
        .unwrap()
        .get(&("steady".to_string(), 501))
        .cloned();
    assert!(
        matches!(goodbye.and_then(|m| m.body), Some(Body::Goodbye(g)) if g.reason == "test over")
    );
}

#[test]
fn collector_down_at_start_then_up_gets_everything_in_order() {
    let addr = reserved_port();
    let reporter = Reporter::start(config(addr), hello("late"));
    for step in 1..=200 {
        assert!(reporter.send_sample(sample(step)));
    }
    // Nothing is listening: flush cannot succeed, and says so in time.
    assert!(!reporter.flush(Duration::from_millis(300)));
    wait_until("a failed connect", Duration::from_secs(10), || {
        reporter.stats().connect_failures > 0
    });
    assert!(reporter.stats().last_error.is_some());

    let (store, _collector) = collector_up(addr);
    assert_flushes(&reporter, Duration::from_secs(30));
    // Exactly once, and in seq order: the first stream carried them all.
    assert_eq!(
        *store.arrivals.lock().unwrap(),
        (1..=200).collect::<Vec<_>>()
    );
    assert_eq!(store.duplicates.load(Ordering::SeqCst), 0);
    assert_contents(&store, "late");
    let stats = reporter.stats();
    assert_eq!((stats.acked, stats.dropped), (200, 0));
}

#[test]
fn collector_killed_mid_stream_and_restarted_loses_nothing() {
    let store = Arc::new(Store::default());
    let addr = reserved_port();
    let slow = |store: &Arc<Store>| TestCollector {
        delay: Duration::from_millis(2),
        ..service(store)
    };
    let collector = Collector::start(addr, slow(&store));
    let reporter = Reporter::start(config(addr), hello("bumpy"));
    for step in 1..=300 {
        assert!(reporter.send_sample(sample(step)));
    }
    wait_until("some acks", Duration::from_secs(20), || {
        reporter.stats().acked >= 50
    });
    collector.kill();
    let acked_before = reporter.stats().acked;
    assert!(
        acked_before < 300,
        "the kill came too late to test anything"
    );
    // More traffic while the collector is dead.
    for step in 301..=400 {
        assert!(reporter.send_sample(sample(step)));
    }
    wait_until("the reporter to notice", Duration::from_secs(20), || {
        !reporter.stats().connected
    });

    let _collector = Collector::start(addr, slow(&store));
    assert_flushes(&reporter, Duration::from_secs(60));
    assert_eq!(store.seqs("bumpy"), (1..=400).collect::<Vec<_>>());
    assert_contents(&store, "bumpy");
    let stats = reporter.stats();
    // Distinct seqs: a message stored before the kill whose ack was lost is
    // resent and acked again, but counted once.
    assert_eq!(stats.acked, 400);
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert!(
        stats.resent > 0,
        "messages in flight at the kill must be resent: {stats:?}"
    );
    assert_eq!(stats.dropped, 0);
    assert!(
        store.hellos.load(Ordering::SeqCst) >= 2,
        "Hello again on reconnect"
    );
}

#[test]
fn a_full_queue_refuses_at_once_and_counts_the_drops() {
    let addr = reserved_port();
    let reporter = Reporter::start(
        ReporterConfig {
            queue_capacity: 8,
            ..config(addr)
        },
        hello("crowded"),
    );
    let results: Vec<bool> = (1..=100)
        .map(|step| reporter.send_sample(sample(step)))
        .collect();
    let accepted = results.iter().filter(|&&ok| ok).count();
    let refused = 100 - accepted;
    // Without a spool, queued messages wait in the queue while the
    // collector is down, so exactly its capacity is accepted.
    assert_eq!(accepted, 8, "{results:?}");
    assert_eq!(reporter.stats().dropped, refused as u64);
    assert!(!reporter.flush(Duration::from_millis(100)));
    drop(reporter); // must not hang
}

#[test]
fn a_crashed_agents_spool_is_resent_by_the_next_run() {
    let spool = tempfile::tempdir().unwrap();
    let down = reserved_port();
    {
        let first = Reporter::start(spooled(down, spool.path()), hello("phoenix"));
        spool_offline(
            &first,
            (1..=50).map(sample).collect(),
            Duration::from_secs(10),
        );
        assert_eq!(first.stats().acked, 0);
        // Dropped without flush or Goodbye, as a crash would leave it.
    }

    let addr = reserved_port();
    let (store, _collector) = collector_up(addr);
    let second = Reporter::start(spooled(addr, spool.path()), hello("phoenix"));
    // The new run continues the sequence after the old one's.
    for step in 51..=60 {
        assert!(second.send_sample(sample(step)));
    }
    assert_flushes(&second, Duration::from_secs(30));
    assert_eq!(store.seqs("phoenix"), (1..=60).collect::<Vec<_>>());
    assert_eq!(store.duplicates.load(Ordering::SeqCst), 0);
    assert_contents(&store, "phoenix");
    assert!(second.shutdown(pb::Goodbye::default(), Duration::from_secs(10)));

    // Everything was acked, so the spool holds nothing for a third run.
    let mut reopened =
        oomscope_agent_core::spool::Spool::open(spool.path(), "phoenix", 1 << 20).unwrap();
    assert!(reopened.pending().unwrap().is_empty());
    assert_eq!(reopened.next_seq(), 62);
}

#[test]
fn an_urgent_oom_event_is_spooled_and_acked() {
    let spool = tempfile::tempdir().unwrap();
    let addr = reserved_port();
    let (store, _collector) = collector_up(addr);
    let reporter = Reporter::start(spooled(addr, spool.path()), hello("urgent"));
    let oom = pb::Event {
        time_ns: 1,
        kind: Some(pb::event::Kind::Oom(pb::Oom {
            device: 0,
            requested_bytes: 96 << 20,
            ..Default::default()
        })),
    };
    assert!(
        reporter.send_urgent(oom.clone(), Duration::from_secs(20)),
        "{:?}",
        reporter.stats()
    );
    let stored = store
        .stored
        .lock()
        .unwrap()
        .get(&("urgent".to_string(), 1))
        .cloned();
    assert_eq!(stored.and_then(|m| m.body), Some(Body::Event(oom)));
    assert_eq!(store.len(), 1);
}

#[test]
fn a_bad_collector_url_is_an_error_in_stats_not_a_panic() {
    let reporter = Reporter::start(ReporterConfig::new("not a url"), hello("typo"));
    assert!(reporter.send_sample(sample(1)));
    wait_until("the error", Duration::from_secs(10), || {
        reporter.stats().last_error.is_some()
    });
    assert!(reporter.stats().last_error.unwrap().contains("not a url"));
    assert!(!reporter.shutdown(pb::Goodbye::default(), Duration::from_millis(200)));
}

#[test]
fn over_the_memory_bound_the_backlog_is_reread_from_the_spool() {
    let spool = tempfile::tempdir().unwrap();
    let addr = reserved_port();
    let reporter = Reporter::start(
        ReporterConfig {
            // About 8 messages in memory; the other 292 only on disk.
            unacked_max_bytes: 2048,
            ..spooled(addr, spool.path())
        },
        hello("thrifty"),
    );
    spool_offline(
        &reporter,
        (1..=300).map(bulky_sample).collect(),
        Duration::from_secs(10),
    );
    let (store, _collector) = collector_up(addr);
    assert_flushes(&reporter, Duration::from_secs(30));
    assert_eq!(
        *store.arrivals.lock().unwrap(),
        (1..=300).collect::<Vec<_>>()
    );
    assert_contents(&store, "thrifty");
    let stats = reporter.stats();
    assert_eq!((stats.acked, stats.dropped), (300, 0));
}

#[test]
fn over_the_spool_bound_the_oldest_are_dropped_and_counted() {
    let spool = tempfile::tempdir().unwrap();
    let addr = reserved_port();
    let reporter = Reporter::start(
        ReporterConfig {
            spool_max_bytes: 64 * 1024,
            unacked_max_bytes: 2048,
            ..spooled(addr, spool.path())
        },
        hello("squeezed"),
    );
    spool_offline(
        &reporter,
        (1..=1000).map(bulky_sample).collect(),
        Duration::from_secs(20),
    );
    let (store, _collector) = collector_up(addr);
    assert_flushes(&reporter, Duration::from_secs(30));
    let stats = reporter.stats();
    let stored = store.seqs("squeezed");
    // 1000 x ~250 bytes cannot fit in 64 KiB: the oldest went, the newest
    // arrived, and every message is either stored or counted as dropped.
    assert!(stats.dropped > 0, "{stats:?}");
    assert_eq!(stored.len() as u64 + stats.dropped, 1000, "{stats:?}");
    let first = 1000 - stored.len() as u64 + 1;
    assert_eq!(stored, (first..=1000).collect::<Vec<_>>());
    assert_eq!(store.duplicates.load(Ordering::SeqCst), 0);
}

#[test]
fn without_a_spool_the_memory_bound_drops_the_oldest_and_counts_them() {
    let store = Arc::new(Store::default());
    let addr = reserved_port();
    let _collector = Collector::start(
        addr,
        TestCollector {
            delay: Duration::from_millis(2),
            ..service(&store)
        },
    );
    let reporter = Reporter::start(
        ReporterConfig {
            unacked_max_bytes: 4096,
            ..config(addr)
        },
        hello("forgetful"),
    );
    wait_until("connected", Duration::from_secs(10), || {
        reporter.stats().connected
    });
    for step in 1..=300 {
        assert!(reporter.send_sample(bulky_sample(step)));
    }
    assert_flushes(&reporter, Duration::from_secs(30));
    let stats = reporter.stats();
    let stored = store.seqs("forgetful");
    assert!(stats.dropped > 0, "{stats:?}");
    // A dropped message may still have been on the wire and stored.
    assert!(
        stored.len() as u64 + stats.dropped >= 300,
        "{} + {stats:?}",
        stored.len()
    );
    assert_eq!(stored.last(), Some(&300), "the newest must arrive");
    assert_eq!(store.duplicates.load(Ordering::SeqCst), 0);
}

#[test]
fn without_a_spool_an_outage_keeps_the_newest_whole_and_states_what_it_thinned() {
    let addr = reserved_port();
    let one = pb::AgentMessage {
        seq: 2000,
        body: Some(Body::Sample(bulky_sample(2000))),
    }
    .encoded_len();
    let reporter = Reporter::start(
        ReporterConfig {
            // About 100 samples in memory, 2,000 sent while the collector is down.
            unacked_max_bytes: one * 100,
            ..config(addr)
        },
        hello("outage"),
    );
    for step in 1..=2000 {
        assert!(reporter.send_sample(bulky_sample(step)), "never refused");
    }
    wait_until("the outage thinned", Duration::from_secs(20), || {
        reporter.stats().dropped >= 1900
    });
    assert!(reporter.stats().buffered_bytes <= (one * 100) as u64);
    let (store, _collector) = collector_up(addr);
    assert_flushes(&reporter, Duration::from_secs(30));
    let stats = reporter.stats();
    let stored = store.seqs("outage");
    assert_eq!(stored.len() as u64 + stats.dropped, 2000, "{stats:?}");
    assert_eq!(stats.thinned, stats.dropped, "nothing lost but by thinning");
    // The newest whole, the oldest kept, the stretch between thinned evenly.
    assert_eq!(
        stored[stored.len() - 45..],
        (1956..=2000).collect::<Vec<_>>()[..]
    );
    assert_eq!(stored[0], 1);
    let widest = stored.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(widest <= stats.max_stride, "gap {widest}, {stats:?}");
    // Every thinned sample is stated on the next one kept.
    let messages = store.stored.lock().unwrap();
    let mut previous = 0;
    for seq in &stored {
        let Some(Body::Sample(s)) = &messages[&("outage".to_string(), *seq)].body else {
            panic!("seq {seq} is not a sample");
        };
        let said = s.dropped_before.as_ref().map_or(0, |d| d.samples);
        assert_eq!(said, seq - previous - 1, "before seq {seq}");
        previous = *seq;
    }
}
