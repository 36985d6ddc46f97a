//! Incidents and faults over real gRPC: OOM events, deaths, lost agents,
//! malformed and oversized messages, and diagnosis requests.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use oomscope_collector::pb;
use oomscope_collector::pb::agent_message::Body;
use oomscope_collector::pb::event::Kind;
use prost::Message;
use support::*;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

const T0: i64 = 1_700_000_000_000_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_and_deaths_raise_incidents_and_a_clean_exit_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    // One agent hits a device OOM; another supervises children that die.
    let mut agent = run.agent(hello("agent-o", "frag")).await;
    agent.send(sample(1, T0 + 1)).await;
    agent.send(oom(2, T0 + 2)).await;
    agent.acks_covering(&BTreeSet::from([1, 2]), |_| {}).await;
    // A resend of the OOM must not raise a second incident.
    agent.send(oom(2, T0 + 2)).await;
    agent.acks_covering(&BTreeSet::from([2]), |_| {}).await;

    let mut sup = run.agent(hello("agent-x", "supervisor")).await;
    let exit = |seq: u64, x: pb::ChildExit| event(seq, T0 + seq as i64, Kind::ChildExit(x));
    sup.send(exit(
        3,
        pb::ChildExit {
            pid: 7,
            signal: Some(9),
            ..Default::default()
        },
    ))
    .await;
    sup.send(exit(
        4,
        pb::ChildExit {
            pid: 8,
            exit_code: Some(1),
            stderr_tail: "Traceback...\nMemoryError: Unable to allocate 4.00 GiB\n".into(),
            ..Default::default()
        },
    ))
    .await;
    sup.send(exit(
        5,
        pb::ChildExit {
            pid: 9,
            exit_code: Some(0),
            ..Default::default()
        },
    ))
    .await;
    sup.send(exit(
        6,
        pb::ChildExit {
            pid: 10,
            exit_code: Some(2),
            stderr_tail: "usage: bad flag\n".into(),
            ..Default::default()
        },
    ))
    .await;
    sup.send(exit(
        7,
        pb::ChildExit {
            pid: 11,
            signal: Some(9),
            crash_loop: true,
            attempt: 3,
            ..Default::default()
        },
    ))
    .await;
    sup.acks_covering(&(3..=7).collect(), |_| {}).await;

    let oom_incs = incidents(&run, "frag").await;
    assert_eq!(oom_incs.len(), 1, "{oom_incs:?}");
    let o = &oom_incs[0];
    assert_eq!(
        (o.id.as_str(), o.kind.as_str(), o.seq, o.time_ns),
        ("inc-000001", "oom", 2, T0 + 2)
    );
    assert_eq!(
        (o.agent_id.as_str(), o.agent_name.as_str()),
        ("agent-o", "frag")
    );
    assert_eq!(
        o.domain, "gpu_vram",
        "the analysis blames VRAM for an allocator OOM"
    );
    assert!(o.summary.contains("96.0 MiB"), "{}", o.summary);

    let incs = incidents(&run, "supervisor").await;
    let got: Vec<(&str, &str, u64, i64)> = incs
        .iter()
        .map(|i| (i.id.as_str(), i.kind.as_str(), i.seq, i.time_ns))
        .collect();
    assert_eq!(
        got,
        vec![
            ("inc-000002", "signal", 3, T0 + 3),
            ("inc-000003", "exit_oom_text", 4, T0 + 4),
            ("inc-000004", "crash_loop", 7, T0 + 7)
        ]
    );
    assert!(incs.iter().all(|i| !i.domain.is_empty()), "{incs:?}");
    assert!(
        incs[1]
            .summary
            .contains("MemoryError: Unable to allocate 4.00 GiB"),
        "{}",
        incs[1].summary
    );
    assert_eq!(incidents(&run, "").await.len(), 4);

    // Diagnose by id names the incident and agent; an unknown id is NotFound.
    let mut q = run.query().await;
    let d = q
        .diagnose(pb::DiagnoseRequest {
            incident: "inc-000001".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.incident.as_deref(), Some("inc-000001"));
    assert_eq!(d.agent.as_deref(), Some("frag"), "the agent by its name");
    assert_eq!(d.domain.as_deref(), Some("gpu_vram"));
    assert!(!d.evidence.is_empty(), "{d:?}");
    assert!(
        d.evidence.iter().any(|l| l.contains("requested 96.0 MiB")),
        "{:?}",
        d.evidence
    );
    let by_agent = q
        .diagnose(pb::DiagnoseRequest {
            agent: "supervisor".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_agent.incident.as_deref(), Some("inc-000004"));
    assert_eq!(by_agent.exit.as_ref().and_then(|x| x.signal), Some(9));
    let latest = q
        .diagnose(pb::DiagnoseRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(latest.incident.as_deref(), Some("inc-000004"));
    let missing = q
        .diagnose(pb::DiagnoseRequest {
            incident: "inc-999999".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    assert!(
        missing.message().contains("inc-999999"),
        "{}",
        missing.message()
    );
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_is_lost_after_the_grace_and_a_goodbye_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let grace = Duration::from_millis(300);
    let run = start(&dir.path().join("c.db"), grace).await;

    let mut silent = run.agent(hello("agent-s", "silent")).await;
    silent.send(sample(1, T0)).await;
    silent.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    let mut polite = run.agent(hello("agent-g", "polite")).await;
    polite.send(sample(1, T0)).await;
    polite.send(goodbye(2)).await;
    polite.acks_covering(&BTreeSet::from([1, 2]), |_| {}).await;
    let mut flaky = run.agent(hello("agent-f", "flaky")).await;
    flaky.send(sample(1, T0)).await;
    flaky.acks_covering(&BTreeSet::from([1]), |_| {}).await;

    drop(silent);
    drop(polite);
    // Flaky drops and comes back within the grace: not lost.
    drop(flaky);
    let mut flaky = run.agent(hello("agent-f", "flaky")).await;
    flaky.send(sample(2, T0 + 1)).await;
    flaky.acks_covering(&BTreeSet::from([2]), |_| {}).await;

    let lost = eventually(Duration::from_secs(5), || async {
        incidents(&run, "agent-s").await.into_iter().next()
    })
    .await
    .expect("an agent_lost incident for the silent agent");
    assert_eq!(
        (lost.kind.as_str(), lost.seq, lost.agent_name.as_str()),
        ("agent_lost", 0, "silent")
    );
    assert!(
        lost.summary.contains("without a Goodbye"),
        "{}",
        lost.summary
    );
    // Give the other two the same time to (wrongly) be declared lost.
    tokio::time::sleep(grace * 3).await;
    assert!(incidents(&run, "agent-g").await.is_empty());
    assert!(incidents(&run, "agent-f").await.is_empty());
    assert_eq!(agent_summary(&run, "agent-s").await.state, "lost");
    assert_eq!(
        agent_summary(&run, "agent-s").await.samples,
        1,
        "a lost agent keeps its samples"
    );
    assert_eq!(agent_summary(&run, "agent-g").await.state, "disconnected");
    assert_eq!(agent_summary(&run, "agent-f").await.state, "connected");
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_goodbye_whose_last_messages_never_came_is_evidence_incomplete_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let grace = Duration::from_millis(300);
    let run = start(&dir.path().join("c.db"), grace).await;

    // A child that said Goodbye (seq 5) and ended before 3 and 4 went out.
    let mut cut = run.agent(hello("agent-cut", "cut")).await;
    cut.send(sample(1, T0)).await;
    cut.send(sample(2, T0 + 1)).await;
    cut.send(goodbye(5)).await;
    cut.acks_covering(&BTreeSet::from([1, 2, 5]), |_| {}).await;
    // Everything up to its Goodbye arrived.
    let mut whole = run.agent(hello("agent-whole", "whole")).await;
    for seq in 1..=3 {
        whole.send(sample(seq, T0 + seq as i64)).await;
    }
    whole.send(goodbye(4)).await;
    whole
        .acks_covering(&BTreeSet::from([1, 2, 3, 4]), |_| {})
        .await;
    // Seq 2 was thinned away while the collector was down, long before
    // the end: its last messages did arrive.
    let mut thinned = run.agent(hello("agent-thinned", "thinned")).await;
    for seq in [1, 3, 4] {
        thinned.send(sample(seq, T0 + seq as i64)).await;
    }
    thinned.send(goodbye(5)).await;
    thinned
        .acks_covering(&BTreeSet::from([1, 3, 4, 5]), |_| {})
        .await;
    drop(cut);
    drop(whole);
    drop(thinned);

    let state = eventually(Duration::from_secs(5), || async {
        let s = agent_summary(&run, "agent-cut").await.state;
        (s == oomscope_proto::EVIDENCE_INCOMPLETE_STATE).then_some(s)
    })
    .await;
    assert!(
        state.is_some(),
        "still {:?}",
        agent_summary(&run, "agent-cut").await.state
    );
    // Past the grace: none of them is lost, and each keeps its Goodbye.
    tokio::time::sleep(grace * 3).await;
    for id in ["agent-cut", "agent-whole", "agent-thinned"] {
        assert!(incidents(&run, id).await.is_empty(), "{id} has an incident");
        assert!(agent_summary(&run, id).await.goodbye.is_some(), "{id}");
    }
    assert_eq!(
        agent_summary(&run, "agent-cut").await.state,
        oomscope_proto::EVIDENCE_INCOMPLETE_STATE
    );
    assert_eq!(agent_summary(&run, "agent-cut").await.samples, 2);
    assert_eq!(
        agent_summary(&run, "agent-whole").await.state,
        "disconnected"
    );
    assert_eq!(
        agent_summary(&run, "agent-thinned").await.state,
        "disconnected"
    );
    run.stop().await;
}

/// Sends raw bytes as gRPC messages, to put what no well-behaved client would
/// on the wire; decodes replies as CollectorMessage.
#[derive(Clone, Default)]
struct RawCodec;
struct RawEncoder;
struct ReplyDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = pb::CollectorMessage;
    type Encoder = RawEncoder;
    type Decoder = ReplyDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> ReplyDecoder {
        ReplyDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for ReplyDecoder {
    type Item = pb::CollectorMessage;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<pb::CollectorMessage>, Status> {
        pb::CollectorMessage::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

async fn raw_stream(
    run: &Running,
    frames: Vec<Vec<u8>>,
) -> Result<Vec<pb::CollectorMessage>, Status> {
    let mut grpc = tonic::client::Grpc::new(run.channel().await);
    grpc.ready().await.unwrap();
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/oomscope.v1.AgentService/Connect");
    // Keep our side open so that only the collector can end the stream.
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(8);
    for f in frames {
        tx.send(f).await.unwrap();
    }
    let request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut replies = grpc.streaming(request, path, RawCodec).await?.into_inner();
    let mut got = Vec::new();
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match replies.message().await {
                Ok(Some(m)) => got.push(m),
                Ok(None) => return Ok(()),
                Err(s) => return Err(s),
            }
        }
    })
    .await
    .expect("the collector neither replied nor closed within 10 s");
    drop(tx);
    outcome.map(|_| got)
}

fn hello_bytes(agent_id: &str) -> Vec<u8> {
    pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(hello(agent_id, "bad"))),
    }
    .encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_messages_get_clear_errors_and_serving_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;

    // An Event field (4) that claims 5 bytes and carries 1.
    let malformed = raw_stream(
        &run,
        vec![
            hello_bytes("agent-m"),
            sample(1, T0).encode_to_vec(),
            vec![0x22, 0x05, 0x01],
        ],
    )
    .await
    .expect_err("a malformed message must end the stream with an error");
    assert_eq!(malformed.code(), tonic::Code::Internal, "{malformed:?}");
    assert!(
        malformed
            .message()
            .contains("not a valid oomscope.v1.AgentMessage")
            && malformed.message().contains("agent-m")
            && malformed.message().contains("after seq 1"),
        "{}",
        malformed.message()
    );
    // What came before the bad frame was stored.
    assert_eq!(stored_seqs(&run.db, "agent-m"), vec![1]);

    // A well-formed message one byte over the limit.
    let mut big = sample(1, T0);
    if let Some(Body::Sample(s)) = &mut big.body {
        s.context = Some(pb::RequestContext {
            labels: [(
                "blob".to_string(),
                "x".repeat(oomscope_proto::MAX_MESSAGE_BYTES),
            )]
            .into(),
            ..Default::default()
        });
    }
    let oversized = raw_stream(&run, vec![hello_bytes("agent-big"), big.encode_to_vec()])
        .await
        .expect_err("an oversized message must end the stream with an error");
    assert_eq!(oversized.code(), tonic::Code::OutOfRange, "{oversized:?}");
    assert!(
        oversized.message().contains(&format!(
            "limit of {} bytes",
            oomscope_proto::MAX_MESSAGE_BYTES
        )),
        "{}",
        oversized.message()
    );
    assert!(stored_seqs(&run.db, "agent-big").is_empty());

    // The collector still serves a new, well-formed stream.
    let mut good = run.agent(hello("agent-ok", "ok")).await;
    for seq in 1..=3 {
        good.send(sample(seq, T0 + seq as i64)).await;
    }
    good.acks_covering(&(1..=3).collect(), |_| {}).await;
    assert_eq!(stored_seqs(&run.db, "agent-ok"), vec![1, 2, 3]);
    run.stop().await;
}
