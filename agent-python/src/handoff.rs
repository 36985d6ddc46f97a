//! What the request path leaves for the sampler thread: the newest request
//! end (its context), the allocated-blocks readings of the ends folded into
//! it, and the request events on their way to the reporter.
//!
//! A request boundary puts its part here under one short lock and wakes the
//! sampler only when the hand-off was empty; the sampler takes it all at
//! once when the boundary sample is due (at most one per
//! `boundary_min_interval`) and gives the events to the reporter in one
//! batch. A burst of requests so wakes the agent's threads about twice per
//! interval instead of three times per request: each wake was a futex call
//! on the request thread and a context switch on cores the server's own
//! threads keep busy, a third of a marked request's extra wall time
//! (BENCHMARKS.md, #17).
//!
//! No Python and no I/O here: `agent.rs` fills it, `sampler.rs` drains it.

use oomscope_agent_core::pb;

use crate::context::fold_peaks;

/// Request events held between two takes; past this they are dropped and
/// counted. The sampler takes them every `boundary_min_interval` (20 ms by
/// default), so this is 200,000 request boundaries a second.
pub const MAX_EVENTS: usize = 4096;
/// Allocated-blocks readings held between two takes; past this every other
/// one is dropped, so what is kept still spans every request since.
pub const MAX_READINGS: usize = 16;

/// A request end as the sampler samples it: when, and the context then.
pub type End = (i64, Box<pb::RequestContext>);

#[derive(Default, Debug)]
pub struct Handoff {
    /// The request ends to sample: only the newest, since the sample taken
    /// should carry the newest context (requests_done only grows) and a
    /// burst costs one host reading, not one a request; every one (up to
    /// [`MAX_EVENTS`]) where `boundary_min_interval_s` is 0.
    pub ends: Vec<End>,
    /// (requests_done, `sys.getallocatedblocks()`) of the ends since the
    /// last take that read it: the suspicion's signal, kept for the ends
    /// that are folded away.
    pub readings: Vec<(u64, u64)>,
    /// Request events, oldest first.
    pub events: Vec<pb::Event>,
    /// Events dropped for lack of room since the last take.
    pub dropped: u64,
}

impl Handoff {
    /// Whether nothing waits: the next boundary must wake the sampler.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty() && self.readings.is_empty() && self.events.is_empty()
    }

    pub fn push_event(&mut self, event: pb::Event) {
        if self.events.len() >= MAX_EVENTS {
            self.dropped += 1;
        } else {
            self.events.push(event);
        }
    }

    /// A request ended at `time_ns` with `context`; `blocks` is 0 when it
    /// was not read this time. `every`: keep every end, not the newest. An
    /// end that is dropped leaves its peaks in the one kept (`fold_peaks`).
    pub fn end(
        &mut self,
        time_ns: i64,
        mut context: Box<pb::RequestContext>,
        blocks: u64,
        every: bool,
    ) {
        if blocks > 0 {
            if self.readings.len() >= MAX_READINGS {
                crate::suspicion::halve(&mut self.readings);
            }
            self.readings.push((context.requests_done, blocks));
        }
        if !every {
            for (_, older) in self.ends.drain(..) {
                fold_peaks(&mut context, &older);
            }
        } else if self.ends.len() >= MAX_EVENTS {
            if let Some((_, older)) = self.ends.pop() {
                fold_peaks(&mut context, &older);
            }
        }
        self.ends.push((time_ns, context));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(done: u64) -> Box<pb::RequestContext> {
        Box::new(pb::RequestContext {
            requests_done: done,
            ..Default::default()
        })
    }

    fn event(ns: i64) -> pb::Event {
        pb::Event {
            time_ns: ns,
            kind: None,
        }
    }

    #[test]
    fn the_newest_end_is_kept_and_every_reading_span_survives_the_bound() {
        let mut h = Handoff::default();
        assert!(h.is_empty());
        for done in 1..=100u64 {
            // Blocks read at every third end only, as the request path does.
            let blocks = if done % 3 == 0 { 1000 + done } else { 0 };
            h.end(done as i64, context(done), blocks, false);
        }
        assert!(!h.is_empty());
        assert_eq!(h.ends.len(), 1);
        assert_eq!(h.ends[0].1.requests_done, 100);
        assert!(h.readings.len() <= MAX_READINGS, "{}", h.readings.len());
        // Thinned, not truncated: the first reading and the newest are kept,
        // in order.
        assert_eq!(h.readings.first(), Some(&(3, 1003)));
        assert_eq!(h.readings.last(), Some(&(99, 1099)));
        assert!(h.readings.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn the_newest_end_carries_the_fullest_pool_of_the_ends_it_replaced() {
        let mut h = Handoff::default();
        // The first end saw the pool full with 12 waiting; the later ones
        // (the same 20 ms) saw it drained.
        for (done, queued, usage) in [(1u64, 12u64, 1.0), (2, 0, 0.1), (3, 2, 0.3)] {
            let mut c = context(done);
            c.queued = queued;
            c.numbers.insert("kv_cache_usage".into(), usage);
            h.end(done as i64, c, 0, false);
        }
        assert_eq!(h.ends.len(), 1);
        let kept = &h.ends[0].1;
        assert_eq!(kept.requests_done, 3);
        assert_eq!(kept.queued, 12);
        assert_eq!(kept.numbers["kv_cache_usage"], 1.0);
    }

    #[test]
    fn every_end_is_kept_when_asked_the_newest_last_at_the_bound() {
        let mut h = Handoff::default();
        for done in 1..=5u64 {
            h.end(done as i64, context(done), 0, true);
        }
        let done: Vec<u64> = h.ends.iter().map(|e| e.1.requests_done).collect();
        assert_eq!(done, [1, 2, 3, 4, 5]);
        for done in 6..=(MAX_EVENTS as u64 + 10) {
            h.end(done as i64, context(done), 0, true);
        }
        assert_eq!(h.ends.len(), MAX_EVENTS);
        assert_eq!(
            h.ends.last().unwrap().1.requests_done,
            MAX_EVENTS as u64 + 10
        );
    }

    #[test]
    fn events_past_the_bound_are_counted_not_kept() {
        let mut h = Handoff::default();
        for i in 0..(MAX_EVENTS as i64 + 7) {
            h.push_event(event(i));
        }
        assert_eq!(h.events.len(), MAX_EVENTS);
        assert_eq!(h.dropped, 7);
        // The oldest are kept: a request's start is never lost for its end.
        assert_eq!(h.events[0].time_ns, 0);
        assert_eq!(h.events.last().unwrap().time_ns, MAX_EVENTS as i64 - 1);
        assert!(!std::mem::take(&mut h).is_empty());
        assert!(h.is_empty());
    }
}
