//! The probe's own requests as the server's workload. A server with no
//! in-process agent (a C++ runtime, a container) tells the collector nothing
//! about what it was serving; the probe knows exactly: each request's
//! tokens, its start and end, and how many were in flight. It sends that to
//! the collector under the server's instance, so that a failure during a
//! probe gets a size- or concurrency-dependent trigger from these requests.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::pb;

/// Where the workload goes: the CLI sends it on an agent stream with role
/// [`oomscope_proto::Role::Probe`]. Calls come from request threads, so they
/// must not block on the network.
pub trait WorkloadSink: Send + Sync {
    /// The requests in flight changed (a context sample at `time_ns`).
    fn context(&self, time_ns: i64, context: pb::RequestContext);
    /// A request started or ended.
    fn boundary(&self, time_ns: i64, boundary: pb::RequestBoundary);
}

/// The requests in flight, reported to a [`WorkloadSink`] at each change.
pub struct Workload {
    sink: Box<dyn WorkloadSink>,
    state: Mutex<InFlight>,
}

#[derive(Default)]
struct InFlight {
    next_id: u64,
    /// Open requests by id: their prompt tokens (the probe's estimate).
    open: BTreeMap<u64, u64>,
    done: u64,
}

impl InFlight {
    fn context(&self) -> pb::RequestContext {
        pb::RequestContext {
            phase: oomscope_proto::PROBE_PHASE.into(),
            active_sequences: self.open.len() as u64,
            active_tokens: self.open.values().sum(),
            // The longest prompt in flight: the one a size-dependent failure is about.
            prompt_tokens: self.open.values().copied().max().unwrap_or(0),
            requests_done: self.done,
            ..Default::default()
        }
    }
}

/// One request the probe sent; [`Workload::end`] closes it.
#[derive(Debug)]
pub struct Started {
    id: u64,
}

impl std::fmt::Debug for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        write!(f, "Workload({} in flight, {} done)", s.open.len(), s.done)
    }
}

impl Workload {
    pub fn new(sink: Box<dyn WorkloadSink>) -> Workload {
        Workload {
            sink,
            state: Mutex::new(InFlight::default()),
        }
    }

    /// A request of about `prompt_tokens` tokens (0: unknown) starts now.
    pub fn start(&self, prompt_tokens: u64, max_tokens: u64) -> Started {
        let now = oomscope_proto::now_ns();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let id = s.next_id;
        s.next_id += 1;
        s.open.insert(id, prompt_tokens);
        let context = s.context();
        drop(s);
        self.sink.boundary(
            now,
            pb::RequestBoundary {
                request_id: format!("probe-{id}"),
                start: true,
                prompt_tokens,
                max_tokens,
                ..Default::default()
            },
        );
        self.sink.context(now, context);
        Started { id }
    }

    /// The request ended: with the server's own counts where it gave them,
    /// or an error.
    pub fn end(
        &self,
        started: Started,
        prompt_tokens: Option<u64>,
        output_tokens: Option<u64>,
        error: Option<&str>,
    ) {
        let now = oomscope_proto::now_ns();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let estimate = s.open.remove(&started.id).unwrap_or(0);
        s.done += 1;
        let context = s.context();
        drop(s);
        self.sink.boundary(
            now,
            pb::RequestBoundary {
                request_id: format!("probe-{}", started.id),
                start: false,
                prompt_tokens: prompt_tokens.unwrap_or(estimate),
                output_tokens: output_tokens.unwrap_or(0),
                error: error.unwrap_or_default().chars().take(300).collect(),
                ..Default::default()
            },
        );
        self.sink.context(now, context);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Default)]
    struct Recorded(Mutex<Vec<(pb::RequestContext, Option<pb::RequestBoundary>)>>);

    impl WorkloadSink for Arc<Recorded> {
        fn context(&self, _: i64, c: pb::RequestContext) {
            self.0.lock().unwrap().push((c, None));
        }
        fn boundary(&self, _: i64, b: pb::RequestBoundary) {
            self.0
                .lock()
                .unwrap()
                .push((pb::RequestContext::default(), Some(b)));
        }
    }

    #[test]
    fn the_context_counts_what_is_in_flight_and_the_end_takes_the_servers_count() {
        let rec = Arc::new(Recorded::default());
        let w = Workload::new(Box::new(rec.clone()));
        let a = w.start(100, 8);
        let b = w.start(300, 8);
        w.end(a, Some(104), Some(8), None);
        w.end(b, None, None, Some("connection reset"));
        let got = rec.0.lock().unwrap();
        let contexts: Vec<(u64, u64, u64, u64)> = got
            .iter()
            .filter(|(_, b)| b.is_none())
            .map(|(c, _)| {
                (
                    c.active_sequences,
                    c.active_tokens,
                    c.prompt_tokens,
                    c.requests_done,
                )
            })
            .collect();
        assert_eq!(
            contexts,
            vec![
                (1, 100, 100, 0),
                (2, 400, 300, 0),
                (1, 300, 300, 1),
                (0, 0, 0, 2)
            ]
        );
        let ends: Vec<&pb::RequestBoundary> = got
            .iter()
            .filter_map(|(_, b)| b.as_ref())
            .filter(|b| !b.start)
            .collect();
        assert_eq!(ends[0].prompt_tokens, 104, "the server's count wins");
        assert_eq!(
            ends[1].prompt_tokens, 300,
            "the estimate where it gave none"
        );
        assert_eq!(ends[1].error, "connection reset");
    }
}
