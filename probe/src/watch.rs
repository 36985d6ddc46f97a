//! What the probe asks the collector about the server under test: memory at
//! each step (in the domain that bounds it), the server's own load (its
//! agent's context), incidents (the domain that bounds a figure, and any
//! death), verdicts, and the command it was started with.

use std::time::Duration;

use crate::metrics::{Load, Reading};
use crate::pb;
use crate::report::MemoryAt;

/// What the probe asks the collector about the server under test. The CLI
/// answers it over the collector's QueryService; `None` or empty means "no
/// answer", which the probe reports as "not measured", never as a figure.
pub trait EvidenceSource {
    /// The samples and events of `agent` (instance id, agent id or name) since `from_ns`.
    fn timeline(&mut self, agent: &str, from_ns: i64) -> Option<pb::TimelineResponse>;
    /// Every incident the collector recorded.
    fn incidents(&mut self) -> Vec<pb::Incident>;
    /// The verdict on `agent`'s timeline since `from_ns`.
    fn diagnose(&mut self, agent: &str, from_ns: i64) -> Option<pb::Diagnosis>;
    /// The verdict on one incident (its cause).
    fn diagnose_incident(&mut self, _incident: &str) -> Option<pb::Diagnosis> {
        None
    }
    /// Every agent the collector knows.
    fn agents(&mut self) -> Vec<pb::AgentSummary>;
}

/// The collector's view of one agent, step by step.
pub struct Watch {
    source: Box<dyn EvidenceSource>,
    pub agent: String,
}

/// The tightest cgroup limit of a sample (own level first, then each
/// ancestor) and that level's usage.
fn bounding_cgroup(s: &pb::Sample) -> Option<(u64, u64)> {
    s.cgroup
        .iter()
        .filter(|c| c.limit_bytes > 0)
        .min_by_key(|c| c.limit_bytes)
        .map(|c| (c.usage_bytes, c.limit_bytes))
}

/// The memory of a step from its samples: each figure's peak.
pub fn memory_of(samples: &[pb::Sample]) -> Option<MemoryAt> {
    if samples.is_empty() {
        return None;
    }
    let max = |f: &dyn Fn(&pb::Sample) -> Option<u64>| samples.iter().filter_map(f).max();
    let gpu = |s: &pb::Sample| -> Option<(u64, u64)> {
        (!s.gpus.is_empty()).then(|| {
            (
                s.gpus.iter().map(|g| g.used_bytes).sum(),
                s.gpus.iter().map(|g| g.total_bytes).sum(),
            )
        })
    };
    Some(MemoryAt {
        allocated_bytes: max(&|s| s.allocator.first().map(|a| a.allocated_bytes)),
        reserved_bytes: max(&|s| s.allocator.first().map(|a| a.reserved_bytes)),
        // The supervised tree's resident memory, where `oomscope run` sampled it.
        rss_bytes: max(&|s| {
            (s.tree_rss_bytes > 0)
                .then_some(s.tree_rss_bytes)
                .or_else(|| s.process.as_ref().map(|p| p.vm_rss_bytes))
        }),
        cgroup_usage_bytes: max(&|s| {
            bounding_cgroup(s)
                .map(|c| c.0)
                .or_else(|| s.cgroup.first().map(|c| c.usage_bytes))
        }),
        cgroup_limit_bytes: max(&|s| bounding_cgroup(s).map(|c| c.1)),
        gpu_used_bytes: max(&|s| gpu(s).map(|g| g.0)).filter(|&u| u > 0),
        gpu_total_bytes: max(&|s| gpu(s).map(|g| g.1)).filter(|&t| t > 0),
    })
}

/// The server's load as its agent reported it (`set_context`): active
/// sequences, queued requests and the KV cache's fill.
pub fn reading_of(c: &pb::RequestContext) -> Option<Reading> {
    if c.active_sequences == 0 && c.queued == 0 && c.batch_size == 0 && c.kv_cache_bytes == 0 {
        return None;
    }
    Some(Reading {
        running: Some(c.active_sequences.max(c.batch_size) as f64),
        waiting: Some(c.queued as f64),
        kv_usage: (c.kv_cache_capacity_bytes > 0)
            .then(|| c.kv_cache_bytes as f64 / c.kv_cache_capacity_bytes as f64),
        preemptions: c.numbers.get("preemptions").copied(),
    })
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
        memory_of(&samples)
    }

    /// The server's own count of its load between `from_ns` and `to_ns`, from
    /// every member of its instance that reported a context (the server's
    /// in-process agent). None when none did.
    pub fn load(&mut self, from_ns: i64, to_ns: i64) -> Option<Load> {
        let t = self.source.timeline(&self.agent, from_ns)?;
        let main = t
            .hello
            .as_ref()
            .map(|h| h.agent_id.clone())
            .unwrap_or_default();
        let mut samples: Vec<pb::Sample> = t.samples.into_iter().filter_map(|s| s.sample).collect();
        for m in &t.members {
            let Some(id) = m.hello.as_ref().map(|h| h.agent_id.clone()) else {
                continue;
            };
            if id == main
                || m.hello
                    .as_ref()
                    .is_some_and(|h| h.role == oomscope_proto::Role::Probe)
            {
                continue;
            }
            if let Some(mt) = self.source.timeline(&id, from_ns) {
                samples.extend(mt.samples.into_iter().filter_map(|s| s.sample));
            }
        }
        samples.retain(|s| s.time_ns >= from_ns && s.time_ns <= to_ns);
        samples.sort_by_key(|s| s.time_ns);
        // The server's own count only: a probe's context (this one's, joined
        // to a server with no agent, or another probe's) counts what was sent.
        let readings: Vec<Reading> = samples
            .iter()
            .filter_map(|s| s.context.as_ref())
            .filter(|c| c.phase != oomscope_proto::PROBE_PHASE)
            .filter_map(reading_of)
            .collect();
        (!readings.is_empty()).then(|| Load::of("collector: the server's agent", &readings))
    }

    /// Incidents of any agent of this name since `from_ns`, oldest first.
    pub fn incidents_since(&mut self, from_ns: i64) -> Vec<pb::Incident> {
        let mut v: Vec<pb::Incident> = self
            .source
            .incidents()
            .into_iter()
            .filter(|i| i.agent_name == self.agent && i.time_ns >= from_ns)
            .collect();
        v.sort_by_key(|i| i.time_ns);
        v
    }

    /// The leading cause of an incident, as its diagnosis names it.
    pub fn cause_of(&mut self, incident: &str) -> Option<String> {
        let d = self.source.diagnose_incident(incident)?;
        d.causes
            .first()
            .map(|c| c.kind.clone())
            .filter(|k| !k.is_empty())
    }

    /// The diagnosis of the agent's timeline since `from_ns` (leak hunts).
    pub fn diagnose_since(&mut self, from_ns: i64) -> Option<pb::Diagnosis> {
        self.source.diagnose(&self.agent, from_ns)
    }

    /// The Hellos of the agent's newest instance, newest first: what the
    /// server is configured with. The supervisor's carries the command.
    pub fn hellos(&mut self) -> Vec<pb::Hello> {
        let mut agents: Vec<pb::AgentSummary> = self
            .source
            .agents()
            .into_iter()
            .filter(|a| a.hello.as_ref().is_some_and(|h| h.name == self.agent))
            .collect();
        agents.sort_by_key(|a| std::cmp::Reverse(a.first_seen_ns));
        let Some(newest) = agents.first() else {
            return vec![];
        };
        let instance = newest.instance.clone();
        agents
            .into_iter()
            .filter(|a| instance.is_empty() || a.instance == instance)
            .filter_map(|a| a.hello)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: i64, usage: u64, levels: &[(u64, u64)]) -> pb::Sample {
        pb::Sample {
            time_ns: t,
            process: Some(pb::ProcessMemory {
                vm_rss_bytes: 900 << 20,
                ..Default::default()
            }),
            cgroup: levels
                .iter()
                .map(|&(limit, u)| pb::CgroupLevel {
                    limit_bytes: limit,
                    usage_bytes: u,
                    ..Default::default()
                })
                .collect(),
            tree_rss_bytes: usage,
            ..Default::default()
        }
    }

    #[test]
    fn memory_is_read_against_the_tightest_cgroup_limit() {
        // Own level unlimited, the parent limited to 512 MiB.
        let s = [
            sample(1, 600 << 20, &[(0, 400 << 20), (512 << 20, 450 << 20)]),
            sample(2, 610 << 20, &[(0, 410 << 20), (512 << 20, 470 << 20)]),
        ];
        let m = memory_of(&s).unwrap();
        assert_eq!(
            (m.cgroup_usage_bytes, m.cgroup_limit_bytes),
            (Some(470 << 20), Some(512 << 20))
        );
        assert_eq!(m.rss_bytes, Some(610 << 20));
        let shown = m.shown().unwrap();
        assert!(
            shown.starts_with("cgroup ") && shown.contains("512"),
            "{shown}"
        );
        // No limit anywhere: RSS.
        let m = memory_of(&[sample(1, 300 << 20, &[(0, 1 << 30)])]).unwrap();
        assert!(m.shown().unwrap().starts_with("rss "), "{:?}", m.shown());
        // On a GPU: the GPU.
        let mut g = sample(1, 300 << 20, &[(512 << 20, 1)]);
        g.gpus.push(pb::GpuDevice {
            used_bytes: 40 << 30,
            total_bytes: 80 << 30,
            ..Default::default()
        });
        assert!(memory_of(&[g])
            .unwrap()
            .shown()
            .unwrap()
            .starts_with("gpu "));
    }

    #[test]
    fn an_agents_context_is_a_load_reading() {
        assert_eq!(reading_of(&pb::RequestContext::default()), None);
        let r = reading_of(&pb::RequestContext {
            active_sequences: 4,
            queued: 3,
            kv_cache_bytes: 90,
            kv_cache_capacity_bytes: 100,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            (r.running, r.waiting, r.kv_usage),
            (Some(4.0), Some(3.0), Some(0.9))
        );
    }
}
