//! Connections that cannot pin the collector (#35), over real HTTP/2 on
//! loopback: a raw h2 client sends what a hostile or broken client would (a
//! message that stops halfway, more half-sent bytes than the cap, nothing at
//! all), and each test checks what the collector does about it and that it
//! goes on serving others.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use oomscope_collector::ingest::Collector;
use oomscope_collector::pb;
use oomscope_collector::serve::ConnectionLimits;
use oomscope_collector::store::Store;
use prost::Message;
use support::*;
use tokio::io::AsyncReadExt;

const T0: i64 = 1_700_000_000_000_000_000;

async fn start_limited(dir: &tempfile::TempDir, limits: ConnectionLimits) -> Running {
    let db = dir.path().join("c.db");
    let collector = Collector::new(Store::open(&db).unwrap(), Duration::from_secs(5));
    serving_limited(&db, collector, limits).await
}

/// One gRPC message with its 5-byte length prefix.
fn framed(m: &pb::AgentMessage) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut f = vec![0u8];
    f.extend((body.len() as u32).to_be_bytes());
    f.extend(body);
    f
}

/// The prefix of a message of `len` bytes and the first `sent` of them:
/// what a client that stops halfway has sent.
fn partial(len: u32, sent: usize) -> Bytes {
    let mut f = vec![0u8];
    f.extend(len.to_be_bytes());
    f.extend(std::iter::repeat_n(0u8, sent));
    Bytes::from(f)
}

/// A raw HTTP/2 connection to the collector (its driver spawned).
async fn h2_client(run: &Running) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(run.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client.ready().await.unwrap()
}

/// Opens an agent stream and sends its Hello whole.
async fn open_agent(
    client: &mut h2::client::SendRequest<Bytes>,
    run: &Running,
    agent_id: &str,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let mut client = client.clone().ready().await.unwrap();
    let (response, mut send) = client
        .send_request(connect_request(run.addr), false)
        .unwrap();
    let hello = pb::AgentMessage {
        seq: 0,
        body: Some(pb::agent_message::Body::Hello(hello(agent_id, agent_id))),
    };
    send.send_data(Bytes::from(framed(&hello)), false).unwrap();
    (response, send)
}

/// Reads a stream's reply to its end: the gRPC status it ended with.
async fn final_status(response: h2::client::ResponseFuture, within: Duration) -> tonic::Code {
    tokio::time::timeout(within, async move {
        let response = response.await.expect("response headers");
        if let Some(code) = response.headers().get("grpc-status") {
            return tonic::Code::from_bytes(code.as_bytes());
        }
        let mut body = response.into_body();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.expect("reply data");
            let _ = body.flow_control().release_capacity(chunk.len());
        }
        let trailers = body.trailers().await.expect("trailers").expect("trailers");
        tonic::Code::from_bytes(trailers.get("grpc-status").unwrap().as_bytes())
    })
    .await
    .unwrap_or_else(|_| panic!("the stream did not end within {within:?}"))
}

/// A message that stops partway is dropped once its deadline passes, and
/// its stream is ended with DEADLINE_EXCEEDED (the agent knows to resend);
/// an agent beside it is served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_message_past_its_deadline_ends_its_stream() {
    let dir = tempfile::tempdir().unwrap();
    let deadline = Duration::from_millis(700);
    let run = start_limited(
        &dir,
        ConnectionLimits {
            message_deadline: deadline,
            ..Default::default()
        },
    )
    .await;
    let mut client = h2_client(&run).await;
    let (response, mut send) = open_agent(&mut client, &run, "agent-stalled").await;
    // 100 of a 100 KB message's bytes, then nothing.
    send.send_data(partial(100_000, 100), false).unwrap();
    let started = Instant::now();
    let mut healthy = run.agent(hello("agent-healthy", "healthy")).await;
    healthy.send(sample(1, T0)).await;
    healthy.acks_covering(&BTreeSet::from([1]), |_| {}).await;

    let code = final_status(response, Duration::from_secs(20)).await;
    let waited = started.elapsed();
    assert_eq!(code, tonic::Code::DeadlineExceeded);
    assert!(
        waited >= deadline,
        "ended after {waited:?}, before the deadline"
    );
    // Its stream is reset: the server will read none of it.
    let reset = tokio::time::timeout(
        Duration::from_secs(10),
        futures::future::poll_fn(|cx| send.poll_reset(cx)),
    )
    .await;
    assert!(reset.is_ok(), "the stalled stream is still open");

    // The agent beside it goes on.
    healthy.send(sample(2, T0 + 1)).await;
    healthy.acks_covering(&BTreeSet::from([2]), |_| {}).await;
    assert_eq!(stored_seqs(&run.db, "agent-stalled").len(), 0);
    run.stop().await;
}

/// Partly arrived messages across streams are capped: the stream that
/// would pass the cap is refused with RESOURCE_EXHAUSTED while the one
/// under it stays, and once that one lets go, a message of the same size
/// is stored whole (the count came back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_bytes_over_the_cap_are_refused_with_resource_exhausted() {
    const CAP: usize = 1024 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let run = start_limited(
        &dir,
        ConnectionLimits {
            max_buffered_bytes: CAP,
            ..Default::default()
        },
    )
    .await;
    let mut client = h2_client(&run).await;
    // 200 KB of a 4 MB message on each stream (within one stream window).
    let (first, mut first_send) = open_agent(&mut client, &run, "agent-a").await;
    first_send
        .send_data(partial(4_000_000, 200_000), false)
        .unwrap();
    let mut responses = vec![Box::pin(final_status(first, Duration::from_secs(20)))];
    let mut held = Vec::new();
    // Six streams of 200 KB: five fit under 1 MiB, the sixth (whichever the
    // server reads last) passes it.
    for i in 0..5 {
        let (response, mut send) = open_agent(&mut client, &run, &format!("agent-b{i}")).await;
        send.send_data(partial(4_000_000, 200_000), false).unwrap();
        held.push(send);
        responses.push(Box::pin(final_status(response, Duration::from_secs(20))));
    }
    let (code, _, _) = futures::future::select_all(responses).await;
    assert_eq!(code, tonic::Code::ResourceExhausted);

    // Every stream lets go: their partial messages are dropped.
    first_send.send_reset(h2::Reason::CANCEL);
    for mut s in held {
        s.send_reset(h2::Reason::CANCEL);
    }
    // A message of 900 KB (under the cap alone) is stored and acked; the
    // count only comes back once the server has dropped the streams, so
    // a refusal before that is retried on a new stream.
    let big = pb::AgentMessage {
        seq: 1,
        body: Some(pb::agent_message::Body::Event(pb::Event {
            time_ns: T0,
            kind: Some(pb::event::Kind::Phase(pb::Phase {
                name: "x".repeat(900_000),
                ..Default::default()
            })),
        })),
    };
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        let mut agent = run.agent(hello("agent-c", "c")).await;
        agent.send(big.clone()).await;
        match agent.next().await {
            Ok(Some(pb::CollectorMessage {
                body: Some(pb::collector_message::Body::Ack(a)),
            })) => {
                assert_eq!((a.from_seq, a.to_seq), (1, 1));
                break;
            }
            Err(s) if s.code() == tonic::Code::ResourceExhausted && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("expected the 900 KB message acked, got {other:?}"),
        }
    }
    run.stop().await;
}

/// A connection that never opens a stream is closed after the idle time;
/// one whose stream stays open is not, however long it is quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_the_idle_time() {
    let dir = tempfile::tempdir().unwrap();
    let idle = Duration::from_millis(500);
    let run = start_limited(
        &dir,
        ConnectionLimits {
            idle_connection: idle,
            ..Default::default()
        },
    )
    .await;
    let mut agent = run.agent(hello("agent-quiet", "quiet")).await;
    let started = Instant::now();
    let mut silent = tokio::net::TcpStream::connect(run.addr).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        // The server's HTTP/2 preface may come first; then the close.
        loop {
            match silent.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    })
    .await;
    let waited = started.elapsed();
    assert!(closed.is_ok(), "the idle connection was not closed in 10 s");
    assert!(
        waited >= idle,
        "closed after {waited:?}, before the idle time"
    );
    // The agent's stream was open (if quiet) the whole time: still served.
    agent.send(sample(1, T0)).await;
    agent.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    run.stop().await;
}

/// The stream limit is in the HTTP/2 settings, so a client knows it before
/// it opens more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_limit_is_advertised() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_limited(
        &dir,
        ConnectionLimits {
            max_streams: 7,
            ..Default::default()
        },
    )
    .await;
    let tcp = tokio::net::TcpStream::connect(run.addr).await.unwrap();
    let (client, mut conn) = h2::client::handshake(tcp).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    // Drive the connection until the server's SETTINGS are applied (before
    // them h2 assumes no limit).
    let advertised = loop {
        let _ = tokio::time::timeout(
            Duration::from_millis(50),
            futures::future::poll_fn(|cx| std::pin::Pin::new(&mut conn).poll(cx)),
        )
        .await;
        let n = conn.max_concurrent_send_streams();
        if n != usize::MAX || Instant::now() > deadline {
            break n;
        }
    };
    assert_eq!(advertised, 7);
    drop((client, conn));
    run.stop().await;
}

use std::future::Future;
