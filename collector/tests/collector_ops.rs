//! What operators watch, over real loopback: grpc.health.v1 says SERVING,
//! and `/metrics` shows ingest, incidents and each agent's latest readings.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::time::Duration;

use oomscope_collector::pb;
use oomscope_collector::pb::agent_message::Body;
use support::*;

const T0: i64 = 1_700_000_000_000_000_000;

/// `GET /metrics` over a plain TCP connection: the body.
fn scrape(addr: std::net::SocketAddr) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text.split_once("\r\n\r\n").unwrap().1.to_string()
}

fn with_cgroup(mut msg: pb::AgentMessage, limit: u64, usage: u64) -> pb::AgentMessage {
    if let Some(Body::Sample(s)) = &mut msg.body {
        s.cgroup = vec![pb::CgroupLevel {
            path: "/test".into(),
            version: "v2".into(),
            limit_bytes: limit,
            usage_bytes: usage,
            ..Default::default()
        }];
    }
    msg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_says_serving_and_metrics_show_what_came_in() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(run.channel().await);
    for service in ["", "oomscope.v1.AgentService", "oomscope.v1.QueryService"] {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }

    let listener = oomscope_collector::metrics::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let metrics_addr = listener.local_addr().unwrap();
    let c = run.collector.clone();
    tokio::spawn(oomscope_collector::metrics::serve(
        listener,
        move || c.render_metrics(),
        run.collector.until_stopping(),
    ));

    let mut agent = run.agent(hello("agent-m", "svc")).await;
    agent
        .send(with_cgroup(sample(1, T0 + 1), 64 << 20, 10 << 20))
        .await;
    agent
        .send(with_cgroup(sample(2, T0 + 2), 64 << 20, 30 << 20))
        .await;
    agent.send(oom(3, T0 + 3)).await;
    agent
        .acks_covering(&BTreeSet::from([1, 2, 3]), |_| {})
        .await;

    let text = tokio::task::spawn_blocking(move || scrape(metrics_addr))
        .await
        .unwrap();
    let line = |prefix: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let agent_figure = |domain: &str, figure: &str, device: &str| {
        format!(
            "oomscope_agent_memory_bytes{{agent=\"agent-m\",name=\"svc\",host=\"testhost\",domain=\"{domain}\",figure=\"{figure}\",device=\"{device}\"}}"
        )
    };
    assert_eq!(
        line(&agent_figure("cgroup", "limit", "")),
        (64u64 << 20) as f64
    );
    // The latest sample's, not the first's.
    assert_eq!(
        line(&agent_figure("cgroup", "usage", "")),
        (30u64 << 20) as f64
    );
    assert_eq!(line(&agent_figure("process", "rss", "")), (2 * MIB) as f64);
    assert_eq!(
        line(&agent_figure("allocator", "allocated", "0")),
        (16 * MIB) as f64
    );
    assert_eq!(line("oomscope_ingest_messages_total"), 3.0);
    assert!(line("oomscope_ingest_bytes_total") > 0.0);
    assert_eq!(
        line("oomscope_incidents_total{domain=\"gpu_vram\",cause=\"oom\"}"),
        1.0
    );
    assert_eq!(line("oomscope_connected_agents"), 1.0);
    // One batch or more: the three messages may arrive together.
    assert!(line("oomscope_store_write_seconds_count") >= 1.0);
    run.stop().await;
}

/// `--retain`: rows older than the window go while the collector serves;
/// younger ones, and the incident younger than the window, stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_old_data_and_keeps_young_incidents() {
    const DAY: i64 = 86_400_000_000_000;
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let now = oomscope_collector::store::now_ns();
    let mut agent = run.agent(hello("agent-old", "svc")).await;
    for seq in 1..=5u64 {
        agent.send(sample(seq, now - 20 * DAY + seq as i64)).await;
    }
    agent.send(oom(6, now - 20 * DAY + 6)).await;
    for seq in 7..=9u64 {
        agent.send(sample(seq, now - DAY + seq as i64)).await;
    }
    agent.send(oom(10, now - DAY + 10)).await;
    agent.acks_covering(&(1..=10).collect(), |_| {}).await;
    assert_eq!(incidents(&run, "agent-old").await.len(), 2);

    run.collector.retain(Duration::from_secs(14 * 86_400));
    let db = run.db.clone();
    let kept = eventually(Duration::from_secs(20), || {
        let db = db.clone();
        async move {
            let seqs = stored_seqs(&db, "agent-old");
            (seqs == (7..=10).collect::<Vec<_>>()).then_some(seqs)
        }
    })
    .await;
    assert!(
        kept.is_some(),
        "left: {:?}",
        stored_seqs(&run.db, "agent-old")
    );
    let left = incidents(&run, "agent-old").await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].time_ns > now - 14 * DAY, "{left:?}");
    let tl = timeline(&run, "agent-old").await;
    assert_eq!(tl.samples.len(), 3);
    run.stop().await;
}

/// The agents' backlog through the real `/metrics` text: an agent-core
/// reporter whose collector is not up yet holds what it takes; the sample
/// it takes next says how many messages it held and their encoded bytes;
/// once everything is acked, the next sample says none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_each_agents_backlog_from_its_newest_sample() {
    use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
    use prost::Message;

    let dir = tempfile::tempdir().unwrap();
    let port = oomscope_testkit::free_port();
    let mut cfg = ReporterConfig::new(format!("http://127.0.0.1:{port}"));
    cfg.spool_dir = Some(dir.path().join("spool"));
    cfg.backoff_max = Duration::from_millis(200);
    let reporter = Reporter::start(cfg, hello("agent-b", "svc"));
    let reading = |step: u64| pb::Sample {
        time_ns: T0 + step as i64,
        step,
        process: Some(pb::ProcessMemory {
            pid: 4242,
            vm_rss_bytes: step * MIB,
            ..Default::default()
        }),
        ..Default::default()
    };
    let spooled = |n: u64, r: &Reporter| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while r.stats().spooled < n {
            assert!(std::time::Instant::now() < deadline, "{:?}", r.stats());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    for step in 1..=6 {
        assert!(reporter.send_sample(reading(step)));
    }
    spooled(6, &reporter);
    assert!(reporter.send_sample(reading(7)));
    spooled(7, &reporter);
    // What the six held weigh as the agent holds them: each carries the
    // backlog before it (seq 1 none), encoded.
    let mut held = pb::Backlog::default();
    for step in 1..=6u64 {
        let mut s = reading(step);
        s.backlog = Some(held);
        let m = pb::AgentMessage {
            seq: step,
            body: Some(Body::Sample(s)),
        };
        held.messages += 1;
        held.bytes += m.encoded_len() as u64;
    }

    let db = dir.path().join("c.db");
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let collector = oomscope_collector::ingest::Collector::new(
        oomscope_collector::store::Store::open(&db).unwrap(),
        Duration::from_secs(5),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(oomscope_collector::serve::serve_with_listener(
        listener,
        collector.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    let metrics = oomscope_collector::metrics::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let metrics_addr = metrics.local_addr().unwrap();
    let c = collector.clone();
    tokio::spawn(oomscope_collector::metrics::serve(
        metrics,
        move || c.render_metrics(),
        collector.until_stopping(),
    ));
    let backlog = move || {
        let text = scrape(metrics_addr);
        let of = |name: &str| {
            let series = format!("{name}{{agent=\"agent-b\",name=\"svc\",host=\"testhost\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(series.as_str()))
                .unwrap_or_else(|| panic!("no {series} in\n{text}"))
                .parse::<u64>()
                .unwrap()
        };
        pb::Backlog {
            messages: of("oomscope_agent_spool_backlog_messages"),
            bytes: of("oomscope_agent_spool_backlog_bytes"),
        }
    };

    let (reporter, seen) = tokio::task::spawn_blocking(move || {
        assert!(
            reporter.flush(Duration::from_secs(20)),
            "{:?}",
            reporter.stats()
        );
        (reporter, backlog())
    })
    .await
    .unwrap();
    assert_eq!(seen, held, "sample 7 held seqs 1..=6");

    let seen = tokio::task::spawn_blocking(move || {
        assert!(reporter.send_sample(reading(8)));
        assert!(
            reporter.flush(Duration::from_secs(20)),
            "{:?}",
            reporter.stats()
        );
        backlog()
    })
    .await
    .unwrap();
    assert_eq!(
        seen,
        pb::Backlog::default(),
        "sample 8 came after every ack"
    );
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), serving).await;
}
