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
//! - memory stays under a byte bound: past it the oldest messages live only
//!   in the spool (reread when sent) or, not spooled, are dropped.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;

use crate::pb;

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
}

#[derive(Debug)]
struct Entry {
    /// `None` when only the spool holds it.
    message: Option<pb::AgentMessage>,
    bytes: usize,
    on_disk: bool,
    urgent: bool,
    sent_before: bool,
}

#[derive(Debug)]
pub(super) struct Ledger {
    max_bytes: usize,
    /// Everything not yet acked, rejected or dropped, by seq.
    open: BTreeMap<u64, Entry>,
    /// Encoded bytes of the messages `open` holds in memory.
    memory_bytes: usize,
    /// Entries below this seq hold no message in memory.
    evict_from: u64,
    /// Every seq of this run up to here has been taken; seqs above it that
    /// arrived early (urgent ones overtake the queue) wait in `taken_above`.
    taken_upto: u64,
    taken_above: BTreeSet<u64>,
    /// Seqs still to write on the current stream, in order.
    to_send: BTreeSet<u64>,
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
            evict_from: 0,
            taken_upto: next_seq.saturating_sub(1),
            taken_above: BTreeSet::new(),
            to_send: BTreeSet::new(),
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
        self.evict_from = self.evict_from.min(seq);
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
        let bytes = message.encoded_len();
        self.memory_bytes += bytes;
        let entry = Entry {
            message: Some(message),
            bytes,
            on_disk,
            urgent,
            sent_before: sent,
        };
        if let Some(old) = self.open.insert(seq, entry) {
            // The same seq twice: only the newer copy counts.
            if old.message.is_some() {
                self.memory_bytes -= old.bytes;
            }
        }
    }

    /// The spool deleted `seqs` to stay under its own bound. Those it held
    /// alone are released (lost); those still in memory are no longer on
    /// disk.
    pub(super) fn spool_dropped(&mut self, seqs: &[u64]) -> Vec<Released> {
        let mut lost = Vec::new();
        for &seq in seqs {
            let Some(entry) = self.open.get_mut(&seq) else {
                continue;
            };
            if entry.message.is_some() {
                entry.on_disk = false;
            } else {
                lost.extend(self.remove(seq));
            }
        }
        lost
    }

    /// Keeps memory under the bound: the oldest messages are left to the
    /// spool when it has them, released (dropped) otherwise.
    fn enforce_memory_bound(&mut self) -> Vec<Released> {
        let mut dropped = Vec::new();
        while self.memory_bytes > self.max_bytes {
            let Some((&seq, entry)) = self
                .open
                .range_mut(self.evict_from..)
                .find(|(_, e)| e.message.is_some())
            else {
                break;
            };
            self.evict_from = seq + 1;
            if entry.on_disk {
                entry.message = None;
                self.memory_bytes -= entry.bytes;
            } else {
                dropped.extend(self.remove(seq));
            }
        }
        dropped
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
                message: entry.message.clone(),
                resend,
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
    #[cfg(test)]
    fn memory_bytes(&self) -> usize {
        self.memory_bytes
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

    #[test]
    fn without_a_spool_memory_stays_bounded_by_dropping_the_oldest() {
        let one = msg(10).encoded_len();
        let mut l = Ledger::new(one * 3, 1);
        let mut dropped = Vec::new();
        for seq in 1..=10 {
            dropped.extend(l.take(msg(seq), false, seq == 2));
            assert!(l.memory_bytes() <= one * 3, "{} bytes", l.memory_bytes());
        }
        assert_eq!(seqs(&dropped), [1, 2, 3, 4, 5, 6, 7]);
        assert!(dropped[1].urgent, "a dropped urgent seq says so");
        assert_eq!(l.len(), 3);
        // Dropped seqs are settled, and no longer owed to the stream.
        assert_eq!(l.settled_upto(), 7);
        assert_eq!(send_all(&mut l), [(8, false), (9, false), (10, false)]);
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
        // 3 is memory-only now: the next squeeze drops it instead of
        // leaving it to the spool.
        assert_eq!(seqs(&l.take(msg(5), true, false)), [3]);
        assert_eq!(l.settled_upto(), 3);
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
