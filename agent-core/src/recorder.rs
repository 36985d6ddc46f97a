//! The flight recorder: the last few minutes of what the agent saw, kept in
//! memory so that an OOM report can carry the run-up to the failure even when
//! the collector was unreachable the whole time.
//!
//! It is bounded twice, by age and by encoded bytes, because a sample's size
//! varies with the number of GPUs, cgroup levels and allocator pools: an age
//! bound alone could grow without limit on a large machine, a byte bound
//! alone could keep hours of history on a quiet one.

use std::collections::VecDeque;
use std::time::Duration;

use prost::Message;

use crate::pb;
use crate::pb::agent_message::Body;

/// How far back the recorder looks by default: long enough to cover a model
/// load plus a few minutes of traffic before an OOM, short enough to stay small.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(10 * 60);

/// The default byte bound. A sample is a few KiB, so 8 MiB holds one sample a
/// second for the whole default window with room for a few large events.
pub const DEFAULT_MAX_BYTES: usize = 8 * 1024 * 1024;

/// A bounded ring of the most recent samples and events.
///
/// Not synchronised: the owner wraps it in a `Mutex` when several threads push.
#[derive(Debug)]
pub struct FlightRecorder {
    window_ns: i64,
    max_bytes: usize,
    ring: VecDeque<Entry>,
    bytes: usize,
    newest_ns: i64,
    evicted: u64,
    rejected: u64,
}

#[derive(Debug)]
struct Entry {
    time_ns: i64,
    bytes: usize,
    message: pb::AgentMessage,
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self::new(DEFAULT_WINDOW, DEFAULT_MAX_BYTES)
    }
}

impl FlightRecorder {
    /// A recorder keeping messages no older than `window` (relative to the
    /// newest one) and no more than `max_bytes` of encoded messages.
    pub fn new(window: Duration, max_bytes: usize) -> Self {
        FlightRecorder {
            window_ns: i64::try_from(window.as_nanos()).unwrap_or(i64::MAX),
            max_bytes,
            ring: VecDeque::new(),
            bytes: 0,
            newest_ns: i64::MIN,
            evicted: 0,
            rejected: 0,
        }
    }

    /// Records one message. Age is measured on the message's own `time_ns`
    /// (so a replayed capture keeps its own timeline), falling back to the
    /// wall clock for messages without one. A single message larger than the
    /// whole byte bound is refused and counted in [`FlightRecorder::rejected`].
    pub fn push(&mut self, message: pb::AgentMessage) {
        let bytes = message.encoded_len();
        if bytes > self.max_bytes {
            self.rejected += 1;
            return;
        }
        let time_ns = message_time_ns(&message).unwrap_or_else(crate::now_ns);
        self.newest_ns = self.newest_ns.max(time_ns);
        self.bytes += bytes;
        self.ring.push_back(Entry {
            time_ns,
            bytes,
            message,
        });
        self.evict();
    }

    /// Everything currently held, oldest first.
    pub fn snapshot(&self) -> Vec<pb::AgentMessage> {
        self.ring.iter().map(|e| e.message.clone()).collect()
    }

    /// Encoded bytes currently held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Messages currently held.
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Messages pushed out by either bound since the recorder was made.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Messages refused because each alone exceeded the byte bound.
    pub fn rejected(&self) -> u64 {
        self.rejected
    }

    fn evict(&mut self) {
        let oldest_kept = self.newest_ns.saturating_sub(self.window_ns);
        while let Some(front) = self.ring.front() {
            // Age is checked on the front only: pushes arrive nearly in time
            // order, and a late straggler is evicted by the byte bound anyway.
            if self.bytes <= self.max_bytes && front.time_ns >= oldest_kept {
                break;
            }
            self.bytes -= front.bytes;
            self.ring.pop_front();
            self.evicted += 1;
        }
    }
}

/// The time a message describes, when it carries one.
fn message_time_ns(message: &pb::AgentMessage) -> Option<i64> {
    let t = match message.body.as_ref()? {
        Body::Sample(s) => s.time_ns,
        Body::Event(e) => e.time_ns,
        Body::Hello(h) => h.start_time_ns,
        Body::Goodbye(_) => return None,
    };
    (t != 0).then_some(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(time_ns: i64, step: u64) -> pb::AgentMessage {
        pb::AgentMessage {
            seq: step,
            body: Some(Body::Sample(pb::Sample {
                time_ns,
                step,
                ..Default::default()
            })),
        }
    }

    #[test]
    fn age_bound_drops_messages_older_than_the_window() {
        let mut r = FlightRecorder::new(Duration::from_secs(60), usize::MAX);
        let s = 1_000_000_000i64;
        for i in 0..=120 {
            r.push(sample(1_700_000_000 * s + i * s, i as u64));
        }
        // Newest is t=120 s; anything before t=60 s is gone, t=60..=120 stays.
        assert_eq!(r.len(), 61);
        let snap = r.snapshot();
        assert_eq!(snap.first().map(|m| m.seq), Some(60));
        assert_eq!(snap.last().map(|m| m.seq), Some(120));
        assert_eq!(r.evicted(), 60);
    }

    #[test]
    fn byte_bound_keeps_the_newest_within_max_bytes() {
        let one = sample(1_700_000_000_000_000_100, 100).encoded_len();
        let mut r = FlightRecorder::new(DEFAULT_WINDOW, one * 10);
        for i in 1..=100u64 {
            r.push(sample(1_700_000_000_000_000_000 + i as i64, i));
        }
        assert!(r.bytes() <= one * 10, "{} > {}", r.bytes(), one * 10);
        // Every message is at most `one` bytes, so at least 10 still fit.
        assert!(r.len() >= 10, "{}", r.len());
        assert_eq!(r.snapshot().last().map(|m| m.seq), Some(100));
        let total: usize = r.snapshot().iter().map(|m| m.encoded_len()).sum();
        assert_eq!(total, r.bytes());
    }

    #[test]
    fn oversized_message_is_refused_not_kept() {
        let mut r = FlightRecorder::new(DEFAULT_WINDOW, 4);
        r.push(sample(5, 5));
        assert_eq!(r.len(), 0);
        assert_eq!(r.bytes(), 0);
        assert_eq!(r.rejected(), 1);
    }
}
