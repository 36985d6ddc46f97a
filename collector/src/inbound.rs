//! What a request may hold of the collector while its messages arrive: each
//! gRPC message must arrive whole within a deadline once its first byte
//! came, and the bytes of messages still arriving, across every stream, are
//! capped. Without them a client that sends most of a 16 MiB message and
//! stops holds that memory for as long as it keeps the stream (24 such
//! streams held 357 MiB, measured). The layer also counts each request as
//! a stream of its connection (see `accept.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures::future::BoxFuture;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::body::Body;
use tonic::transport::server::TcpConnectInfo;
use tonic::Status;

use crate::accept::{ConnectionInfo, StreamGuard};

/// The limits [`InboundLayer`] enforces.
#[derive(Clone, Debug)]
pub struct InboundLimits {
    /// How long one message may take to arrive once its first byte came.
    pub message_deadline: Duration,
    /// The bytes of partly arrived messages, across all streams.
    pub max_buffered_bytes: usize,
}

/// A gRPC message frame's header: a compression flag and a 4-byte length.
const FRAME_HEADER: usize = 5;

/// Wraps every request's body in an [`InboundBody`] and counts the request
/// as a stream of its connection until both its body and its handler's
/// answer are done.
#[derive(Clone)]
pub struct InboundLayer {
    limits: InboundLimits,
    buffered: Arc<AtomicUsize>,
}

impl InboundLayer {
    pub fn new(limits: InboundLimits) -> InboundLayer {
        InboundLayer {
            limits,
            buffered: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl<S> tower_layer::Layer<S> for InboundLayer {
    type Service = Inbound<S>;

    fn layer(&self, inner: S) -> Inbound<S> {
        Inbound {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Inbound<S> {
    inner: S,
    layer: InboundLayer,
}

impl<S, R> tower_service::Service<http::Request<Body>> for Inbound<S>
where
    S: tower_service::Service<http::Request<Body>, Response = R> + Send,
    S::Future: Send + 'static,
{
    type Response = R;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<R, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let (guard, answering) = match parts.extensions.get::<ConnectionInfo>().cloned() {
            Some(info) => {
                // `Request::remote_addr` reads this one.
                parts.extensions.insert::<TcpConnectInfo>(info.tcp);
                (
                    Some(info.streams.open_stream()),
                    Some(info.streams.open_stream()),
                )
            }
            None => (None, None),
        };
        let body = InboundBody::new(body, &self.layer, guard);
        let answer = self
            .inner
            .call(http::Request::from_parts(parts, Body::new(body)));
        Box::pin(async move {
            let answer = answer.await;
            drop(answering);
            answer
        })
    }
}

/// A request body that follows the gRPC message framing as its bytes pass,
/// and fails the stream when a message is late or the shared cap is full.
pub struct InboundBody {
    inner: Body,
    limits: InboundLimits,
    buffered: Arc<AtomicUsize>,
    /// Bytes of the message now arriving (header included), 0 between
    /// messages; what this body adds to the shared count.
    partial: usize,
    /// Header bytes of the message now arriving, while under 5.
    header: [u8; FRAME_HEADER],
    /// Bytes still to come of the message now arriving, once its header is in.
    remaining: Option<usize>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    failed: bool,
    _stream: Option<StreamGuard>,
}

impl InboundBody {
    fn new(inner: Body, layer: &InboundLayer, stream: Option<StreamGuard>) -> InboundBody {
        InboundBody {
            inner,
            limits: layer.limits.clone(),
            buffered: layer.buffered.clone(),
            partial: 0,
            header: [0; FRAME_HEADER],
            remaining: None,
            deadline: None,
            failed: false,
            _stream: stream,
        }
    }

    /// Follows the framing over `data`; returns whether a message completed.
    fn follow(&mut self, mut data: &[u8]) -> bool {
        let mut completed = false;
        while !data.is_empty() {
            match self.remaining {
                None => {
                    let have = self.partial;
                    let take = (FRAME_HEADER - have).min(data.len());
                    self.header[have..have + take].copy_from_slice(&data[..take]);
                    self.partial += take;
                    data = &data[take..];
                    if self.partial == FRAME_HEADER {
                        let len = u32::from_be_bytes(self.header[1..].try_into().unwrap());
                        self.remaining = Some(len as usize);
                    }
                }
                Some(left) => {
                    let take = left.min(data.len());
                    self.partial += take;
                    self.remaining = Some(left - take);
                    data = &data[take..];
                }
            }
            if self.remaining == Some(0) {
                // Whole: tonic decodes it from here.
                self.remaining = None;
                self.partial = 0;
                completed = true;
            }
        }
        completed
    }

    /// Follows `data` and settles the shared count; an error when the cap
    /// is passed.
    fn account(&mut self, data: &Bytes) -> Result<(), Status> {
        let was = self.partial;
        let completed = self.follow(data.chunk());
        let now = self.partial;
        if now > was {
            let before = self.buffered.fetch_add(now - was, Ordering::AcqRel);
            if before + (now - was) > self.limits.max_buffered_bytes {
                return Err(Status::resource_exhausted(format!(
                    "the collector holds {} bytes of messages still arriving, over its cap of {} \
                     (--max-buffered-mib); this stream's message is dropped, resend later",
                    before + (now - was),
                    self.limits.max_buffered_bytes
                )));
            }
        } else {
            self.buffered.fetch_sub(was - now, Ordering::AcqRel);
        }
        if now == 0 {
            self.deadline = None;
        } else if was == 0 || completed {
            // A new message started: its own deadline.
            self.deadline = Some(Box::pin(tokio::time::sleep(self.limits.message_deadline)));
        }
        Ok(())
    }

    /// Drops what this body counts (its message will never complete).
    fn release(&mut self) {
        self.buffered.fetch_sub(self.partial, Ordering::AcqRel);
        self.partial = 0;
        self.remaining = None;
        self.deadline = None;
    }

    fn fail(&mut self, status: Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.release();
        self.failed = true;
        Poll::Ready(Some(Err(status)))
    }
}

impl Drop for InboundBody {
    fn drop(&mut self) {
        self.release();
    }
}

impl HttpBody for InboundBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if let Err(status) = this.account(data) {
                        return this.fail(status);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => {
                this.release();
                Poll::Ready(other)
            }
            Poll::Pending => {
                let late = this
                    .deadline
                    .as_mut()
                    .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                if !late {
                    return Poll::Pending;
                }
                let status = Status::deadline_exceeded(format!(
                    "a message did not arrive whole within {:?} of its first byte ({} bytes \
                     came); it is dropped and the stream ended (--message-deadline)",
                    this.limits.message_deadline, this.partial
                ));
                this.fail(status)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(limits: InboundLimits) -> InboundBody {
        InboundBody::new(Body::empty(), &InboundLayer::new(limits), None)
    }

    fn frame(len: u32) -> Vec<u8> {
        let mut f = vec![0u8];
        f.extend_from_slice(&len.to_be_bytes());
        f.extend(std::iter::repeat_n(7u8, len as usize));
        f
    }

    #[test]
    fn partial_bytes_follow_the_framing_across_chunks() {
        let mut b = body(InboundLimits {
            message_deadline: Duration::from_secs(1),
            max_buffered_bytes: 1 << 20,
        });
        let mut two = frame(10);
        two.extend(frame(3));
        // The first message whole, then 2 bytes of the second's header.
        b.follow(&two[..17]);
        assert_eq!((b.partial, b.remaining), (2, None));
        b.follow(&two[17..20]);
        assert_eq!((b.partial, b.remaining), (5, Some(3)));
        b.follow(&two[20..]);
        assert_eq!((b.partial, b.remaining), (0, None), "both whole");
        b.follow(&frame(0));
        assert_eq!(b.partial, 0, "an empty message is whole at its header");
    }

    #[tokio::test]
    async fn the_shared_count_refuses_past_the_cap_and_returns_on_drop() {
        let layer = InboundLayer::new(InboundLimits {
            message_deadline: Duration::from_secs(1),
            max_buffered_bytes: 100,
        });
        let mut a = InboundBody::new(Body::empty(), &layer, None);
        let mut b = InboundBody::new(Body::empty(), &layer, None);
        let big = frame(1000);
        a.account(&Bytes::copy_from_slice(&big[..60])).unwrap();
        assert_eq!(layer.buffered.load(Ordering::Acquire), 60);
        let err = b.account(&Bytes::copy_from_slice(&big[..60])).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        b.release();
        drop(a);
        assert_eq!(layer.buffered.load(Ordering::Acquire), 0);
    }
}
