//! The facts of one failure, read from an agent's timeline and its incident:
//! when it happened, what was requested, in which phase, at which load.

use crate::pb;
use crate::pb::event::Kind;

/// One failure as the timeline recorded it.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub incident_id: String,
    /// The incident's kind: "oom", "signal", "exit_oom_text", "agent_lost", "crash_loop".
    pub kind: String,
    pub time_ns: i64,
    /// The allocator's OOM event, when the failure was one.
    pub oom: Option<pb::Oom>,
    /// The bytes the failed allocation asked for.
    pub requested_bytes: Option<u64>,
    /// The runtime's phase at the failure ("decode", "load", ...).
    pub phase: Option<String>,
    /// The load when it failed (from the context at the failure).
    pub active_tokens: Option<u64>,
    pub active_sequences: Option<u64>,
    pub requests_done: Option<u64>,
    /// The error text (the OOM's, or the stderr tail of a killed child).
    pub error_text: Option<String>,
    /// When the OOM's allocator reading was taken, where it is a copy of an
    /// earlier sample's (a replayed capture has no reading at the OOM itself);
    /// None when the reading is the OOM's own.
    pub stats_from_ns: Option<i64>,
}

impl Failure {
    /// Reads the failure `incident` names from its agent's timeline.
    pub fn find(t: &pb::TimelineResponse, incident: &pb::Incident) -> Failure {
        // The incident names the event that raised it by seq; fall back on
        // the last OOM at or before its time (a timeline read in a range may
        // lack that event).
        let by_seq = t
            .events
            .iter()
            .find(|e| incident.seq != 0 && e.seq == incident.seq)
            .and_then(|e| e.event.as_ref());
        let oom_event = match by_seq.and_then(|e| e.kind.as_ref()) {
            Some(Kind::Oom(o)) => Some(o.clone()),
            _ => t
                .events
                .iter()
                .filter_map(|e| e.event.as_ref())
                .filter(|e| e.time_ns <= incident.time_ns)
                .filter_map(|e| match &e.kind {
                    Some(Kind::Oom(o)) => Some(o.clone()),
                    _ => None,
                })
                .next_back(),
        };
        let exit_text = match by_seq.and_then(|e| e.kind.as_ref()) {
            Some(Kind::ChildExit(c)) if !c.stderr_tail.is_empty() => Some(c.stderr_tail.clone()),
            _ => None,
        };
        // Readings strictly before the failure: one stamped at its very
        // instant may have been taken just after it.
        let before: Vec<&pb::Sample> = t
            .samples
            .iter()
            .filter_map(|s| s.sample.as_ref())
            .filter(|s| s.time_ns < incident.time_ns)
            .collect();
        let sample_ctx = before.iter().filter_map(|s| s.context.as_ref()).next_back();
        let stats_from_ns = oom_event.as_ref().and_then(|o| {
            let stats = o.stats.as_ref()?;
            let last = before.last()?;
            let same = last.allocator.iter().any(|a| a == stats);
            same.then_some(last.time_ns)
        });
        let ctx = oom_event
            .as_ref()
            .and_then(|o| o.context.as_ref())
            .or(sample_ctx);
        let nonzero = |v: u64| (v > 0).then_some(v);
        Failure {
            incident_id: incident.id.clone(),
            kind: incident.kind.clone(),
            time_ns: incident.time_ns,
            requested_bytes: oom_event.as_ref().and_then(|o| nonzero(o.requested_bytes)),
            phase: ctx.map(|c| c.phase.clone()).filter(|p| !p.is_empty()),
            active_tokens: ctx.and_then(|c| nonzero(c.active_tokens)),
            active_sequences: ctx.and_then(|c| nonzero(c.active_sequences)),
            requests_done: ctx.and_then(|c| nonzero(c.requests_done)),
            error_text: oom_event
                .as_ref()
                .map(|o| o.error_text.clone())
                .filter(|t| !t.is_empty())
                .or(exit_text),
            oom: oom_event,
            stats_from_ns,
        }
    }

    /// Allocated bytes when it failed (the OOM's own reading).
    pub fn allocated_bytes(&self) -> Option<u64> {
        self.oom.as_ref()?.stats.as_ref().map(|s| s.allocated_bytes)
    }
}
