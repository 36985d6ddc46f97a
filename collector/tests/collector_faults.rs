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

/// The store holds command lines and environments: its database, WAL and
/// shared-memory files are created readable by their owner only, whatever
/// the umask, through the collector's own writer and readers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_files_are_created_0600() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut agent = run.agent(hello("agent-private", "private")).await;
    agent.send(sample(1, T0)).await;
    agent.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    assert_eq!(timeline(&run, "agent-private").await.samples.len(), 1);
    for suffix in ["", "-wal", "-shm"] {
        let path = format!("{}{suffix}", run.db.display());
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{path} has mode {:o}", mode & 0o777);
    }
    run.stop().await;
}

/// A stream that never sends its Hello is closed after the Hello timeout,
/// with a status that says why; one that sends it in time is served however
/// long it then stays quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_a_hello_is_closed_after_the_deadline() {
    use oomscope_collector::ingest::Collector;
    use oomscope_collector::store::Store;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let timeout = Duration::from_millis(300);
    let collector = Collector::new(Store::open(&db).unwrap(), Duration::from_secs(5))
        .with_hello_timeout(timeout);
    let run = serving(&db, collector).await;

    let mut client = pb::agent_service_client::AgentServiceClient::new(run.channel().await);
    let (silent_tx, silent_rx) = tokio::sync::mpsc::channel::<pb::AgentMessage>(1);
    let started = tokio::time::Instant::now();
    let mut replies = client
        .connect(tokio_stream::wrappers::ReceiverStream::new(silent_rx))
        .await
        .expect("Connect")
        .into_inner();
    let ended = tokio::time::timeout(Duration::from_secs(20), replies.message())
        .await
        .expect("the silent stream was still open after 20 s");
    let status = ended.expect_err("the stream ends with a status");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("no Hello"), "{status:?}");
    assert!(started.elapsed() >= timeout, "closed before its deadline");
    drop(silent_tx);

    // A Hello in time: the stream outlives the deadline and is served.
    let mut agent = run.agent(hello("agent-slow", "slow")).await;
    tokio::time::sleep(timeout * 3).await;
    agent.send(sample(1, T0)).await;
    agent.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    run.stop().await;
}

/// A gRPC client that puts each message in its own HTTP/2 DATA frame (as
/// Python's grpcio does) and sends thousands of tiny ones before it reads a
/// reply. h2's flood guard charges every frame under 256 bytes against a
/// budget of half the connection window; with the stock 1 MiB window it
/// answered GOAWAY "too_many_data_frames" to a few thousand such frames
/// waiting behind a slow ingest. The collector's windows
/// (`serve::DEFAULT_STREAM_WINDOW` against `DEFAULT_CONNECTION_WINDOW`) keep
/// one stream's worth of the smallest frames within the budget, so every
/// message is stored and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_tiny_frames_on_one_stream_are_all_acked() {
    use prost::Message;
    use tonic::codegen::Bytes;
    const N: u64 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let tcp = tokio::net::TcpStream::connect(run.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client.ready().await.unwrap();
    let (response, mut send) = client
        .send_request(connect_request(run.addr), false)
        .unwrap();
    // One gRPC message, length-prefixed, in a DATA frame of its own.
    let frame = |m: &pb::AgentMessage| {
        let body = m.encode_to_vec();
        let mut f = vec![0u8];
        f.extend((body.len() as u32).to_be_bytes());
        f.extend(body);
        Bytes::from(f)
    };
    let first = pb::AgentMessage {
        seq: 0,
        body: Some(pb::agent_message::Body::Hello(hello("agent-tiny", "tiny"))),
    };
    send.send_data(frame(&first), false).unwrap();
    for seq in 1..=N {
        let tiny = pb::AgentMessage {
            seq,
            body: Some(pb::agent_message::Body::Sample(pb::Sample {
                time_ns: T0 + seq as i64,
                ..Default::default()
            })),
        };
        send.send_data(frame(&tiny), false).unwrap();
    }
    let mut body = response.await.expect("the response headers").into_body();
    let mut buf = Vec::new();
    let mut acked = BTreeSet::new();
    while (acked.len() as u64) < N {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(60), body.data())
            .await
            .expect("a reply within 60 s")
            .unwrap_or_else(|| panic!("the stream ended after {} acks", acked.len()))
            .unwrap_or_else(|e| panic!("the connection failed after {} acks: {e}", acked.len()));
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        while buf.len() >= 5 {
            let len = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
            if buf.len() < 5 + len {
                break;
            }
            let reply = pb::CollectorMessage::decode(&buf[5..5 + len]).unwrap();
            buf.drain(..5 + len);
            match reply.body {
                Some(Reply::Ack(a)) => acked.extend(a.from_seq..=a.to_seq),
                other => panic!("expected acks, got {other:?}"),
            }
        }
    }
    assert_eq!(acked, (1..=N).collect::<BTreeSet<_>>());
    assert_eq!(stored_seqs(&run.db, "agent-tiny").len() as u64, N);
    drop(send);
    run.stop().await;
}
