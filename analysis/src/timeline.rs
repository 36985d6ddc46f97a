//! One agent's samples as the series the cause analyzers fit: allocator
//! bytes against requests, tokens and sequences, with each sample's place in
//! the request lifecycle.

use crate::devices::{DeviceKey, Devices};
use crate::evidence::Evidence;
use crate::pb;
use crate::pb::event::Kind;

/// The phase replay gives the allocator reading taken after the scenario
/// ended (after gc, empty_cache or the OOM): not part of any growth.
pub const FINAL_PHASE: &str = "final";

/// Phases of samples taken between requests: the baseline a leak raises.
/// An empty phase counts too when no request is active.
const BASELINE_PHASES: &[&str] = &[
    "after_request",
    "idle",
    "between_requests",
    "request_end",
    "",
];

/// One sample, flattened.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Point {
    pub time_ns: i64,
    pub phase: String,
    pub requests_done: u64,
    pub active_sequences: u64,
    pub active_tokens: u64,
    pub prompt_tokens: u64,
    pub weight_bytes: u64,
    pub loaded_bytes: u64,
    pub live_tensors: u64,
    /// False when the sample had no allocator reading (a host-only agent).
    pub has_allocator: bool,
    pub allocated: u64,
    /// Cumulative since the process began (or the last reset_peak_memory_stats).
    pub peak: u64,
    pub reserved: u64,
    pub inactive_split: u64,
    pub alloc_retries: u64,
    pub rss: Option<u64>,
    /// The innermost memory cgroup's usage.
    pub cgroup_usage: Option<u64>,
    pub cgroup_limit: Option<u64>,
    /// What the in-process agent itself held on the heap (part of both RSS
    /// and the cgroup's usage); 0 where the agent does not count it.
    pub agent_heap: u64,
    /// `oomscope run`: the PSS of the supervised process tree.
    pub tree_pss: Option<u64>,
    /// This process's device memory as NVML lists it (its own pids'
    /// entries, summed): what a framework allocates outside any allocator
    /// the agent reads (candle through cudarc), the CUDA context included.
    /// None where the sample had no such reading.
    pub device_used: Option<u64>,
}

impl Point {
    pub fn is_load(&self) -> bool {
        self.phase.starts_with("load")
    }

    /// The tokens the reading was taken at: those in service, else the prompt's.
    pub fn tokens(&self) -> u64 {
        if self.active_tokens > 0 {
            self.active_tokens
        } else {
            self.prompt_tokens
        }
    }

    /// A reading right after a garbage collection (`after_gc_collect`).
    pub fn is_after_gc(&self) -> bool {
        self.phase.contains("gc")
    }

    /// A reading right after `empty_cache`.
    pub fn is_after_cache_release(&self) -> bool {
        self.phase.contains("empty_cache")
    }

    /// Inside a request: sequences active, or a generation phase.
    pub fn in_request(&self) -> bool {
        self.active_sequences > 0
            || matches!(
                self.phase.as_str(),
                "decode" | "prefill" | "prefill_decode" | "generate"
            )
    }

    /// Between requests, with nothing in flight.
    pub fn is_baseline(&self) -> bool {
        !self.in_request() && BASELINE_PHASES.contains(&self.phase.as_str())
    }

    /// The server's own resident set: RSS without the agent's heap, whose
    /// steps (a census's tables) are not the server's growth.
    pub fn server_rss(&self) -> Option<u64> {
        self.rss.map(|r| r.saturating_sub(self.agent_heap))
    }

    /// The cgroup's usage without the agent's heap.
    pub fn server_cgroup_usage(&self) -> Option<u64> {
        self.cgroup_usage.map(|u| u.saturating_sub(self.agent_heap))
    }
}

/// The samples in time order (the final reading left out), and the collections.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub points: Vec<Point>,
    /// Times of GcCollection events that collected something.
    pub gc_times: Vec<i64>,
    /// Times of CacheRelease events, with the reserved bytes before and after.
    pub cache_releases: Vec<(i64, u64, u64)>,
}

impl Timeline {
    /// The timeline of the failing device (without a failure, of the one
    /// device the process uses).
    pub fn from_evidence(e: &Evidence) -> Timeline {
        Timeline::of_device(e, Devices::of(e).failing_key().as_ref())
    }

    /// The timeline with `device`'s allocator readings: samples that carry
    /// only other devices' have none (`has_allocator` false), so a process
    /// that fails on its GPU 3 is never judged by GPU 0's numbers.
    pub fn of_device(e: &Evidence, device: Option<&DeviceKey>) -> Timeline {
        let own = e.own_pids();
        let mut points: Vec<Point> = e
            .samples
            .iter()
            .map(|s| point(s, device, &own))
            .filter(|p| p.phase != FINAL_PHASE)
            .collect();
        points.sort_by_key(|p| p.time_ns);
        let mut t = Timeline {
            points,
            ..Default::default()
        };
        for ev in &e.events {
            match &ev.kind {
                Some(Kind::Gc(g)) if g.collected > 0 => t.gc_times.push(ev.time_ns),
                Some(Kind::CacheRelease(c)) => t.cache_releases.push((
                    ev.time_ns,
                    c.reserved_before_bytes,
                    c.reserved_after_bytes,
                )),
                _ => {}
            }
        }
        t.count_requests_from_boundaries(e);
        t
    }

    /// Samples with an allocator reading.
    pub fn device(&self) -> impl Iterator<Item = &Point> {
        self.points.iter().filter(|p| p.has_allocator)
    }

    /// Between-request samples with an allocator reading.
    pub fn baseline(&self) -> impl Iterator<Item = &Point> {
        self.device().filter(|p| p.is_baseline())
    }

    /// Samples inside requests that say how many tokens are active.
    pub fn active(&self) -> impl Iterator<Item = &Point> {
        self.device()
            .filter(|p| p.active_tokens > 0 && !p.is_load())
    }

    /// The number of requests completed by the end.
    pub fn requests_done(&self) -> u64 {
        self.points
            .iter()
            .map(|p| p.requests_done)
            .max()
            .unwrap_or(0)
    }

    /// An agent that sends RequestBoundary events but no request context:
    /// count completed and active requests from the boundaries.
    fn count_requests_from_boundaries(&mut self, e: &Evidence) {
        if self.points.iter().any(|p| p.requests_done > 0) {
            return;
        }
        let mut edges: Vec<(i64, bool)> = e
            .events
            .iter()
            .filter_map(|ev| match &ev.kind {
                Some(Kind::Request(r)) => Some((ev.time_ns, r.start)),
                _ => None,
            })
            .collect();
        if !edges.iter().any(|(_, start)| !start) {
            return;
        }
        edges.sort_by_key(|(t, _)| *t);
        // One sweep over points and edges, both in time order (the points
        // were sorted on construction; a point's counts are those of the
        // edges at or before it).
        let (mut next, mut starts, mut ends) = (0, 0u64, 0u64);
        for p in &mut self.points {
            while let Some(&(t, start)) = edges.get(next) {
                if t > p.time_ns {
                    break;
                }
                if start {
                    starts += 1;
                } else {
                    ends += 1;
                }
                next += 1;
            }
            p.requests_done = ends;
            if p.active_sequences == 0 {
                p.active_sequences = starts.saturating_sub(ends);
            }
        }
    }
}

fn point(s: &pb::Sample, device: Option<&DeviceKey>, own: &[u32]) -> Point {
    let ctx = s.context.clone().unwrap_or_default();
    let a = DeviceKey::allocator(device, &s.allocator);
    // Own cgroup first: its usage is what this process charges.
    let cg = s.cgroup.first();
    Point {
        time_ns: s.time_ns,
        phase: ctx.phase,
        requests_done: ctx.requests_done,
        active_sequences: ctx.active_sequences,
        active_tokens: ctx.active_tokens,
        prompt_tokens: ctx.prompt_tokens,
        weight_bytes: ctx.weight_bytes,
        loaded_bytes: ctx.loaded_bytes,
        live_tensors: ctx.live_tensors,
        has_allocator: a.is_some(),
        allocated: a.map_or(0, |a| a.allocated_bytes),
        peak: a.map_or(0, |a| a.allocated_peak_bytes),
        reserved: a.map_or(0, |a| a.reserved_bytes),
        inactive_split: a.map_or(0, |a| a.inactive_split_bytes),
        alloc_retries: a.map_or(0, |a| a.num_alloc_retries),
        rss: s
            .process
            .as_ref()
            .map(|p| p.vm_rss_bytes)
            .filter(|&r| r > 0),
        cgroup_usage: cg.map(|c| c.usage_bytes).filter(|&u| u > 0),
        // The tightest limit on the way to the root.
        cgroup_limit: s
            .cgroup
            .iter()
            .map(|c| c.limit_bytes)
            .filter(|&l| crate::evidence::is_finite_limit(l))
            .min(),
        agent_heap: s.process.as_ref().map_or(0, |p| p.agent_heap_bytes),
        tree_pss: Some(s.tree_pss_bytes).filter(|&b| b > 0),
        device_used: nvml_own_bytes(s, device, own),
    }
}

/// This process's device memory in one sample, as NVML lists it: its
/// boundary reading (`gpu_processes`), else the periodic reading's entries,
/// on `device` (every device where none is known). Entries are the
/// process's by the agent's view, or by number where it gave none; an
/// unresolved pid (a container's) is no one's. None where no entry of ours
/// with a figure was listed.
fn nvml_own_bytes(s: &pb::Sample, device: Option<&DeviceKey>, own: &[u32]) -> Option<u64> {
    let known = device.filter(|k| k.uuid.is_some() || k.nvml_index.is_some());
    let ours = |pid: u32, view: pb::PidView| match view {
        pb::PidView::Own => true,
        pb::PidView::Unresolved => false,
        pb::PidView::Visible | pb::PidView::Unspecified => own.contains(&pid),
    };
    let entries: Vec<Option<u64>> = if !s.gpu_processes.is_empty() {
        s.gpu_processes
            .iter()
            .filter(|p| known.is_none_or(|k| k.lists(p)))
            .filter(|p| ours(p.pid, p.view()))
            .map(|p| p.used_bytes)
            .collect()
    } else {
        s.gpus
            .iter()
            .filter(|g| known.is_none_or(|k| k.reads(g)))
            .flat_map(|g| g.processes.iter())
            .filter(|p| ours(p.pid, p.view()))
            .map(|p| p.used_bytes)
            .collect()
    };
    let figures: Vec<u64> = entries.into_iter().flatten().collect();
    (!figures.is_empty()).then(|| figures.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::event::Kind;

    #[test]
    fn requests_are_counted_from_boundaries_when_no_context_says() {
        let sample = |t: i64| pb::Sample {
            time_ns: t,
            ..Default::default()
        };
        let edge = |t: i64, start: bool| pb::Event {
            time_ns: t,
            kind: Some(Kind::Request(pb::RequestBoundary {
                start,
                ..Default::default()
            })),
        };
        let e = Evidence {
            samples: vec![sample(50), sample(5), sample(25), sample(35)],
            events: vec![
                edge(10, true),
                edge(20, false),
                edge(30, true),
                edge(31, true),
                edge(40, false),
            ],
            ..Default::default()
        };
        let t = Timeline::from_evidence(&e);
        let at: Vec<(i64, u64, u64)> = t
            .points
            .iter()
            .map(|p| (p.time_ns, p.requests_done, p.active_sequences))
            .collect();
        assert_eq!(at, vec![(5, 0, 0), (25, 1, 0), (35, 1, 2), (50, 2, 1)]);
    }
}
