//! What the probe asks the collector about the server under test: memory at
//! each step, incidents (the domain that bounds a figure), and verdicts.

use std::time::Duration;

use anyhow::Result;
use oomscope_agent_core::pb;
use pb::query_service_client::QueryServiceClient;
use tonic::transport::Channel;

use super::report::MemoryAt;
use crate::cli::query;

pub struct Watch {
    rt: tokio::runtime::Runtime,
    client: QueryServiceClient<Channel>,
    pub agent: String,
}

impl Watch {
    pub fn connect(url: &str, agent: &str) -> Result<Watch> {
        // The runtime stays with the client: its connection lives there.
        let rt = query::runtime()?;
        let client = rt.block_on(query::client(url))?;
        Ok(Watch {
            rt,
            client,
            agent: agent.to_string(),
        })
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
        let mut c = self.client.clone();
        let req = pb::TimelineRequest {
            agent: self.agent.clone(),
            from_ns: from_ns - RECENT_NS,
            to_ns: 0,
            max_points: 0,
        };
        let t = self.rt.block_on(c.timeline(req)).ok()?.into_inner();
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
        let mut c = self.client.clone();
        let req = pb::IncidentsRequest {
            agent: String::new(),
        };
        let Ok(r) = self.rt.block_on(c.incidents(req)) else {
            return Vec::new();
        };
        r.into_inner()
            .incidents
            .into_iter()
            .filter(|i| i.agent_name == self.agent && i.time_ns >= from_ns)
            .collect()
    }

    /// The diagnosis of the agent's timeline since `from_ns` (leak hunts).
    pub fn diagnose_since(&mut self, from_ns: i64) -> Option<pb::Diagnosis> {
        let mut c = self.client.clone();
        let req = pb::DiagnoseRequest {
            incident: String::new(),
            agent: self.agent.clone(),
            from_ns,
            to_ns: 0,
        };
        self.rt
            .block_on(c.diagnose(req))
            .ok()
            .map(|r| r.into_inner())
    }

    /// The newest Hello of the agent: what the server is configured with.
    pub fn hello(&mut self) -> Option<pb::Hello> {
        let mut c = self.client.clone();
        let r = self
            .rt
            .block_on(c.list_agents(pb::ListAgentsRequest {}))
            .ok()?
            .into_inner();
        r.agents
            .into_iter()
            .filter_map(|a| a.hello.map(|h| (a.first_seen_ns, h)))
            .filter(|(_, h)| h.name == self.agent)
            .max_by_key(|(t, _)| *t)
            .map(|(_, h)| h)
    }
}
