//! The worker: one thread with its own current-thread runtime that connects
//! to the collector, writes Hello, the backlog and then live traffic, applies
//! acks, and reconnects with backoff when the stream fails. All the network
//! and disk work of a reporter happens here, never on the caller's thread.
//!
//! What is owed and what an ack releases is the [`Ledger`]'s business; this
//! file moves messages between the caller's queue, the spool, the ledger and
//! the stream, and tells waiting callers how far everything is settled.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Duration;

use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

use super::connector::Connector;
use super::ledger::{stamp, Ledger, Released};
use super::{ReporterConfig, Shared};
use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::collector_message::Body as Reply;
use crate::spool::{Origin, Spool};
use crate::sync::lock;
use oomscope_proto::tls::error_chain;

/// Messages buffered between the worker and the HTTP/2 stream; more only
/// adds latency to acks, the stream itself does flow control.
const OUTBOUND_BUFFER: usize = 64;
/// HTTP/2 pings find a collector that vanished without closing the socket
/// (a dead host, a dropped route).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// The least a reread of the spool brings back into memory.
const REREAD_MIN_BYTES: usize = 1024 * 1024;

/// A message that bypasses the bounded queue (an OOM event, the Goodbye).
pub(super) struct Urgent {
    pub message: pb::AgentMessage,
    /// Already appended by the caller, with the seqs that append pushed out.
    pub spooled: Option<Vec<u64>>,
}

/// The worker's receiving ends, kept apart from [`Worker`] so that
/// `select!` can poll them while its handlers change the worker.
pub(super) struct Inputs {
    pub queue: mpsc::Receiver<pb::AgentMessage>,
    pub urgent: mpsc::UnboundedReceiver<Urgent>,
    pub stop: watch::Receiver<bool>,
    /// True once the reporter is not held (at once when it never was).
    pub release: watch::Receiver<bool>,
    /// The Hello as the agent last changed it.
    pub hello: watch::Receiver<pb::Hello>,
}

pub(super) struct Worker {
    cfg: ReporterConfig,
    hello: pb::Hello,
    shared: Arc<Shared>,
    directives: std_mpsc::SyncSender<pb::Directive>,
    ledger: Ledger,
    /// Messages read back from the spool for resending, not yet sent.
    reread: BTreeMap<u64, pb::AgentMessage>,
    sessions: u64,
    /// Whether the last failure was already logged at warn level.
    failing: bool,
    /// Which of the collector URLs (`collector_url` is a comma-separated
    /// list) the next session dials: a failed session moves to the next, so
    /// an agent whose collector died continues its seqs on another.
    collector: usize,
}

enum SessionEnd {
    Stopped,
    Failed { acked: bool, error: String },
}

impl Worker {
    /// A worker for a run whose first seq is `next_seq`.
    pub(super) fn new(
        cfg: ReporterConfig,
        hello: pb::Hello,
        shared: Arc<Shared>,
        directives: std_mpsc::SyncSender<pb::Directive>,
        next_seq: u64,
    ) -> Worker {
        Worker {
            ledger: Ledger::new(cfg.unacked_max_bytes, next_seq),
            cfg,
            hello,
            shared,
            directives,
            reread: BTreeMap::new(),
            sessions: 0,
            failing: false,
            collector: 0,
        }
    }

    /// The thread's body: waits out a held start, streams until asked to
    /// stop, then puts what is still queued in the spool and tells waiters
    /// it has exited. Stopped while held, it drops what was queued.
    pub(super) fn run(mut self, mut inputs: Inputs) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(error = %e, "oomscope reporter: cannot build its runtime; nothing will be sent");
                self.shared.set_error(format!("cannot build runtime: {e}"));
                self.exit();
                return;
            }
        };
        if !runtime.block_on(released(&mut inputs)) {
            self.exit();
            return;
        }
        self.open_deferred_spool();
        runtime.block_on(self.serve(&mut inputs));
        self.drain_on_stop(&mut inputs);
        self.exit();
    }

    /// After a held start with a spool root and no spool yet: opens it now.
    /// This agent id had none at start, so seqs start at 1 as they did in
    /// the queue; a spool that does not (someone made it meanwhile) is not
    /// used, since its seqs would clash with the queued ones.
    fn open_deferred_spool(&mut self) {
        if let (Some(root), None) = (self.cfg.spool_dir.clone(), self.shared.spool.get()) {
            self.open_spool_now(&root);
        }
        lock(&self.shared.progress).spool_settled = true;
        self.shared.progress_changed.notify_all();
    }

    fn open_spool_now(&mut self, root: &std::path::Path) {
        let origin = Origin {
            collector_url: self.cfg.collector_url.clone(),
            hello: self.hello.clone(),
        };
        let mut spool = match Spool::open(root, &self.hello.agent_id, self.cfg.spool_max_bytes) {
            Ok(spool) => spool,
            Err(e) => return self.no_spool(format!("spool: {e}")),
        };
        if spool.next_seq() != 1 {
            // Left as it was, its origin included.
            return self.no_spool(format!(
                "spool {} appeared while held; not used",
                spool.dir().display()
            ));
        }
        match spool.set_origin(&origin) {
            Ok(()) => {
                let _ = self.shared.spool.set(Mutex::new(spool));
            }
            Err(e) => self.no_spool(format!("spool: {e}")),
        }
    }

    fn no_spool(&self, error: String) {
        tracing::warn!(error = %error, "oomscope reporter: spool unavailable, keeping unacked messages in memory only");
        self.shared.set_error(error);
    }

    /// The collector URL the next session dials.
    fn url(&self) -> &str {
        let urls = super::collector_urls(&self.cfg.collector_url);
        urls.get(self.collector % urls.len().max(1))
            .copied()
            .unwrap_or_default()
    }

    /// Sessions one after another, with a doubling delay between failures
    /// that starts over once a session got something acked.
    async fn serve(&mut self, inputs: &mut Inputs) {
        self.load_previous_run();
        let mut backoff = self.cfg.backoff_initial;
        loop {
            if *inputs.stop.borrow() {
                return;
            }
            match self.session(inputs).await {
                SessionEnd::Stopped => return,
                SessionEnd::Failed { acked, error } => {
                    self.collector = self.collector.wrapping_add(1);
                    self.shared
                        .counters
                        .connected
                        .store(false, Ordering::Relaxed);
                    if acked {
                        backoff = self.cfg.backoff_initial;
                    }
                    if !self.failing {
                        tracing::warn!(collector = %self.cfg.collector_url, error = %error, "oomscope reporter: collector unreachable, retrying with backoff");
                        self.failing = true;
                    } else {
                        tracing::debug!(error = %error, "oomscope reporter: still unreachable");
                    }
                    self.shared.set_error(error);
                }
            }
            if self
                .offline(inputs, tokio::time::sleep(backoff))
                .await
                .is_none()
            {
                return;
            }
            backoff = (backoff * 2).min(self.cfg.backoff_max.max(self.cfg.backoff_initial));
        }
    }

    /// Runs `fut` while still accepting messages, so that the ledger, not
    /// the queue, bounds what an outage keeps: the queue, once full, could
    /// only refuse the newest, where the ledger keeps them and thins the
    /// older. `None` when asked to stop.
    async fn offline<F: std::future::Future>(
        &mut self,
        inputs: &mut Inputs,
        fut: F,
    ) -> Option<F::Output> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                out = &mut fut => return Some(out),
                changed = inputs.stop.changed() => {
                    if changed.is_err() || *inputs.stop.borrow() {
                        return None;
                    }
                }
                Some(urgent) = inputs.urgent.recv() => self.take_urgent(urgent),
                Some(message) = inputs.queue.recv() => self.take(message, false, None),
            }
        }
    }

    /// One connection: Hello, the backlog, then live traffic, until the
    /// stream fails or the reporter stops.
    async fn session(&mut self, inputs: &mut Inputs) -> SessionEnd {
        let failed = |error: String| SessionEnd::Failed {
            acked: false,
            error,
        };
        let url = self.url().to_string();
        let endpoint = match Endpoint::from_shared(url.clone()) {
            Ok(e) => e
                .connect_timeout(self.cfg.connect_timeout)
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true),
            Err(e) => return failed(format!("bad collector url {url:?}: {e}")),
        };
        // https:// dials TLS (OOMSCOPE_CA and the client certificate, if set).
        let endpoint = match oomscope_proto::tls::secure(endpoint, &url) {
            Ok(e) => e,
            Err(e) => return failed(e),
        };
        let timeout = self.cfg.connect_timeout;
        let channel = match self
            .offline(
                inputs,
                tokio::time::timeout(timeout, endpoint.connect_with_connector(Connector)),
            )
            .await
        {
            None => return SessionEnd::Stopped,
            Some(Err(_)) => {
                return self.connect_failed(format!("connecting timed out after {timeout:?}"))
            }
            Some(Ok(Err(e))) => {
                return self.connect_failed(format!("cannot connect: {}", error_chain(&e)))
            }
            Some(Ok(Ok(channel))) => channel,
        };
        let (out_tx, out_rx) = mpsc::channel(OUTBOUND_BUFFER);
        self.hello = inputs.hello.borrow_and_update().clone();
        let hello = pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(self.hello.clone())),
        };
        let _ = out_tx.try_send(hello);
        let mut client = pb::agent_service_client::AgentServiceClient::new(channel)
            .max_encoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
            .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES);
        let mut request = tonic::Request::new(ReceiverStream::new(out_rx));
        match oomscope_proto::bearer::Bearer::new(self.cfg.token.as_deref()) {
            Ok(bearer) => bearer.stamp(&mut request),
            Err(e) => return self.connect_failed(e),
        }
        let opened = tokio::time::timeout(timeout, client.connect(request));
        let mut inbound = match self.offline(inputs, opened).await {
            None => return SessionEnd::Stopped,
            Some(Err(_)) => {
                return self
                    .connect_failed(format!("opening the stream timed out after {timeout:?}"))
            }
            Some(Ok(Err(status))) => {
                let hint = oomscope_proto::tls::hint(&url, &format!("{status:?}"));
                return self
                    .connect_failed(format!("collector refused the stream: {status}{hint}"));
            }
            Some(Ok(Ok(response))) => response.into_inner(),
        };

        self.sessions += 1;
        if self.sessions > 1 {
            self.shared
                .counters
                .reconnects
                .fetch_add(1, Ordering::Relaxed);
        }
        self.shared
            .counters
            .connected
            .store(true, Ordering::Relaxed);
        if self.failing {
            tracing::info!(collector = %url, "oomscope reporter: connected again");
            self.failing = false;
        }
        self.ledger.resend_all();
        // Per stream: the first sample of each (so every resend after a
        // reconnect starts) with complete counters, and changes only once
        // the collector's acks say it rebuilds them (an older one does not).
        let mut delta = oomscope_proto::delta::Encoder::new();
        let mut changes_accepted = false;
        let mut acked = false;
        loop {
            tokio::select! {
                biased;
                changed = inputs.stop.changed() => {
                    if changed.is_err() || *inputs.stop.borrow() {
                        return SessionEnd::Stopped;
                    }
                }
                reply = inbound.message() => match reply {
                    Ok(Some(reply)) => {
                        changes_accepted |= matches!(&reply.body, Some(Reply::Ack(a)) if a.changes_accepted);
                        acked |= self.handle_reply(reply);
                    }
                    Ok(None) => return SessionEnd::Failed { acked, error: "collector closed the stream".into() },
                    Err(status) => return SessionEnd::Failed { acked, error: format!("stream failed: {status}") },
                },
                Some(urgent) = inputs.urgent.recv() => self.take_urgent(urgent),
                Ok(()) = inputs.hello.changed() => {
                    // A Hello on an open stream updates the agent (seq 0, never acked).
                    self.hello = inputs.hello.borrow_and_update().clone();
                    let again = pb::AgentMessage { seq: 0, body: Some(Body::Hello(self.hello.clone())) };
                    if out_tx.send(again).await.is_err() {
                        return SessionEnd::Failed { acked, error: "stream closed".into() };
                    }
                }
                permit = out_tx.reserve(), if self.ledger.owes() => match permit {
                    Ok(permit) => {
                        if let Some(message) = self.next_to_send() {
                            // Until then, complete: the encoder's first
                            // sample after that is complete too.
                            permit.send(match changes_accepted {
                                true => delta.encode(message),
                                false => message,
                            });
                        }
                    }
                    Err(_) => return SessionEnd::Failed { acked, error: "stream closed".into() },
                },
                Some(message) = inputs.queue.recv() => self.take(message, false, None),
            }
        }
    }

    fn connect_failed(&mut self, error: String) -> SessionEnd {
        self.shared
            .counters
            .connect_failures
            .fetch_add(1, Ordering::Relaxed);
        SessionEnd::Failed {
            acked: false,
            error,
        }
    }

    /// Puts what the previous run left in the spool at the front of the
    /// backlog. Held in memory up to the bound; the rest is reread on send.
    fn load_previous_run(&mut self) {
        let Some(spool) = self.shared.spool.get() else {
            return;
        };
        let pending = match lock(spool).pending() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "oomscope reporter: cannot read the spool of a previous run");
                self.shared.set_error(format!("spool: {e}"));
                return;
            }
        };
        if !pending.is_empty() {
            tracing::info!(
                messages = pending.len(),
                "oomscope reporter: resending what a previous run left unacked"
            );
        }
        for message in pending {
            let dropped = self.ledger.restore(message);
            self.lost(&dropped);
        }
        self.publish();
    }

    fn take_urgent(&mut self, urgent: Urgent) {
        self.take(urgent.message, true, urgent.spooled);
    }

    /// Accepts one message from the caller: spool it (unless the caller
    /// did), keep it until acked, and owe it to the current stream. A
    /// sample carries the backlog before it, stamped here, before it is
    /// spooled, so every resend of it is the same message.
    fn take(&mut self, mut message: pb::AgentMessage, urgent: bool, spooled: Option<Vec<u64>>) {
        if let (None, Some(Body::Sample(sample))) = (&spooled, message.body.as_mut()) {
            sample.backlog = Some(self.ledger.backlog());
        }
        let on_disk = match spooled {
            Some(pushed_out) => {
                self.spool_dropped(&pushed_out);
                true
            }
            None => self.spool_append(&message),
        };
        let dropped = self.ledger.take(message, on_disk, urgent);
        if !dropped.is_empty() {
            tracing::debug!(
                count = dropped.len(),
                "oomscope reporter: unacked memory over its bound and not in a spool; dropped the oldest"
            );
        }
        self.lost(&dropped);
        self.publish();
    }

    fn spool_append(&mut self, message: &pb::AgentMessage) -> bool {
        let Some(spool) = self.shared.spool.get() else {
            return false;
        };
        let appended = lock(spool).append(message);
        match appended {
            Ok(pushed_out) => {
                self.shared.counters.spooled.fetch_add(1, Ordering::Relaxed);
                self.spool_dropped(&pushed_out);
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, seq = message.seq, "oomscope reporter: spool append failed");
                self.shared.set_error(format!("spool: {e}"));
                false
            }
        }
    }

    /// The spool deleted these seqs to stay under its bound.
    fn spool_dropped(&mut self, seqs: &[u64]) {
        let lost = self.ledger.spool_dropped(seqs);
        self.lost(&lost);
    }

    /// Counts messages that will never be acked and wakes their waiters.
    fn lost(&self, released: &[Released]) {
        if released.is_empty() {
            return;
        }
        self.shared
            .counters
            .dropped
            .fetch_add(released.len() as u64, Ordering::Relaxed);
        self.settle_urgent(released, false);
    }

    /// Tells `send_urgent` callers whether their message was acked.
    fn settle_urgent(&self, released: &[Released], acked: bool) {
        let mut urgent = released.iter().filter(|r| r.urgent).peekable();
        if urgent.peek().is_none() {
            return;
        }
        let mut progress = lock(&self.shared.progress);
        for r in urgent {
            progress.urgent.insert(r.seq, acked);
        }
    }

    /// The next message for the stream, rereading from the spool what the
    /// memory bound left only there. A message the spool lost is dropped.
    fn next_to_send(&mut self) -> Option<pb::AgentMessage> {
        while let Some(out) = self.ledger.next_to_send() {
            let message = match out.message {
                Some(m) => Some(m),
                None => self.reread(out.seq),
            };
            let Some(mut message) = message else {
                tracing::warn!(
                    seq = out.seq,
                    "oomscope reporter: message missing from the spool, dropped"
                );
                let lost: Vec<Released> = self.ledger.forget(out.seq).into_iter().collect();
                self.lost(&lost);
                self.publish();
                continue;
            };
            stamp(&mut message, out.dropped_before);
            let c = &self.shared.counters;
            c.sent.fetch_add(1, Ordering::Relaxed);
            if out.resend {
                c.resent.fetch_add(1, Ordering::Relaxed);
            }
            return Some(message);
        }
        None
    }

    /// Rereads disk-only messages from `seq` on, a memory bound's worth at a time.
    fn reread(&mut self, seq: u64) -> Option<pb::AgentMessage> {
        if let Some(m) = self.reread.remove(&seq) {
            return Some(m);
        }
        self.reread.clear();
        let spool = self.shared.spool.get()?;
        // scan(), not pending(): damage was already reported at startup.
        let pending = lock(spool).scan().ok()?.messages;
        // Each reread scans the whole spool, so read back a fair batch even
        // when the memory bound is tiny.
        let budget = (self.cfg.unacked_max_bytes / 4).max(REREAD_MIN_BYTES);
        let mut bytes = 0;
        for m in pending.into_iter().filter(|m| m.seq >= seq) {
            if !self.ledger.on_disk_only(m.seq) {
                continue;
            }
            bytes += m.encoded_len();
            self.reread.insert(m.seq, m);
            if bytes > budget {
                break;
            }
        }
        self.reread.remove(&seq)
    }

    /// Applies one collector message; true when it acked something.
    fn handle_reply(&mut self, reply: pb::CollectorMessage) -> bool {
        match reply.body {
            Some(Reply::Ack(ack)) => {
                if ack.from_seq > ack.to_seq {
                    tracing::debug!(
                        from = ack.from_seq,
                        to = ack.to_seq,
                        "oomscope reporter: ignoring an inverted ack"
                    );
                    return false;
                }
                let released = self.ledger.ack(ack.from_seq, ack.to_seq);
                self.shared
                    .counters
                    .acked
                    .fetch_add(released.len() as u64, Ordering::Relaxed);
                self.settle_urgent(&released, true);
                self.publish();
                !released.is_empty()
            }
            Some(Reply::Directive(directive)) => {
                if self.directives.try_send(directive).is_err() {
                    tracing::debug!(
                        "oomscope reporter: directive buffer full or unread; dropped one"
                    );
                }
                false
            }
            Some(Reply::Reject(reject)) => {
                tracing::warn!(seq = reject.seq, reason = %reject.reason, "oomscope reporter: collector rejected a message");
                self.shared.set_error(format!(
                    "collector rejected seq {}: {}",
                    reject.seq, reject.reason
                ));
                if let Some(released) = self.ledger.forget(reject.seq) {
                    self.shared
                        .counters
                        .rejected
                        .fetch_add(1, Ordering::Relaxed);
                    self.settle_urgent(&[released], false);
                    self.publish();
                }
                false
            }
            None => false,
        }
    }

    /// Tells waiters how far everything is settled, and the spool what it
    /// may delete.
    fn publish(&mut self) {
        let c = &self.shared.counters;
        let thinning = self.ledger.thinning();
        c.buffered_bytes
            .store(self.ledger.memory_bytes() as u64, Ordering::Relaxed);
        c.thinned.store(thinning.thinned, Ordering::Relaxed);
        c.max_stride
            .store(u64::from(thinning.max_stride), Ordering::Relaxed);
        let done = self.ledger.settled_upto();
        {
            let mut progress = lock(&self.shared.progress);
            if done <= progress.done_upto && self.shared.spool.get().is_none() {
                return;
            }
            progress.done_upto = progress.done_upto.max(done);
        }
        self.shared.progress_changed.notify_all();
        if let Some(spool) = self.shared.spool.get() {
            if let Err(e) = lock(spool).ack(done) {
                tracing::debug!(error = %e, "oomscope reporter: cannot record acks in the spool");
            }
        }
    }

    /// On stop, with a spool: put whatever is still queued on disk, so the
    /// next run sends it.
    fn drain_on_stop(&mut self, inputs: &mut Inputs) {
        if self.shared.spool.get().is_none() {
            return;
        }
        while let Ok(urgent) = inputs.urgent.try_recv() {
            self.take_urgent(urgent);
        }
        while let Ok(message) = inputs.queue.try_recv() {
            self.take(message, false, None);
        }
    }

    fn exit(&mut self) {
        self.shared
            .counters
            .connected
            .store(false, Ordering::Relaxed);
        lock(&self.shared.progress).worker_exited = true;
        self.shared.progress_changed.notify_all();
    }
}

/// Waits until the reporter is released (true) or stopped (false).
async fn released(inputs: &mut Inputs) -> bool {
    loop {
        // Release first: a reporter that was never held goes on to serve
        // (and spool what is queued) even when stopped at once.
        if *inputs.release.borrow_and_update() {
            return true;
        }
        if *inputs.stop.borrow() {
            return false;
        }
        tokio::select! {
            changed = inputs.stop.changed() => {
                if changed.is_err() {
                    return false;
                }
            }
            changed = inputs.release.changed() => {
                if changed.is_err() {
                    return false;
                }
            }
        }
    }
}
