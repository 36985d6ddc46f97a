//! An agent's stream to a collector, spoken by hand over real gRPC: the
//! one connect set-up of the tests that play an agent.

use std::collections::BTreeSet;
use std::time::Duration;

use oomscope_proto::v1 as pb;
use pb::agent_message::Body;
use pb::collector_message::Body as Reply;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;

/// How long a test waits for the collector's next reply.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// A gRPC channel to the collector at `url` (`http://host:port`).
pub async fn channel(url: &str) -> Channel {
    Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// Runs `f` to its end on a runtime of its own: for the tests that are not
/// async themselves.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// One agent's open stream: what the test sends and the collector's replies.
/// Our side stays open until [`AgentStream::close`] or drop (a closed stream
/// may end before its acks).
pub struct AgentStream {
    pub tx: Option<mpsc::Sender<pb::AgentMessage>>,
    pub replies: Streaming<pb::CollectorMessage>,
}

impl AgentStream {
    /// Opens the stream to `url` with `hello` (seq 0), then `queued` in
    /// order, all sent as soon as the collector reads them.
    pub async fn connect(url: &str, hello: pb::Hello, queued: Vec<pb::AgentMessage>) -> Self {
        let mut client = pb::agent_service_client::AgentServiceClient::new(channel(url).await)
            .max_encoding_message_size(usize::MAX);
        let (tx, rx) = mpsc::channel(queued.len().max(1023) + 1);
        let hello = pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(hello)),
        };
        for m in std::iter::once(hello).chain(queued) {
            tx.try_send(m).expect("room for every queued message");
        }
        let replies = client
            .connect(ReceiverStream::new(rx))
            .await
            .expect("Connect")
            .into_inner();
        AgentStream {
            tx: Some(tx),
            replies,
        }
    }

    pub async fn send(&self, msg: pb::AgentMessage) {
        self.tx.as_ref().unwrap().send(msg).await.expect("send");
    }

    /// Closes our side without a Goodbye.
    pub fn close(&mut self) {
        self.tx = None;
    }

    /// The next reply, failing the test after [`REPLY_TIMEOUT`].
    pub async fn next(&mut self) -> Result<Option<pb::CollectorMessage>, tonic::Status> {
        tokio::time::timeout(REPLY_TIMEOUT, self.replies.message())
            .await
            .expect("no reply from the collector within 10 s")
    }

    /// Reads acks until every seq in `want` is covered; calls `on_ack` with
    /// each ack as it arrives (to check the store at that very moment).
    pub async fn acks_covering(
        &mut self,
        want: &BTreeSet<u64>,
        mut on_ack: impl FnMut(&pb::Ack),
    ) -> Vec<pb::Ack> {
        let mut covered = BTreeSet::new();
        let mut acks = Vec::new();
        while !want.is_subset(&covered) {
            match self.next().await {
                Ok(Some(pb::CollectorMessage {
                    body: Some(Reply::Ack(ack)),
                })) => {
                    assert!(ack.from_seq <= ack.to_seq, "inverted ack {ack:?}");
                    on_ack(&ack);
                    covered.extend(ack.from_seq..=ack.to_seq);
                    acks.push(ack);
                }
                other => panic!("expected acks for {want:?}, covered {covered:?}, got {other:?}"),
            }
        }
        acks
    }
}
