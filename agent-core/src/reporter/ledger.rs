//! The unacked ledger: every seq the worker has taken and the collector has
//! not yet acked, and which of them the current stream still owes.
//!
//! Pure bookkeeping, no I/O: the worker does the spool reads and writes and
//! the counting, and applies what each call here returns. That keeps the
//! delivery rules testable without a network or a disk:
//!
//! - an ack range releases whatever of it is open, in any order, any number
//!   of times (a second ack of the same seqs releases nothing);
//! - a new stream resends everything still open, oldest first;
//! - memory stays under a byte bound. Past it, messages the spool holds
//!   leave memory first (reread when sent). Then, without a spool, the
//!   older samples and request events are thinned: of the stretch older
//!   than the newest [`WHOLE_SHARE`] of the bound, one of every k of each
//!   kind is kept, k doubling as the outage lasts, and the newest evidence
//!   (what a failure during the outage needs) stays whole. Only when nothing is left to
//!   thin does the oldest message go, whatever its kind.
//! - what is dropped is stated: the next sample sent after a dropped seq
//!   carries the counts ([`pb::DroppedBefore`]), so the collector's
//!   timeline says which stretch is thinned and by how much.
//!
//! Never thinned ([`Class::Kept`]): everything but samples and request
//! events. OOMs, Goodbyes and the Hello, and the events verdicts read
//! (censuses, snapshots, phases, gc collections and cache releases, child
//! starts and exits, kernel OOM kills and allocation failures, forwarded
//! stops, process lists) are few; the samples and request events come at
//! the sampler's and the server's pace and say the same thing every time.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;

use crate::pb;
use crate::pb::agent_message::Body;
use crate::pb::event::Kind;

/// The newest share of the memory bound that is never thinned: half keeps
/// the last stretch whole (the seconds before a failure during the outage)
/// and leaves the other half for a thinned record of the outage before it.
pub(super) const WHOLE_SHARE: f64 = 0.5;
/// Thinning, once the bound is passed, goes down to this share of it: a
/// pass reads the whole ledger, so it frees room for many messages at once.
const THIN_TO: f64 = 15.0 / 16.0;

/// A seq the ledger let go of, by an ack or because it will never be acked
/// (dropped, missing from the spool, rejected). An urgent one has a caller
/// waiting to learn which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Released {
    pub seq: u64,
    pub urgent: bool,
}

/// The next message the stream owes.
#[derive(Debug)]
pub(super) struct Outgoing {
    pub seq: u64,
    /// `None` when only the spool holds it (the memory bound): reread it.
    pub message: Option<pb::AgentMessage>,
    /// Written to a stream before (this run or the previous one).
    pub resend: bool,
    /// What was dropped just before it, to stamp on it ([`stamp`]).
    pub dropped_before: Option<pb::DroppedBefore>,
}

/// What the memory bound may do to a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    Sample,
    /// A request start or end.
    RequestEvent,
    /// Never thinned (see the module's docs).
    Kept,
}

impl Class {
    pub(super) fn of(message: &pb::AgentMessage) -> Class {
        match &message.body {
            Some(Body::Sample(_)) => Class::Sample,
            Some(Body::Event(pb::Event {
                kind: Some(Kind::Request(_)),
                ..
            })) => Class::RequestEvent,
            _ => Class::Kept,
        }
    }
}

/// Puts `dropped` on `message` when it is a sample (the only kind that
/// carries it; the ledger states drops on samples only).
pub(super) fn stamp(message: &mut pb::AgentMessage, dropped: Option<pb::DroppedBefore>) {
    if let (Some(d), Some(Body::Sample(s))) = (dropped, message.body.as_mut()) {
        s.dropped_before = Some(d);
    }
}

#[derive(Debug)]
struct Entry {
    /// Encoded, as it goes on the wire and on disk: a decoded message takes
    /// 10 to 40 times its encoded bytes (measured, the Python agent's
    /// samples and request events), so the bound would not bound memory.
    /// `None` when only the spool holds it.
    message: Option<Vec<u8>>,
    bytes: usize,
    on_disk: bool,
    urgent: bool,
    sent_before: bool,
    class: Class,
    /// Its place among the messages of its class taken so far: thinning at
    /// stride k keeps those whose ordinal k divides.
    ordinal: u64,
    /// Dropped just before it; only samples carry it.
    dropped_before: Option<pb::DroppedBefore>,
    /// The request ends it carries (a batch's, or one request event's).
    requests: u64,
}

/// The request ends `message` stands for: a sample's batch (kept ends and
/// thinned ones), or one request-end event.
fn requests_ended(message: &pb::AgentMessage) -> u64 {
    match &message.body {
        Some(Body::Sample(s)) => s.requests.as_ref().map_or(0, |r| {
            let ends = r
                .readings
                .iter()
                .filter(|x| x.boundary.as_ref().is_some_and(|b| !b.start));
            ends.count() as u64 + r.thinned_requests
        }),
        Some(Body::Event(e)) => match &e.kind {
            Some(Kind::Request(b)) if !b.start => 1,
            _ => 0,
        },
        _ => 0,
    }
}

/// How the ledger has had to drop messages so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Thinning {
    /// Samples and request events the memory bound thinned.
    pub thinned: u64,
    /// The largest stride thinning has reached (1 = none).
    pub max_stride: u32,
}

#[derive(Debug)]
pub(super) struct Ledger {
    max_bytes: usize,
    /// Everything not yet acked, rejected or dropped, by seq.
    open: BTreeMap<u64, Entry>,
    /// Bytes of the messages `open` holds in memory (encoded).
    memory_bytes: usize,
    /// Bytes of every message in `open`, in memory or only on disk (encoded).
    open_bytes: usize,
    /// Seqs held in memory that the spool holds too: the first to leave
    /// memory, oldest first.
    evictable: BTreeSet<u64>,
    /// Every seq of this run up to here has been taken; seqs above it that
    /// arrived early (urgent ones overtake the queue) wait in `taken_above`.
    taken_upto: u64,
    taken_above: BTreeSet<u64>,
    /// Seqs still to write on the current stream, in order.
    to_send: BTreeSet<u64>,
    /// Drops with no open sample after them yet: stated on the next taken.
    unstated: Option<pb::DroppedBefore>,
    thinned: u64,
    max_stride: u32,
    /// The next ordinal of each thinnable class (samples, request events).
    next_ordinal: [u64; 2],
}

impl Ledger {
    /// An empty ledger whose run starts at `next_seq` (the seqs below are
    /// the previous runs', settled unless [`Ledger::restore`]d), holding at
    /// most `max_bytes` of messages in memory.
    pub(super) fn new(max_bytes: usize, next_seq: u64) -> Ledger {
        Ledger {
            max_bytes,
            open: BTreeMap::new(),
            memory_bytes: 0,
            open_bytes: 0,
            evictable: BTreeSet::new(),
            taken_upto: next_seq.saturating_sub(1),
            taken_above: BTreeSet::new(),
            to_send: BTreeSet::new(),
            unstated: None,
            thinned: 0,
            max_stride: 1,
            next_ordinal: [0; 2],
        }
    }

    /// A message a previous run spooled and never got acked. It is on disk
    /// and counts as a resend; it goes out when the next stream opens.
    pub(super) fn restore(&mut self, message: pb::AgentMessage) -> Vec<Released> {
        self.insert(message, true, false, true);
        self.enforce_memory_bound()
    }

    /// A message of this run, spooled (`on_disk`) or not, owed to the
    /// current stream. Returns what the memory bound dropped to make room.
    pub(super) fn take(
        &mut self,
        message: pb::AgentMessage,
        on_disk: bool,
        urgent: bool,
    ) -> Vec<Released> {
        let seq = message.seq;
        if seq == self.taken_upto + 1 {
            self.taken_upto = seq;
            while self.taken_above.remove(&(self.taken_upto + 1)) {
                self.taken_upto += 1;
            }
        } else if seq > self.taken_upto {
            self.taken_above.insert(seq);
        }
        self.insert(message, on_disk, urgent, false);
        self.to_send.insert(seq);
        self.enforce_memory_bound()
    }

    fn insert(&mut self, message: pb::AgentMessage, on_disk: bool, urgent: bool, sent: bool) {
        let seq = message.seq;
        let class = Class::of(&message);
        let requests = requests_ended(&message);
        let message = message.encode_to_vec();
        let bytes = message.len();
        self.memory_bytes += bytes;
        self.open_bytes += bytes;
        let dropped_before = match class {
            Class::Sample => self.unstated.take(),
            _ => None,
        };
        let ordinal = match class {
            Class::Sample => &mut self.next_ordinal[0],
            Class::RequestEvent => &mut self.next_ordinal[1],
            Class::Kept => &mut 0,
        };
        let this_ordinal = *ordinal;
        *ordinal += 1;
        let entry = Entry {
            message: Some(message),
            bytes,
            on_disk,
            urgent,
            sent_before: sent,
            class,
            ordinal: this_ordinal,
            dropped_before,
            requests,
        };
        if on_disk {
            self.evictable.insert(seq);
        } else {
            self.evictable.remove(&seq);
        }
        if let Some(old) = self.open.insert(seq, entry) {
            // The same seq twice: only the newer copy counts.
            if old.message.is_some() {
                self.memory_bytes -= old.bytes;
            }
            self.open_bytes -= old.bytes;
        }
    }

    /// The spool deleted `seqs` to stay under its own bound. Those it held
    /// alone are released (lost, and stated); those still in memory are no
    /// longer on disk.
    pub(super) fn spool_dropped(&mut self, seqs: &[u64]) -> Vec<Released> {
        let mut lost = Vec::new();
        for &seq in seqs {
            let Some(entry) = self.open.get_mut(&seq) else {
                continue;
            };
            if entry.message.is_some() {
                entry.on_disk = false;
                self.evictable.remove(&seq);
            } else {
                lost.extend(self.drop_stated(seq, true, 1));
            }
        }
        lost
    }

    /// Keeps memory under the bound: messages the spool holds leave memory
    /// first, then older samples and request events are thinned (down to
    /// [`THIN_TO`] of the bound, so that a pass over the ledger comes once
    /// per many messages, not at each), and only then is the oldest
    /// message dropped.
    fn enforce_memory_bound(&mut self) -> Vec<Released> {
        let mut dropped = Vec::new();
        while self.memory_bytes > self.max_bytes {
            if let Some(seq) = self.evictable.pop_first() {
                if let Some(entry) = self.open.get_mut(&seq) {
                    if entry.message.take().is_some() {
                        self.memory_bytes -= entry.bytes;
                    }
                }
                continue;
            }
            let target = (self.max_bytes as f64 * THIN_TO) as usize;
            let mut thinned = false;
            while self.memory_bytes > target {
                let pass = self.thin();
                if pass.is_empty() {
                    break;
                }
                thinned = true;
                dropped.extend(pass);
            }
            if thinned {
                continue;
            }
            let Some((&seq, _)) = self.open.iter().find(|(_, e)| e.message.is_some()) else {
                break;
            };
            dropped.extend(self.drop_stated(seq, false, 1));
        }
        dropped
    }

    /// One thinning pass over the stretch older than the newest
    /// [`WHOLE_SHARE`] of the bound: at the smallest stride k (2, 4, 8, ...)
    /// that drops something there, drops the samples and the request
    /// events whose ordinal in their class k does not divide. So the kept
    /// ones stand every k-th, evenly however long the outage, and those
    /// newly past the whole stretch are thinned to the same k first.
    /// Returns what went; nothing when nothing is left to thin.
    fn thin(&mut self) -> Vec<Released> {
        let whole_bytes = (self.max_bytes as f64 * WHOLE_SHARE) as usize;
        let mut newest_bytes = 0;
        // The newest message always counts as whole, however large.
        let Some(mut older_than) = self.open.keys().next_back().copied() else {
            return Vec::new();
        };
        for (&seq, e) in self.open.iter().rev() {
            if e.message.is_none() {
                continue;
            }
            newest_bytes += e.bytes;
            if newest_bytes > whole_bytes {
                break;
            }
            older_than = seq;
        }
        let candidates: Vec<(u64, u64)> = self
            .open
            .range(..older_than)
            .filter(|(_, e)| {
                e.class != Class::Kept && e.message.is_some() && !e.on_disk && !e.urgent
            })
            .map(|(&seq, e)| (seq, e.ordinal))
            .collect();
        let Some(stride) = (1..u64::BITS).map(|shift| 1u64 << shift).find(|k| {
            candidates
                .iter()
                .any(|(_, ordinal)| !ordinal.is_multiple_of(*k))
        }) else {
            return Vec::new();
        };
        let stated_stride = u32::try_from(stride).unwrap_or(u32::MAX);
        self.max_stride = self.max_stride.max(stated_stride);
        let mut dropped = Vec::new();
        for (seq, ordinal) in candidates {
            if !ordinal.is_multiple_of(stride) {
                dropped.extend(self.drop_stated(seq, false, stated_stride));
                self.thinned += 1;
            }
        }
        dropped
    }

    /// Drops `seq` unsent and states it, with what its own statement
    /// carried, on the next open sample after it, or on the next sample
    /// taken when none is open. `stride`: the thinning where it stood.
    fn drop_stated(&mut self, seq: u64, by_spool: bool, stride: u32) -> Option<Released> {
        let entry = self.open.get_mut(&seq)?;
        let (class, carried, requests) = (entry.class, entry.dropped_before.take(), entry.requests);
        let released = self.remove(seq);
        let d = self.statement_after(seq);
        if let Some(c) = carried {
            d.samples += c.samples;
            d.events += c.events;
            d.by_spool += c.by_spool;
            d.stride = d.stride.max(c.stride);
            d.requests += c.requests;
        }
        d.requests += requests;
        match class {
            Class::Sample => d.samples += 1,
            _ => d.events += 1,
        }
        d.by_spool += u64::from(by_spool);
        d.stride = d.stride.max(stride);
        released
    }

    /// The statement the next open sample after `seq` carries, or (none
    /// open) the next sample taken.
    fn statement_after(&mut self, seq: u64) -> &mut pb::DroppedBefore {
        let next = self
            .open
            .range_mut(seq..)
            .map(|(_, e)| e)
            .find(|e| e.class == Class::Sample);
        let slot = match next {
            Some(e) => &mut e.dropped_before,
            None => &mut self.unstated,
        };
        slot.get_or_insert_with(|| pb::DroppedBefore {
            stride: 1,
            ..Default::default()
        })
    }

    /// A new stream: everything still open is owed again, oldest first.
    pub(super) fn resend_all(&mut self) {
        self.to_send = self.open.keys().copied().collect();
    }

    /// Whether the current stream is owed anything.
    pub(super) fn owes(&self) -> bool {
        !self.to_send.is_empty()
    }

    /// The next message owed to the stream, marked as sent.
    pub(super) fn next_to_send(&mut self) -> Option<Outgoing> {
        while let Some(seq) = self.to_send.pop_first() {
            let Some(entry) = self.open.get_mut(&seq) else {
                continue;
            };
            let resend = entry.sent_before;
            entry.sent_before = true;
            return Some(Outgoing {
                seq,
                // Encoded here from a message: it decodes. Were it not to,
                // the worker would reread it from the spool, or forget it.
                message: entry
                    .message
                    .as_deref()
                    .and_then(|b| pb::AgentMessage::decode(b).ok()),
                resend,
                dropped_before: entry.dropped_before,
            });
        }
        None
    }

    /// Whether `seq` is open and only the spool holds it: worth rereading.
    pub(super) fn on_disk_only(&self, seq: u64) -> bool {
        self.open.get(&seq).is_some_and(|e| e.message.is_none())
    }

    /// Releases `seq` without an ack: it was missing from the spool, or the
    /// collector rejected it. `None` when it was not open.
    pub(super) fn forget(&mut self, seq: u64) -> Option<Released> {
        self.remove(seq)
    }

    /// The collector acked `from..=to`: releases whatever of it is open.
    /// An inverted range releases nothing.
    pub(super) fn ack(&mut self, from: u64, to: u64) -> Vec<Released> {
        if from > to {
            return Vec::new();
        }
        let seqs: Vec<u64> = self.open.range(from..=to).map(|(&s, _)| s).collect();
        seqs.into_iter()
            .filter_map(|seq| self.remove(seq))
            .collect()
    }

    fn remove(&mut self, seq: u64) -> Option<Released> {
        let entry = self.open.remove(&seq)?;
        if entry.message.is_some() {
            self.memory_bytes -= entry.bytes;
        }
        self.open_bytes -= entry.bytes;
        self.evictable.remove(&seq);
        self.to_send.remove(&seq);
        Some(Released {
            seq,
            urgent: entry.urgent,
        })
    }

    /// Every seq at or below this is settled (acked, rejected or dropped):
    /// what flush waits for and what the spool may delete.
    pub(super) fn settled_upto(&self) -> u64 {
        let first_open = self
            .open
            .keys()
            .next()
            .map_or(u64::MAX, |s| s.saturating_sub(1));
        self.taken_upto.min(first_open)
    }

    /// Encoded bytes of the open messages held in memory.
    pub(super) fn memory_bytes(&self) -> usize {
        self.memory_bytes
    }

    /// The backlog: messages taken and not yet acked, rejected or dropped
    /// (in memory or only in the spool), and their encoded bytes.
    pub(super) fn backlog(&self) -> pb::Backlog {
        pb::Backlog {
            messages: self.open.len() as u64,
            bytes: self.open_bytes as u64,
        }
    }

    /// What thinning has dropped so far, and the stride in force.
    pub(super) fn thinning(&self) -> Thinning {
        Thinning {
            thinned: self.thinned,
            max_stride: self.max_stride,
        }
    }

    /// Open seqs, in memory or only on disk.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::agent_message::Body;

    fn msg(seq: u64) -> pb::AgentMessage {
        pb::AgentMessage {
            seq,
            body: Some(Body::Sample(pb::Sample {
                time_ns: 1_700_000_000_000_000_000 + seq as i64,
                step: seq,
                ..Default::default()
            })),
        }
    }

    fn ledger_with(seqs: std::ops::RangeInclusive<u64>, on_disk: bool) -> Ledger {
        let mut l = Ledger::new(usize::MAX, *seqs.start());
        for seq in seqs {
            assert!(l.take(msg(seq), on_disk, false).is_empty());
        }
        l
    }

    fn seqs(released: &[Released]) -> Vec<u64> {
        released.iter().map(|r| r.seq).collect()
    }

    /// Drains what the stream is owed: (seq, resend).
    fn send_all(l: &mut Ledger) -> Vec<(u64, bool)> {
        std::iter::from_fn(|| l.next_to_send())
            .map(|o| (o.seq, o.resend))
            .collect()
    }

    #[test]
    fn in_order_acks_settle_up_to_the_acked_seq() {
        let mut l = ledger_with(1..=5, false);
        assert_eq!(l.settled_upto(), 0);
        assert_eq!(seqs(&l.ack(1, 2)), [1, 2]);
        assert_eq!(l.settled_upto(), 2);
        assert_eq!(seqs(&l.ack(3, 5)), [3, 4, 5]);
        assert_eq!(l.settled_upto(), 5);
        assert_eq!(l.len(), 0);
        assert_eq!(l.memory_bytes(), 0);
    }

    #[test]
    fn an_out_of_order_range_waits_for_the_gap_below_it() {
        let mut l = ledger_with(1..=10, false);
        assert_eq!(seqs(&l.ack(6, 8)), [6, 7, 8]);
        assert_eq!(l.settled_upto(), 0, "1..=5 are still open");
        assert_eq!(seqs(&l.ack(1, 5)), [1, 2, 3, 4, 5]);
        assert_eq!(l.settled_upto(), 8);
        // A range wider than what is open releases only what is.
        assert_eq!(seqs(&l.ack(0, 100)), [9, 10]);
        assert_eq!(l.settled_upto(), 10);
    }

    #[test]
    fn duplicate_and_inverted_acks_release_nothing() {
        let mut l = ledger_with(1..=3, false);
        assert_eq!(l.ack(1, 2).len(), 2);
        assert!(l.ack(1, 2).is_empty(), "a second ack of the same seqs");
        assert!(l.ack(3, 1).is_empty(), "an inverted range");
        assert!(l.forget(2).is_none(), "a reject of an acked seq");
        assert_eq!(l.len(), 1);
        assert_eq!(l.settled_upto(), 2);
    }

    #[test]
    fn a_new_stream_resends_what_is_open_oldest_first() {
        let mut l = ledger_with(1..=4, false);
        assert_eq!(
            send_all(&mut l),
            [(1, false), (2, false), (3, false), (4, false)]
        );
        assert!(!l.owes());
        l.ack(2, 2);
        l.resend_all();
        assert_eq!(send_all(&mut l), [(1, true), (3, true), (4, true)]);
        // Taken after the reconnect: a first send, not a resend.
        l.take(msg(5), false, false);
        assert_eq!(send_all(&mut l), [(5, false)]);
    }

    #[test]
    fn an_ack_before_the_send_means_no_send() {
        let mut l = ledger_with(1..=3, false);
        l.ack(2, 2);
        assert_eq!(send_all(&mut l), [(1, false), (3, false)]);
    }

    #[test]
    fn a_previous_runs_messages_go_out_as_resends_first() {
        let mut l = Ledger::new(usize::MAX, 4);
        for seq in 1..=3 {
            l.restore(msg(seq));
        }
        l.take(msg(4), true, false);
        assert_eq!(l.settled_upto(), 0);
        l.resend_all();
        assert_eq!(
            send_all(&mut l),
            [(1, true), (2, true), (3, true), (4, false)]
        );
        l.ack(1, 4);
        assert_eq!(l.settled_upto(), 4);
    }

    #[test]
    fn an_urgent_seq_that_overtook_the_queue_settles_once_the_gap_is_taken() {
        let mut l = Ledger::new(usize::MAX, 1);
        l.take(msg(2), true, true);
        assert_eq!(
            l.ack(2, 2),
            [Released {
                seq: 2,
                urgent: true
            }]
        );
        assert_eq!(l.settled_upto(), 0, "seq 1 has not reached the worker yet");
        l.take(msg(1), true, false);
        assert_eq!(
            l.ack(1, 1),
            [Released {
                seq: 1,
                urgent: false
            }]
        );
        assert_eq!(l.settled_upto(), 2);
    }

    /// A sample carrying a batch: `ends` request ends kept whole (each with
    /// its begin) and `thinned` counted.
    fn batch(seq: u64, ends: usize, thinned: u64) -> pb::AgentMessage {
        let mut m = msg(seq);
        let reading = |start| pb::RequestReading {
            boundary: Some(pb::RequestBoundary {
                start,
                ..Default::default()
            }),
            ..Default::default()
        };
        if let Some(Body::Sample(s)) = m.body.as_mut() {
            s.requests = Some(pb::RequestReadings {
                readings: (0..ends)
                    .flat_map(|_| [reading(true), reading(false)])
                    .collect(),
                thinned_requests: thinned,
                ..Default::default()
            });
        }
        m
    }

    fn request_event(seq: u64) -> pb::AgentMessage {
        pb::AgentMessage {
            seq,
            body: Some(Body::Event(pb::Event {
                time_ns: 1_700_000_000_000_000_000 + seq as i64,
                kind: Some(Kind::Request(pb::RequestBoundary {
                    start: seq.is_multiple_of(2),
                    ..Default::default()
                })),
            })),
        }
    }

    fn oom(seq: u64) -> pb::AgentMessage {
        pb::AgentMessage {
            seq,
            body: Some(Body::Event(pb::Event {
                time_ns: 1_700_000_000_000_000_000 + seq as i64,
                kind: Some(Kind::Oom(pb::Oom::default())),
            })),
        }
    }

    /// Drains the stream's messages, stamped as the worker stamps them.
    fn drain(l: &mut Ledger) -> Vec<pb::AgentMessage> {
        std::iter::from_fn(|| l.next_to_send())
            .map(|o| {
                let mut m = o.message.expect("in memory");
                stamp(&mut m, o.dropped_before);
                m
            })
            .collect()
    }

    fn dropped_before(m: &pb::AgentMessage) -> Option<&pb::DroppedBefore> {
        match &m.body {
            Some(Body::Sample(s)) => s.dropped_before.as_ref(),
            _ => None,
        }
    }

    /// A ledger bounded to about `n` samples, fed `count` of them with no
    /// spool and no ack (an outage), checked against its bound all along.
    fn outage(n: usize, count: u64) -> (Ledger, Vec<u64>) {
        let bound = msg(1_000_000).encoded_len() * n;
        let mut l = Ledger::new(bound, 1);
        let mut dropped = Vec::new();
        for seq in 1..=count {
            dropped.extend(seqs(&l.take(msg(seq), false, false)));
            assert!(l.memory_bytes() <= bound, "{} > {bound}", l.memory_bytes());
        }
        (l, dropped)
    }

    #[test]
    fn without_a_spool_the_newest_stay_whole_and_the_older_are_thinned() {
        let (mut l, dropped) = outage(100, 5000);
        let kept: Vec<u64> = drain(&mut l).iter().map(|m| m.seq).collect();
        assert_eq!(kept.len() + dropped.len(), 5000);
        assert_eq!(l.thinning().thinned, dropped.len() as u64);
        // The newest (about WHOLE_SHARE of the bound) all there, in order.
        let newest: Vec<u64> = (4956..=5000).collect();
        assert_eq!(kept[kept.len() - newest.len()..], newest[..]);
        // The oldest is kept (the first of every run is), and the stretch
        // before the whole one is spread evenly: no gap wider than the
        // largest stride, and that stride is a power of two past 1.
        assert_eq!(kept[0], 1);
        let stride = l.thinning().max_stride;
        assert!(stride >= 64 && stride.is_power_of_two(), "stride {stride}");
        let widest = kept.windows(2).map(|w| w[1] - w[0]).max().unwrap();
        assert!(
            widest <= u64::from(stride),
            "gap {widest} > stride {stride}"
        );
        assert!(kept.len() >= 60, "{} kept of 5000", kept.len());
    }

    #[test]
    fn the_stride_doubles_as_the_outage_lasts() {
        let strides: Vec<u32> = [500, 2000, 8000]
            .into_iter()
            .map(|count| outage(100, count).0.thinning().max_stride)
            .collect();
        assert!(
            strides[0] < strides[1] && strides[1] < strides[2],
            "{strides:?}"
        );
    }

    #[test]
    fn every_thinned_message_is_stated_on_the_next_sample_kept() {
        let (mut l, dropped) = outage(100, 3000);
        let sent = drain(&mut l);
        let mut previous = 0;
        for m in &sent {
            let missing = m.seq - previous - 1;
            let stated = dropped_before(m).map_or(0, |d| d.samples);
            assert_eq!(stated, missing, "before seq {}", m.seq);
            if let Some(d) = dropped_before(m) {
                assert_eq!((d.events, d.by_spool), (0, 0));
                assert!(d.stride >= 2 && u64::from(d.stride) > missing, "{d:?}");
            }
            previous = m.seq;
        }
        assert_eq!(
            sent.iter()
                .filter_map(dropped_before)
                .map(|d| d.samples)
                .sum::<u64>(),
            dropped.len() as u64
        );
    }

    #[test]
    fn events_verdicts_need_are_never_thinned_and_request_events_are() {
        let bound = msg(1_000_000).encoded_len() * 100;
        let mut l = Ledger::new(bound, 1);
        let mut dropped = Vec::new();
        for seq in 1..=3000u64 {
            let m = match seq % 3 {
                0 if seq.is_multiple_of(300) => oom(seq),
                0 => msg(seq),
                _ => request_event(seq),
            };
            dropped.extend(l.take(m, false, false));
            assert!(l.memory_bytes() <= bound);
        }
        let sent = drain(&mut l);
        let sent_seqs: BTreeSet<u64> = sent.iter().map(|m| m.seq).collect();
        assert!(
            (300..=3000).step_by(300).all(|s| sent_seqs.contains(&s)),
            "every OOM kept"
        );
        let lost_events = dropped.iter().filter(|r| !r.seq.is_multiple_of(3)).count() as u64;
        let lost_samples = dropped.len() as u64 - lost_events;
        assert!(
            lost_events > 1000 && lost_samples > 300,
            "{lost_events} {lost_samples}"
        );
        let stated = sent
            .iter()
            .filter_map(dropped_before)
            .fold((0, 0), |a, d| (a.0 + d.samples, a.1 + d.events));
        assert_eq!(stated, (lost_samples, lost_events));
        // Both kinds are still there across the outage's older stretch.
        let old = |r: std::ops::Range<u64>| sent_seqs.range(r).count();
        assert!(old(1..1000) >= 4, "{:?}", sent_seqs.range(1..1000));
    }

    #[test]
    fn with_nothing_left_to_thin_the_oldest_go_and_are_stated() {
        let one = oom(10).encoded_len();
        let mut l = Ledger::new(one * 3, 1);
        let mut dropped = Vec::new();
        for seq in 1..=10 {
            dropped.extend(l.take(oom(seq), false, seq == 2));
            assert!(l.memory_bytes() <= one * 3, "{} bytes", l.memory_bytes());
        }
        assert_eq!(seqs(&dropped), [1, 2, 3, 4, 5, 6, 7]);
        assert!(dropped[1].urgent, "a dropped urgent seq says so");
        assert_eq!(l.thinning().thinned, 0, "events are not thinned");
        // Dropped seqs are settled, and no longer owed to the stream.
        assert_eq!(l.settled_upto(), 7);
        assert_eq!(send_all(&mut l), [(8, false), (9, false), (10, false)]);
        // With no sample open, the next sample taken states the loss.
        l.ack(8, 10);
        l.take(msg(11), false, false);
        let sent = drain(&mut l);
        let d = dropped_before(&sent[0]).expect("stated");
        assert_eq!((d.samples, d.events, d.stride), (0, 7, 1));
    }

    #[test]
    fn with_a_spool_memory_stays_bounded_and_the_oldest_are_reread() {
        let one = msg(10).encoded_len();
        let mut l = Ledger::new(one * 3, 1);
        for seq in 1..=10 {
            assert!(l.take(msg(seq), true, false).is_empty(), "nothing is lost");
        }
        assert!(l.memory_bytes() <= one * 3);
        assert_eq!(l.len(), 10);
        assert!(l.on_disk_only(1) && l.on_disk_only(7));
        assert!(!l.on_disk_only(8));
        let sent: Vec<(u64, bool)> = std::iter::from_fn(|| l.next_to_send())
            .map(|o| (o.seq, o.message.is_some()))
            .collect();
        let in_memory: Vec<u64> = sent.iter().filter(|s| s.1).map(|s| s.0).collect();
        assert_eq!(sent.len(), 10);
        assert_eq!(in_memory, [8, 9, 10]);
        // Acking a disk-only seq frees no memory it did not hold.
        let before = l.memory_bytes();
        l.ack(1, 7);
        assert_eq!(l.memory_bytes(), before);
        l.ack(8, 10);
        assert_eq!(l.memory_bytes(), 0);
    }

    #[test]
    fn the_backlog_counts_every_open_message_in_memory_or_on_disk_only() {
        let one = msg(10).encoded_len();
        let mut l = Ledger::new(one * 3, 1);
        let mut bytes = 0;
        for seq in 1..=10 {
            bytes += msg(seq).encoded_len();
            l.take(msg(seq), true, false);
        }
        assert!(l.on_disk_only(1), "the memory bound left 1 on disk only");
        assert_eq!(
            l.backlog(),
            pb::Backlog {
                messages: 10,
                bytes: bytes as u64
            }
        );
        let acked: usize = (1..=7).map(|s| msg(s).encoded_len()).sum();
        l.ack(1, 7);
        assert_eq!(l.backlog().messages, 3);
        assert_eq!(l.backlog().bytes, (bytes - acked) as u64);
        l.forget(9);
        l.ack(8, 10);
        assert_eq!(l.backlog(), pb::Backlog::default());
        // Without a spool, what the bound drops leaves the backlog too.
        let mut l = Ledger::new(one * 3, 1);
        for seq in 1..=10 {
            l.take(oom(seq), false, false);
        }
        assert_eq!(l.backlog().messages, l.len() as u64);
        assert!(l.backlog().messages < 10, "the bound dropped the oldest");
    }

    #[test]
    fn what_the_spool_deleted_is_lost_unless_memory_still_holds_it() {
        let one = msg(10).encoded_len();
        let mut l = Ledger::new(one * 2, 1);
        for seq in 1..=4 {
            l.take(msg(seq), true, false);
        }
        // 1 and 2 are disk-only, 3 and 4 in memory too.
        let lost = l.spool_dropped(&[1, 2, 3, 99]);
        assert_eq!(seqs(&lost), [1, 2]);
        assert!(!l.on_disk_only(3));
        // 3 is memory-only now: the next squeeze leaves 4 to the spool
        // and keeps 3 in memory rather than losing it.
        assert!(l.take(msg(5), true, false).is_empty());
        assert!(!l.on_disk_only(3) && l.on_disk_only(4));
        assert_eq!(l.settled_upto(), 2);
    }

    #[test]
    fn what_the_spool_deleted_is_stated_on_the_next_sample() {
        let one = msg(10).encoded_len();
        let mut l = Ledger::new(one * 2, 1);
        for seq in 1..=6 {
            let m = match seq {
                2 => request_event(seq),
                3 => batch(seq, 2, 5),
                _ => msg(seq),
            };
            assert!(l.take(m, true, false).is_empty());
        }
        assert_eq!(
            l.thinning().thinned,
            0,
            "spooled messages leave memory, not thinned"
        );
        assert_eq!(seqs(&l.spool_dropped(&[1, 2, 3])), [1, 2, 3]);
        let stamped: Vec<(u64, Option<pb::DroppedBefore>)> =
            std::iter::from_fn(|| l.next_to_send())
                .map(|o| (o.seq, o.dropped_before))
                .collect();
        let expected = pb::DroppedBefore {
            samples: 2,
            events: 1,
            by_spool: 3,
            stride: 1,
            // The batch's 2 kept ends and 5 thinned; seq 2 was a begin.
            requests: 7,
        };
        assert_eq!(stamped, [(4, Some(expected)), (5, None), (6, None)]);
    }

    #[test]
    fn a_message_missing_from_the_spool_is_forgotten() {
        let mut l = ledger_with(1..=2, true);
        assert_eq!(
            l.forget(1),
            Some(Released {
                seq: 1,
                urgent: false
            })
        );
        assert_eq!(send_all(&mut l), [(2, false)]);
        assert_eq!(l.settled_upto(), 1);
    }
}
