//! What the probe asks the collector about the server under test: memory at
//! each step, incidents (the domain that bounds a figure), and verdicts.

use std::time::Duration;

use crate::pb;
use crate::report::MemoryAt;

/// What the probe asks the collector about the server under test. The CLI
/// answers it over the collector's QueryService; `None` or empty means "no
/// answer", which the probe reports as "not measured", never as a figure.
pub trait EvidenceSource {
    /// The samples and events of `agent` (id or name) since `from_ns`.
    fn timeline(&mut self, agent: &str, from_ns: i64) -> Option<pb::TimelineResponse>;
    /// Every incident the collector recorded.
    fn incidents(&mut self) -> Vec<pb::Incident>;
    /// The verdict on `agent`'s timeline since `from_ns`.
    fn diagnose(&mut self, agent: &str, from_ns: i64) -> Option<pb::Diagnosis>;
    /// Every agent the collector knows.
    fn agents(&mut self) -> Vec<pb::AgentSummary>;
}

/// The collector's view of one agent, step by step.
pub struct Watch {
    source: Box<dyn EvidenceSource>,
    pub agent: String,
}

impl Watch {
    pub fn new(source: Box<dyn EvidenceSource>, agent: &str) -> Watch {
        Watch {
            source,
            agent: agent.to_string(),
        }
    }

    /// The memory at a step that began at `from_ns`: the peak over the
    /// agent's samples since then (a step's memory is its high-water mark),
    /// or, for a step shorter than the sample interval, the reading just
    /// before it (within `RECENT_NS`).
    pub fn memory(&mut self, from_ns: i64) -> Option<MemoryAt> {
        /// A reading older than this says nothing about the step.
        const RECENT_NS: i64 = 5_000_000_000;
        // The agent's reading at the request's end may trail the HTTP answer a little.
        std::thread::sleep(Duration::from_millis(150));
        let t = self.source.timeline(&self.agent, from_ns - RECENT_NS)?;
        let all: Vec<pb::Sample> = t.samples.into_iter().filter_map(|s| s.sample).collect();
        let during: Vec<pb::Sample> = all
            .iter()
            .filter(|s| s.time_ns >= from_ns)
            .cloned()
            .collect();
        let samples = if during.is_empty() {
            all.last().cloned().into_iter().collect()
        } else {
            during
        };
        if samples.is_empty() {
            return None;
        }
        let max = |f: &dyn Fn(&pb::Sample) -> Option<u64>| samples.iter().filter_map(f).max();
        Some(MemoryAt {
            allocated_bytes: max(&|s| s.allocator.first().map(|a| a.allocated_bytes)),
            reserved_bytes: max(&|s| s.allocator.first().map(|a| a.reserved_bytes)),
            rss_bytes: max(&|s| s.process.as_ref().map(|p| p.vm_rss_bytes)),
            cgroup_usage_bytes: max(&|s| s.cgroup.first().map(|c| c.usage_bytes)),
        })
    }

    /// Incidents of any agent of this name since `from_ns`, oldest first.
    pub fn incidents_since(&mut self, from_ns: i64) -> Vec<pb::Incident> {
        self.source
            .incidents()
            .into_iter()
            .filter(|i| i.agent_name == self.agent && i.time_ns >= from_ns)
            .collect()
    }

    /// The diagnosis of the agent's timeline since `from_ns` (leak hunts).
    pub fn diagnose_since(&mut self, from_ns: i64) -> Option<pb::Diagnosis> {
        self.source.diagnose(&self.agent, from_ns)
    }

    /// The newest Hello of the agent: what the server is configured with.
    pub fn hello(&mut self) -> Option<pb::Hello> {
        self.source
            .agents()
            .into_iter()
            .filter_map(|a| a.hello.map(|h| (a.first_seen_ns, h)))
            .filter(|(_, h)| h.name == self.agent)
            .max_by_key(|(t, _)| *t)
            .map(|(_, h)| h)
    }
}
