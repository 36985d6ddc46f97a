//! Bearer tokens over real gRPC on loopback into a real SQLite file: a call
//! without a known token is Unauthenticated and writes nothing; an agent id
//! stays with the token that first used it.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use oomscope_collector::auth::Tokens;
use oomscope_collector::ingest::Collector;
use oomscope_collector::pb;
use oomscope_collector::pb::agent_message::Body;
use oomscope_collector::store::Store;
use oomscope_proto::bearer::Bearer;
use support::*;
use tonic::Code;

const T0: i64 = 1_700_000_000_000_000_000;
const TEAM_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaa";
const TEAM_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbb";

async fn start_with_tokens(dir: &tempfile::TempDir) -> Running {
    let db = dir.path().join("c.db");
    let tokens = Tokens::parse(&format!("team-a:{TEAM_A}\nteam-b:{TEAM_B}\n")).unwrap();
    let collector =
        Collector::new(Store::open(&db).unwrap(), Duration::from_secs(5)).with_tokens(tokens);
    serving(&db, collector).await
}

/// An agent stream presenting `token`: the replies, or the refusal.
struct Stream {
    tx: tokio::sync::mpsc::Sender<pb::AgentMessage>,
    replies: tonic::Streaming<pb::CollectorMessage>,
}

/// Opens the stream; Err: the collector refused it before any handler ran.
async fn try_open(
    run: &Running,
    token: Option<&str>,
    hello: pb::Hello,
) -> Result<Stream, tonic::Status> {
    let mut client = pb::agent_service_client::AgentServiceClient::with_interceptor(
        run.channel().await,
        Bearer::new(token).unwrap(),
    );
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(Body::Hello(hello)),
    })
    .await
    .unwrap();
    let replies = client
        .connect(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map(|r| r.into_inner());
    replies.map(|replies| Stream { tx, replies })
}

async fn open(run: &Running, token: Option<&str>, hello: pb::Hello) -> Stream {
    match try_open(run, token, hello).await {
        Ok(s) => s,
        Err(status) => panic!("the stream was refused at once: {status:?}"),
    }
}

/// The first reply's status, or what came instead.
async fn refusal(stream: &mut Stream) -> tonic::Status {
    match tokio::time::timeout(Duration::from_secs(10), stream.replies.message()).await {
        Ok(Err(status)) => status,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn acked(stream: &mut Stream, want: &BTreeSet<u64>) {
    let mut covered = BTreeSet::new();
    while !want.is_subset(&covered) {
        match tokio::time::timeout(Duration::from_secs(10), stream.replies.message()).await {
            Ok(Ok(Some(pb::CollectorMessage {
                body: Some(pb::collector_message::Body::Ack(a)),
            }))) => covered.extend(a.from_seq..=a.to_seq),
            other => panic!("expected acks for {want:?}, got {other:?}"),
        }
    }
}

/// (agent_id, host) of every stored agent, read over the store's own connection.
fn agents_in(db: &std::path::Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Store::open_reader(db)
        .unwrap()
        .list_agents()
        .unwrap()
        .into_iter()
        .map(|a| {
            let h = a.hello.unwrap_or_default();
            (h.agent_id, h.host)
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_without_a_known_token_are_unauthenticated_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_with_tokens(&dir).await;
    for token in [None, Some("not-a-token-of-this-collector")] {
        let status = match try_open(&run, token, hello("agent-x", "svc")).await {
            Err(status) => status,
            Ok(mut s) => {
                let _ = s.tx.send(oom(1, T0)).await;
                refusal(&mut s).await
            }
        };
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{token:?}: {status:?}"
        );
        let mut q = pb::query_service_client::QueryServiceClient::with_interceptor(
            run.channel().await,
            Bearer::new(token).unwrap(),
        );
        let status = q
            .list_agents(pb::ListAgentsRequest::default())
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{token:?}: {status:?}"
        );
    }
    assert!(
        status_message_names_the_fix(&run).await,
        "a missing token says how to give one"
    );
    assert_eq!(agents_in(&run.db), vec![]);
    assert!(stored_seqs(&run.db, "agent-x").is_empty());
    run.stop().await;
}

async fn status_message_names_the_fix(run: &Running) -> bool {
    let mut q = pb::query_service_client::QueryServiceClient::new(run.channel().await);
    let status = q
        .list_agents(pb::ListAgentsRequest::default())
        .await
        .unwrap_err();
    status.message().contains("OOMSCOPE_TOKEN")
}

/// Two agents, two tokens: each writes as itself; the second token cannot
/// take the first agent's id, and its Hello does not overwrite the first's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_id_stays_with_the_token_that_first_used_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_with_tokens(&dir).await;
    let mut a = open(&run, Some(TEAM_A), hello("agent-a", "svc-a")).await;
    a.tx.send(sample(1, T0 + 1)).await.unwrap();
    acked(&mut a, &BTreeSet::from([1])).await;
    let mut b = open(&run, Some(TEAM_B), hello("agent-b", "svc-b")).await;
    b.tx.send(sample(1, T0 + 1)).await.unwrap();
    acked(&mut b, &BTreeSet::from([1])).await;

    let mut impostor_hello = hello("agent-a", "svc-a");
    impostor_hello.host = "impostor".into();
    let mut impostor = open(&run, Some(TEAM_B), impostor_hello).await;
    let _ = impostor.tx.send(oom(2, T0 + 2)).await;
    let status = refusal(&mut impostor).await;
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("agent-a") && status.message().contains("another token"),
        "{status:?}"
    );
    assert!(
        !status.message().contains("team-a"),
        "the holder's name is not told: {status:?}"
    );
    assert_eq!(
        agents_in(&run.db),
        vec![
            ("agent-a".to_string(), "testhost".to_string()),
            ("agent-b".to_string(), "testhost".to_string())
        ]
    );
    assert_eq!(stored_seqs(&run.db, "agent-a"), vec![1]);
    let stored = Store::open_reader(&run.db).unwrap();
    assert!(stored.incidents(Some("agent-a")).unwrap().is_empty());

    // The real agent, reconnecting with its own token, goes on.
    drop(a);
    let mut again = open(&run, Some(TEAM_A), hello("agent-a", "svc-a")).await;
    again.tx.send(oom(2, T0 + 2)).await.unwrap();
    acked(&mut again, &BTreeSet::from([2])).await;
    assert_eq!(stored_seqs(&run.db, "agent-a"), vec![1, 2]);
    // Either token reads the whole fleet.
    let mut q = pb::query_service_client::QueryServiceClient::with_interceptor(
        run.channel().await,
        Bearer::new(Some(TEAM_B)).unwrap(),
    );
    let listed = q
        .list_agents(pb::ListAgentsRequest::default())
        .await
        .unwrap();
    assert_eq!(listed.into_inner().agents.len(), 2);
    run.stop().await;
}
