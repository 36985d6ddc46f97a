//! Faults and bad input at the collector's ingest, over real gRPC on loopback
//! into a real SQLite file: each test reproduces one failure found by trying
//! the collector as a hostile or unlucky user would.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;

use oomscope_collector::pb;
use oomscope_collector::pb::collector_message::Body as Reply;
use support::*;

const T0: i64 = 1_700_000_000_000_000_000;

/// A seq the store cannot hold (SQLite integers are i64) is refused alone:
/// the messages beside it are stored and acked, and the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seq_beyond_i64_is_rejected_alone_and_the_stream_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut agent = run.agent(hello("agent-big", "big-seq")).await;
    let huge = 1u64 << 63;
    agent.send(sample(1, T0)).await;
    agent
        .send(pb::AgentMessage {
            seq: huge,
            ..sample(1, T0 + 1)
        })
        .await;
    agent.send(sample(2, T0 + 2)).await;
    let mut rejected = Vec::new();
    let mut acked = BTreeSet::new();
    while !acked.is_superset(&BTreeSet::from([1, 2])) || rejected.is_empty() {
        match agent.next().await {
            Ok(Some(pb::CollectorMessage {
                body: Some(Reply::Reject(r)),
            })) => rejected.push(r),
            Ok(Some(pb::CollectorMessage {
                body: Some(Reply::Ack(a)),
            })) => acked.extend(a.from_seq..=a.to_seq),
            other => panic!("expected acks and one reject, got {other:?}"),
        }
    }
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0].seq, huge);
    assert!(
        rejected[0].reason.contains("seq") && rejected[0].reason.contains(&(i64::MAX).to_string()),
        "the reason names the limit: {}",
        rejected[0].reason
    );
    assert!(!acked.contains(&huge), "{acked:?}");
    // The stream is still open: a later sample is stored and acked.
    agent.send(sample(3, T0 + 3)).await;
    agent.acks_covering(&BTreeSet::from([3]), |_| {}).await;
    assert_eq!(stored_seqs(&run.db, "agent-big"), vec![1, 2, 3]);
    let tl = timeline(&run, "agent-big").await;
    let rss: Vec<u64> = tl.samples.iter().map(rss).collect();
    assert_eq!(rss, vec![MIB, 2 * MIB, 3 * MIB]);
    run.stop().await;
}
