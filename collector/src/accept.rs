//! Accepting connections so that no client can pin the collector: accept
//! errors (the file-descriptor limit reached) back off instead of spinning
//! and are logged at most once a second, and a connection that carries no
//! stream for the idle time is closed (see [`Connection`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The first pause after a failed accept; each further failure in a row
/// doubles it up to [`MAX_ACCEPT_BACKOFF`]. Out of descriptors, an accept
/// fails at once for as long as the limit holds: without a pause the loop
/// spins a core (6.2 s of CPU in 16.9 s, measured).
pub const MIN_ACCEPT_BACKOFF: Duration = Duration::from_millis(5);
/// The longest pause between accept attempts: a freed descriptor is used
/// within this long, which keeps `agents` answering soon after the
/// connections that held them close.
pub const MAX_ACCEPT_BACKOFF: Duration = Duration::from_millis(200);
/// At most one line of accept errors per this long (the others are counted
/// into the next line): the same error at the accept rate filled 349 MB of
/// log in 17 s.
pub const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Accepted connections of `listener`; never yields an error (a failed
/// accept waits and tries again), so tonic's own accept loop never spins.
pub struct Incoming {
    listener: TcpListener,
    idle: Duration,
    backoff: Duration,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
    errors: AcceptErrorLog,
}

impl Incoming {
    /// Connections that carry no stream for `idle` are closed.
    pub fn new(listener: TcpListener, idle: Duration) -> Incoming {
        Incoming {
            listener,
            idle,
            backoff: MIN_ACCEPT_BACKOFF,
            pause: None,
            errors: AcceptErrorLog::default(),
        }
    }
}

impl Stream for Incoming {
    type Item = Result<Connection, io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(pause) = &mut this.pause {
                futures::ready!(pause.as_mut().poll(cx));
                this.pause = None;
            }
            match futures::ready!(this.listener.poll_accept(cx)) {
                Ok((stream, peer)) => {
                    this.backoff = MIN_ACCEPT_BACKOFF;
                    this.errors.recovered();
                    let _ = stream.set_nodelay(true);
                    return Poll::Ready(Some(Ok(Connection::new(stream, peer, this.idle))));
                }
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    this.errors.failed(&e, this.backoff);
                    this.pause = Some(Box::pin(tokio::time::sleep(this.backoff)));
                    this.backoff = (this.backoff * 2).min(MAX_ACCEPT_BACKOFF);
                }
            }
        }
    }
}

/// Errors of one connection that died before it was accepted: the next
/// accept is unaffected, so no pause (as hyper and tokio treat them).
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// One warning per [`ACCEPT_ERROR_LOG_INTERVAL`], with how many failures
/// it stands for.
#[derive(Default)]
struct AcceptErrorLog {
    last: Option<Instant>,
    unlogged: u64,
}

impl AcceptErrorLog {
    fn failed(&mut self, e: &io::Error, pause: Duration) {
        self.unlogged += 1;
        if self
            .last
            .is_some_and(|t| t.elapsed() < ACCEPT_ERROR_LOG_INTERVAL)
        {
            return;
        }
        tracing::warn!(
            failures = self.unlogged,
            "cannot accept connections: {e} (pausing {pause:?} between tries; \
             at most one such line a second)"
        );
        self.last = Some(Instant::now());
        self.unlogged = 0;
    }

    fn recovered(&mut self) {
        if self.last.take().is_some() {
            tracing::info!(
                unlogged_failures = self.unlogged,
                "accepting connections again"
            );
        }
        self.unlogged = 0;
    }
}

/// How many streams a connection carries, and since when it carries none.
/// Shared by its [`Connection`] (which closes it) and the streams' guards
/// (`inbound.rs`, which count).
#[derive(Debug)]
pub struct ConnectionStreams {
    open: AtomicUsize,
    idle_since: Mutex<Instant>,
}

impl ConnectionStreams {
    fn new() -> ConnectionStreams {
        ConnectionStreams {
            open: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
        }
    }

    /// Counts a stream until the guard drops.
    pub fn open_stream(self: &Arc<Self>) -> StreamGuard {
        self.open.fetch_add(1, Ordering::AcqRel);
        StreamGuard(self.clone())
    }

    /// How long the connection has carried no stream; None while it has one.
    fn idle_for(&self) -> Option<Duration> {
        let since = *self.idle_since.lock();
        (self.open.load(Ordering::Acquire) == 0).then(|| since.elapsed())
    }
}

/// One open stream of a connection (see [`ConnectionStreams`]).
#[derive(Debug)]
pub struct StreamGuard(Arc<ConnectionStreams>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // Under the lock, so an idle check never pairs a zero count with
        // the previous idle start.
        let mut since = self.0.idle_since.lock();
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            *since = Instant::now();
        }
    }
}

/// What a connection tells each of its requests (tonic puts it in the
/// request's extensions): the peer, and the stream count to join.
#[derive(Clone, Debug)]
pub struct ConnectionInfo {
    pub tcp: TcpConnectInfo,
    pub streams: Arc<ConnectionStreams>,
}

/// An accepted TCP connection that ends itself (reads as closed, so the
/// HTTP/2 server drops it) once it has carried no stream for `idle`: a
/// client that holds connections open without using them holds no
/// descriptor for long.
pub struct Connection {
    stream: TcpStream,
    info: ConnectionInfo,
    idle: Duration,
    check: Pin<Box<tokio::time::Sleep>>,
    closed_idle: bool,
    frames: GoawayWatch,
}

impl Connection {
    fn new(stream: TcpStream, peer: SocketAddr, idle: Duration) -> Connection {
        let tcp = TcpConnectInfo {
            local_addr: stream.local_addr().ok(),
            remote_addr: Some(peer),
        };
        Connection {
            stream,
            info: ConnectionInfo {
                tcp,
                streams: Arc::new(ConnectionStreams::new()),
            },
            idle,
            check: Box::pin(tokio::time::sleep(idle)),
            closed_idle: false,
            frames: GoawayWatch::default(),
        }
    }

    /// True once the connection should be closed; else arms the timer for
    /// the next check (hyper polls reads for as long as a connection lives,
    /// so the timer wakes it).
    fn idle_expired(&mut self, cx: &mut Context<'_>) -> bool {
        while self.check.as_mut().poll(cx).is_ready() {
            let next = match self.info.streams.idle_for() {
                Some(idle_for) if idle_for >= self.idle => return true,
                Some(idle_for) => self.idle - idle_for,
                None => self.idle,
            };
            self.check
                .as_mut()
                .reset(tokio::time::Instant::now() + next);
        }
        false
    }
}

impl Connected for Connection {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        self.info.clone()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.closed_idle {
            return Poll::Ready(Ok(()));
        }
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Pending if this.idle_expired(cx) => {
                tracing::debug!(
                    peer = ?this.info.tcp.remote_addr,
                    "closed a connection idle (no stream) for {:?}",
                    this.idle
                );
                this.closed_idle = true;
                // End of input: the server closes the connection.
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = written {
            this.frames.watch(&buf[..n], this.info.tcp.remote_addr);
        }
        written
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// HTTP/2 frame header: length (3), type, flags, stream id (4).
const FRAME_HEADER: usize = 9;
const GOAWAY: u8 = 0x7;
/// What of a GOAWAY's payload is read: last stream, error code and the
/// start of the debug text.
const GOAWAY_KEPT: usize = 8 + 120;

/// Follows the frames the server writes on a connection, to log why it
/// closes one in error (a GOAWAY with an error code): the one line that
/// says why a client's connection dropped, at the default log level,
/// where tonic says it only at debug.
#[derive(Default)]
struct GoawayWatch {
    header: Vec<u8>,
    /// Payload bytes still to pass of the current frame.
    remaining: usize,
    /// The current GOAWAY's payload, while one passes.
    goaway: Option<Vec<u8>>,
    logged: bool,
}

impl GoawayWatch {
    fn watch(&mut self, mut out: &[u8], peer: Option<SocketAddr>) {
        while !out.is_empty() && !self.logged {
            if self.remaining == 0 && self.goaway.is_none() {
                let take = (FRAME_HEADER - self.header.len()).min(out.len());
                self.header.extend_from_slice(&out[..take]);
                out = &out[take..];
                if self.header.len() == FRAME_HEADER {
                    let h = std::mem::take(&mut self.header);
                    self.remaining = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
                    self.goaway = (h[3] == GOAWAY).then(Vec::new);
                }
                continue;
            }
            let take = self.remaining.min(out.len());
            if let Some(g) = &mut self.goaway {
                let room = GOAWAY_KEPT.saturating_sub(g.len()).min(take);
                g.extend_from_slice(&out[..room]);
            }
            self.remaining -= take;
            out = &out[take..];
            if self.remaining == 0 {
                if let Some(g) = self.goaway.take() {
                    self.goaway_sent(&g, peer);
                }
            }
        }
    }

    fn goaway_sent(&mut self, payload: &[u8], peer: Option<SocketAddr>) {
        if payload.len() < 8 {
            return;
        }
        let code = u32::from_be_bytes(payload[4..8].try_into().unwrap());
        if code == 0 {
            return; // NO_ERROR: a graceful close.
        }
        self.logged = true;
        let reason = h2_error_name(code);
        let detail = String::from_utf8_lossy(&payload[8..]);
        tracing::warn!(
            ?peer,
            "closed a connection for an HTTP/2 protocol error: {reason} {detail}"
        );
    }
}

/// RFC 9113 section 7's error codes.
fn h2_error_name(code: u32) -> String {
    let name = match code {
        0x1 => "PROTOCOL_ERROR",
        0x2 => "INTERNAL_ERROR",
        0x3 => "FLOW_CONTROL_ERROR",
        0x4 => "SETTINGS_TIMEOUT",
        0x5 => "STREAM_CLOSED",
        0x6 => "FRAME_SIZE_ERROR",
        0x7 => "REFUSED_STREAM",
        0x8 => "CANCEL",
        0x9 => "COMPRESSION_ERROR",
        0xa => "CONNECT_ERROR",
        0xb => "ENHANCE_YOUR_CALM",
        0xc => "INADEQUATE_SECURITY",
        0xd => "HTTP_1_1_REQUIRED",
        _ => return format!("error code {code:#x}"),
    };
    name.to_string()
}
