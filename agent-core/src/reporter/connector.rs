//! The reporter's TCP connections. tonic would open them itself; they are
//! opened here so that each socket is recorded for `fork` from the moment
//! it exists, and a forked child closes its copy (see `fork`'s doc).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpSocket, TcpStream};
use tonic::transport::Uri;

use super::fork::ClosedInChild;

/// Connects to the collector's host and port as tonic's own connector does
/// (each resolved address in turn, `TCP_NODELAY` on), recording the socket.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Connector;

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Connection>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(async move { connect(&uri).await.map(TokioIo::new) })
    }
}

async fn connect(uri: &Uri) -> io::Result<Connection> {
    let host = uri
        .host()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no host in {uri}")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(80);
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        match connect_to(addr).await {
            Ok(connection) => return Ok(connection),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"))
    }))
}

async fn connect_to(addr: SocketAddr) -> io::Result<Connection> {
    // Close-on-exec already (tokio opens it with SOCK_CLOEXEC): what runs
    // exec never sees it. Recorded before it connects, so a fork during
    // the handshake does not keep it either.
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    let closed_in_child = ClosedInChild::track(socket.as_raw_fd());
    socket.set_nodelay(true)?;
    let stream = socket.connect(addr).await?;
    Ok(Connection {
        _closed_in_child: closed_in_child,
        stream,
    })
}

/// A recorded socket: the record goes when the socket closes.
pub(super) struct Connection {
    // Dropped before `stream`, so no record outlives the socket (one that
    // did would be harmless, see `ClosedInChild`).
    _closed_in_child: ClosedInChild,
    stream: TcpStream,
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
