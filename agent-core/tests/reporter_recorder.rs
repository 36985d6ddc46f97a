//! The flight recorder inside the reporter: what was sent stays readable
//! locally, bounded, even when no collector ever answers.

use std::time::{Duration, Instant};

use oomscope_agent_core::pb;
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};

fn sample(i: u64) -> pb::Sample {
    pb::Sample {
        time_ns: oomscope_agent_core::now_ns(),
        step: i,
        ..Default::default()
    }
}

#[test]
fn recent_holds_what_was_sent_without_a_collector_and_stays_bounded() {
    // Nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spool = tempfile::tempdir().unwrap();
    let mut cfg = ReporterConfig::new(format!("http://127.0.0.1:{port}"));
    // With a spool the worker takes messages while the collector is down
    // (without one they wait in the bounded queue, and are recorded once taken).
    cfg.spool_dir = Some(spool.path().to_path_buf());
    let one = prost::Message::encoded_len(&pb::AgentMessage {
        seq: 1,
        body: Some(pb::agent_message::Body::Sample(sample(1))),
    });
    cfg.flight_max_bytes = one * 20;
    let hello = pb::Hello {
        agent_id: format!("flight-{port}"),
        ..Default::default()
    };
    let r = Reporter::start(cfg, hello);
    for i in 0..50 {
        assert!(r.send_sample(sample(i)));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let recent = loop {
        let v = r.recent();
        if v.last().map(|m| m.seq) == Some(50) || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        recent.last().unwrap().seq,
        50,
        "the newest message is recorded"
    );
    assert!(
        recent.len() <= 20 && recent.len() >= 15,
        "bounded by bytes: {} kept",
        recent.len()
    );
    let seqs: Vec<u64> = recent.iter().map(|m| m.seq).collect();
    let mut sorted = seqs.clone();
    sorted.sort();
    assert_eq!(seqs, sorted, "oldest first");
}
