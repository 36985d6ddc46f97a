//! Where the memory was at three moments of a timeline: before the model
//! load, after it, and at the failure (or at the last sample when nothing
//! failed). Shared by `oomscope report` and `oomscope compare`.
//!
//! Each value is `None` when the timeline does not say: a table must show
//! "—" rather than a zero nobody measured. A server without an allocator
//! reading (a llama.cpp, a CPU vLLM, any process under `oomscope run`) has
//! no PyTorch rows at all: its table is the host's and the cgroup's rows.

use crate::pb;
use crate::pb::event::Kind;
use oomscope_analysis::devices::DeviceKey;

/// One row of the memory table: its key (JSON), its title (people), what
/// it is made of, and when a table shows it.
pub struct Row {
    pub key: &'static str,
    pub title: &'static str,
    pub how: &'static str,
    pub shown: Shown,
}

/// When a table shows a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shown {
    /// Where the timeline has an allocator's reading: the device rows.
    WithAllocator,
    /// Always: the process's host memory and its cgroup.
    Always,
    /// Where some moment has a value (the process tree, the limit, the host).
    WhenRead,
}

/// The rows, in the order the table shows them. `allocated` and `reserved`
/// are subtotals, so a reader can check the parts against PyTorch's own counts.
pub const ROWS: [Row; 15] = [
    Row {
        key: "weights",
        title: "weights",
        how: "the weight bytes the runtime reported (or loaded so far, during a load), else the allocated bytes when the load phase ended",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "kv",
        title: "KV cache",
        how: "the KV-cache bytes the runtime reported",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "other_live",
        title: "other live",
        how: "allocated bytes not counted as weights or KV (activations, workspaces, retained tensors)",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "allocated",
        title: "= PyTorch allocated (live)",
        how: "the allocator's allocated bytes",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "cached",
        title: "cached",
        how: "reserved − allocated: held by the caching allocator, not in use",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "fragments",
        title: "fragments (part of cached)",
        how: "inactive_split: free pieces of split blocks (not counted under expandable segments)",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "reserved",
        title: "= PyTorch reserved",
        how: "the allocator's reserved bytes",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "non_pytorch",
        title: "non-PyTorch (this process)",
        how: "driver used − reserved − other processes: CUDA context, libraries, other allocators",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "other_processes",
        title: "other processes (GPU)",
        how: "device bytes NVML lists for other pids",
        shown: Shown::WithAllocator,
    },
    Row {
        key: "host_rss",
        title: "host RSS",
        how: "VmRSS of the process",
        shown: Shown::Always,
    },
    Row {
        key: "tree_rss",
        title: "process tree RSS",
        how: "VmRSS summed over the supervised process and its descendants (shared pages count once per process)",
        shown: Shown::WhenRead,
    },
    Row {
        key: "tree_pss",
        title: "process tree PSS",
        how: "PSS summed over the process tree: shared pages split among their users, so the sum is the tree's own memory",
        shown: Shown::WhenRead,
    },
    Row {
        key: "cgroup_usage",
        title: "cgroup usage",
        how: "usage of the process's own memory cgroup",
        shown: Shown::Always,
    },
    Row {
        key: "cgroup_limit", // vocab: a row's key
        title: "cgroup limit",
        how: "the tightest memory limit on the process's cgroup or its ancestors",
        shown: Shown::WhenRead,
    },
    Row {
        key: "mem_available",
        title: "host MemAvailable",
        how: "MemAvailable of the host (/proc/meminfo): what it could still hand out",
        shown: Shown::WhenRead,
    },
];

/// The three moments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    BeforeLoad,
    AfterLoad,
    /// At the failure, or at the last sample when nothing failed.
    AtFailure,
}

impl Moment {
    pub fn key(self) -> &'static str {
        match self {
            Moment::BeforeLoad => "before_load",
            Moment::AfterLoad => "after_load",
            Moment::AtFailure => "at_failure",
        }
    }
}

/// The memory at one moment; `values[i]` belongs to `ROWS[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub moment: Moment,
    /// "before load", "after load", "at failure" or "latest".
    pub title: String,
    /// The sample's time, or the failure's; None when the moment is unknown.
    pub time_ns: Option<i64>,
    pub values: [Option<u64>; ROWS.len()],
}

impl Point {
    pub fn get(&self, key: &str) -> Option<u64> {
        ROWS.iter()
            .position(|r| r.key == key)
            .and_then(|i| self.values[i])
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct MemoryTable {
    pub points: [Point; 3],
    /// Some moment has an allocator's reading: the device rows apply.
    pub allocator: bool,
    /// Expandable segments were on: inactive_split is not counted.
    pub expandable_segments: bool,
    /// Why a moment has no reading, for a footnote.
    pub notes: Vec<String>,
}

/// Builds the table from one agent's timeline and its failure, if any.
pub fn table(
    t: &pb::TimelineResponse,
    failure: Option<&pb::Failure>,
    device: Option<&pb::FailedDevice>,
) -> MemoryTable {
    let hello = t.hello.clone().unwrap_or_default();
    let samples: Vec<&pb::Sample> = t.samples.iter().filter_map(|s| s.sample.as_ref()).collect();
    let events: Vec<&pb::Event> = t.events.iter().filter_map(|e| e.event.as_ref()).collect();
    let expandable = hello
        .allocator_settings
        .as_ref()
        .is_some_and(|s| s.expandable_segments)
        || failure.is_some_and(|f| f.expandable_segments);
    // The failing device as the analysis joined it; an older diagnosis's
    // failure names PyTorch's ordinal only.
    let device = device.map(DeviceKey::of_failed).or_else(|| {
        failure
            .and_then(|f| f.oom_device)
            .map(DeviceKey::of_ordinal)
    });
    let own_pids = own_pids(&hello, &events);
    let mut notes = Vec::new();

    let load = LoadEdges::find(&samples, &events);
    let before_idx = match (load.start_ns, load.end_idx) {
        // The reading at the load's start edge is still before the load.
        (Some(start), _) => samples.iter().rposition(|s| s.time_ns <= start),
        (None, Some(end)) => (end > 0).then_some(0),
        (None, None) => (!samples.is_empty()).then_some(0),
    };
    let cutoff = failure.map_or(i64::MAX, |f| f.time_ns);
    let after_idx = load
        .end_idx
        .filter(|&i| samples[i].time_ns <= cutoff && load.failed.is_none());
    if load.failed.is_some() {
        notes.push("the model load never finished (its error is the failure's), so there is no after-load reading".into());
    } else if load.end_idx.is_none() {
        notes.push("no model load was recorded, so there is no after-load reading".into());
    }

    let ctx = Ctx {
        samples: &samples,
        events: &events,
        device,
        expandable,
        own_pids: &own_pids,
        load_end_weights: load.weights,
        load_end_ns: load.end_ns,
        others_seen: events
            .iter()
            .any(|e| matches!(&e.kind, Some(Kind::ProcessList(p)) if !p.gpu.is_empty()))
            || samples
                .iter()
                .any(|s| s.gpus.iter().any(|g| !g.processes.is_empty())),
    };
    let before = ctx.point(Moment::BeforeLoad, "before load", before_idx, None);
    let after = ctx.point(Moment::AfterLoad, "after load", after_idx, None);
    let last = match failure {
        Some(f) => {
            // Strictly before: a reading stamped at the failure's instant
            // may have been taken after it (a capture's final reading is).
            let idx = samples.iter().rposition(|s| s.time_ns < f.time_ns);
            ctx.point(Moment::AtFailure, "at failure", idx, Some(f))
        }
        None => {
            let idx = samples.len().checked_sub(1);
            ctx.point(Moment::AtFailure, "latest", idx, None)
        }
    };
    if let Some(from) = failure.and_then(|f| f.stats_from_ns.map(|t| (f.time_ns, t))) {
        notes.push(format!(
            "the allocator columns at failure are the last reading before it, {} earlier: \
             no reading was taken at the failure itself",
            super::gap(from.0 - from.1)
        ));
    }
    if expandable {
        notes.push(
            "expandable segments are on: PyTorch does not count inactive_split, so fragments show —; \
             reserved − allocated (cached) is the measure"
                .into(),
        );
    }
    let allocator = failure.is_some_and(|f| f.stats.is_some())
        || samples.iter().any(|s| !s.allocator.is_empty());
    MemoryTable {
        points: [before, after, last],
        allocator,
        expandable_segments: expandable,
        notes,
    }
}

impl MemoryTable {
    /// Whether the table shows `ROWS[i]`: device rows only where an
    /// allocator was read (else a server without one gets rows of "—"), the
    /// host and cgroup rows always, the others where some moment has a value.
    pub fn shows(&self, i: usize) -> bool {
        match ROWS[i].shown {
            Shown::WithAllocator => self.allocator,
            Shown::Always => true,
            Shown::WhenRead => self.points.iter().any(|p| p.values[i].is_some()),
        }
    }

    /// The rows shown, with their index into `ROWS` (and each point's `values`).
    pub fn shown_rows(&self) -> impl Iterator<Item = (usize, &'static Row)> + '_ {
        ROWS.iter().enumerate().filter(|(i, _)| self.shows(*i))
    }
}

/// The pids that are this agent's own process(es), not "other processes".
fn own_pids(hello: &pb::Hello, events: &[&pb::Event]) -> Vec<u32> {
    let mut pids: Vec<u32> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::ChildStart(c)) => Some(c.pid),
            _ => None,
        })
        .collect();
    if hello.pid != 0 {
        pids.push(hello.pid);
    }
    pids
}

/// Where the model load began and ended.
struct LoadEdges {
    start_ns: Option<i64>,
    end_ns: Option<i64>,
    /// The first sample at or after the load's end.
    end_idx: Option<usize>,
    /// Allocated bytes when the load ended (the Phase event's reading).
    weights: Option<u64>,
    /// The load's error, when it failed.
    failed: Option<String>,
}

impl LoadEdges {
    fn find(samples: &[&pb::Sample], events: &[&pb::Event]) -> LoadEdges {
        let phase = |start: bool| {
            events.iter().find_map(|e| match &e.kind {
                Some(Kind::Phase(p)) if p.name == "load" && p.start == start => {
                    Some((e.time_ns, p))
                }
                _ => None,
            })
        };
        let start_ns = phase(true).map(|(t, _)| t);
        let end = phase(false).filter(|(t, _)| start_ns.is_none_or(|s| *t >= s));
        if let Some((t, p)) = end {
            if !p.error.is_empty() {
                return LoadEdges {
                    start_ns,
                    end_ns: None,
                    end_idx: None,
                    weights: None,
                    failed: Some(p.error.clone()),
                };
            }
            let weights = (p.allocated_bytes > 0).then_some(p.allocated_bytes);
            return LoadEdges {
                start_ns,
                end_ns: Some(t),
                end_idx: samples.iter().position(|s| s.time_ns >= t),
                weights,
                failed: None,
            };
        }
        // No load phase: the first sample that reports its weights is the
        // first one after the load.
        let end_idx = samples
            .iter()
            .position(|s| s.context.as_ref().is_some_and(|c| c.weight_bytes > 0));
        LoadEdges {
            start_ns,
            end_ns: end_idx.map(|i| samples[i].time_ns),
            end_idx,
            weights: None,
            failed: None,
        }
    }
}

struct Ctx<'a> {
    samples: &'a [&'a pb::Sample],
    events: &'a [&'a pb::Event],
    /// The device whose readings the table shows; None where unknown (the
    /// process's one device, or nothing where it reads several).
    device: Option<DeviceKey>,
    expandable: bool,
    own_pids: &'a [u32],
    load_end_weights: Option<u64>,
    load_end_ns: Option<i64>,
    /// Other processes' device bytes were read somewhere in the timeline: at
    /// a moment without that reading, driver used − reserved would count them
    /// as this process's non-PyTorch memory.
    others_seen: bool,
}

impl Ctx<'_> {
    fn point(
        &self,
        moment: Moment,
        title: &str,
        idx: Option<usize>,
        failure: Option<&pb::Failure>,
    ) -> Point {
        let mut values = [None; ROWS.len()];
        let sample = idx.map(|i| self.samples[i]);
        let time_ns = failure.map(|f| f.time_ns).or(sample.map(|s| s.time_ns));
        if sample.is_none() && failure.is_none() {
            return Point {
                moment,
                title: title.into(),
                time_ns: None,
                values,
            };
        }
        let stats = failure.and_then(|f| f.stats.as_ref()).or_else(|| {
            sample.and_then(|s| DeviceKey::allocator(self.device.as_ref(), &s.allocator))
        });
        let at = time_ns.unwrap_or(i64::MAX);
        let mut set = |key: &str, v: Option<u64>| {
            if let Some(i) = ROWS.iter().position(|r| r.key == key) {
                values[i] = v;
            }
        };

        let weights = self.weights_at(at);
        // At the failure, the failure's context; elsewhere the sample's.
        let kv = match failure {
            Some(f) => f.kv_cache_bytes,
            None => sample
                .and_then(|s| s.context.as_ref())
                .map(|c| c.kv_cache_bytes)
                .filter(|&b| b > 0),
        };
        let other_gpu = self.other_processes_at(idx, at, failure.is_some());
        if let Some(a) = stats {
            let live_parts = weights.unwrap_or(0).saturating_add(kv.unwrap_or(0));
            set("weights", weights);
            set("kv", kv);
            set(
                "other_live",
                Some(a.allocated_bytes.saturating_sub(live_parts)),
            );
            set("allocated", Some(a.allocated_bytes));
            set(
                "cached",
                Some(a.reserved_bytes.saturating_sub(a.allocated_bytes)),
            );
            set(
                "fragments",
                (!self.expandable).then_some(a.inactive_split_bytes),
            );
            set("reserved", Some(a.reserved_bytes));
            if a.driver_total_bytes > 0 && (other_gpu.is_some() || !self.others_seen) {
                let used = a.driver_total_bytes.saturating_sub(a.driver_free_bytes);
                let non_pytorch = used
                    .saturating_sub(a.reserved_bytes)
                    .saturating_sub(other_gpu.unwrap_or(0));
                set("non_pytorch", Some(non_pytorch));
            }
        } else {
            set("weights", weights);
            set("kv", kv);
        }
        set("other_processes", other_gpu);
        if let Some(s) = sample {
            set(
                "host_rss",
                s.process
                    .as_ref()
                    .map(|p| p.vm_rss_bytes)
                    .filter(|&b| b > 0),
            );
            set("cgroup_usage", s.cgroup.first().map(|c| c.usage_bytes));
            set("tree_rss", Some(s.tree_rss_bytes).filter(|&b| b > 0));
            set("tree_pss", Some(s.tree_pss_bytes).filter(|&b| b > 0));
            set(
                // vocab: a row's key
                "cgroup_limit",
                s.cgroup
                    .iter()
                    .map(|c| c.limit_bytes)
                    .filter(|&l| oomscope_analysis::is_finite_limit(l))
                    .min(),
            );
            set(
                "mem_available",
                s.system
                    .as_ref()
                    .filter(|m| m.mem_total_bytes > 0)
                    .map(|m| m.mem_available_bytes),
            );
        }
        Point {
            moment,
            title: title.into(),
            time_ns,
            values,
        }
    }

    /// Weights stay resident once loaded: the latest report at or before `at`.
    fn weights_at(&self, at: i64) -> Option<u64> {
        let reported = self
            .samples
            .iter()
            .take_while(|s| s.time_ns <= at)
            .filter_map(|s| {
                let c = s.context.as_ref()?;
                // During a load, the bytes loaded so far are the weights.
                Some(if c.weight_bytes > 0 {
                    c.weight_bytes
                } else {
                    c.loaded_bytes
                })
            })
            .filter(|&b| b > 0)
            .last();
        reported.or_else(|| {
            self.load_end_ns
                .filter(|&t| t <= at)
                .and(self.load_end_weights)
        })
    }

    /// Device bytes of other pids: from the newest NVML reading up to the
    /// sample (a request-boundary sample reads no NVML, so the periodic one
    /// before it stands), or (at a failure) from the process list taken then.
    fn other_processes_at(&self, idx: Option<usize>, at: i64, failing: bool) -> Option<u64> {
        let own = |pid: u32| self.own_pids.contains(&pid);
        let read = idx.and_then(|i| self.samples[..=i].iter().rev().find(|s| !s.gpus.is_empty()));
        if let Some(s) = read {
            let procs: Vec<&pb::GpuProcessUsage> = self
                .nvml_reading(&s.gpus)
                .into_iter()
                .flat_map(|g| g.processes.iter())
                .collect();
            if !procs.is_empty() {
                // One neighbour whose usage NVML cannot give makes the sum unknown.
                return procs
                    .iter()
                    .filter(|p| !own(p.pid))
                    .map(|p| p.used_bytes)
                    .sum();
            }
        }
        if !failing {
            return None;
        }
        // The list taken at the failure (a capture's NVML list lands at the
        // OOM's instant; a live agent's follows it within moments).
        const AFTER_FAILURE_NS: i64 = 5_000_000_000;
        let list = self
            .events
            .iter()
            .filter(|e| e.time_ns <= at.saturating_add(AFTER_FAILURE_NS))
            .filter_map(|e| match &e.kind {
                Some(Kind::ProcessList(p)) if !p.gpu.is_empty() => Some(p),
                _ => None,
            })
            .next_back()?;
        let on_device: Vec<&pb::GpuProcess> = match self.nvml_key() {
            Some(k) => list.gpu.iter().filter(|g| k.lists(g)).collect(),
            // An unknown device: the list stands only where it names one.
            None => {
                let first = &list.gpu[0];
                let one = list
                    .gpu
                    .iter()
                    .all(|g| g.device == first.device && g.device_uuid == first.device_uuid);
                match one {
                    true => list.gpu.iter().collect(),
                    false => Vec::new(),
                }
            }
        };
        if on_device.is_empty() {
            return None;
        }
        on_device
            .iter()
            .filter(|g| !own(g.pid))
            .map(|g| g.used_bytes)
            .sum()
    }

    /// The device key where it can find NVML's readings (by uuid or NVML's
    /// index; PyTorch's ordinal is not NVML's index).
    fn nvml_key(&self) -> Option<&DeviceKey> {
        self.device
            .as_ref()
            .filter(|k| k.uuid.is_some() || k.nvml_index.is_some())
    }

    /// The failing device's NVML reading among a sample's; for an unknown
    /// device, the one GPU the sample reads.
    fn nvml_reading<'g>(&self, gpus: &'g [pb::GpuDevice]) -> Option<&'g pb::GpuDevice> {
        match self.nvml_key() {
            Some(k) => gpus.iter().find(|g| k.reads(g)),
            None => match gpus {
                [one] => Some(one),
                _ => None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn sample(t: i64, alloc: u64, reserved: u64, rss: u64) -> pb::TimedSample {
        pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                process: Some(pb::ProcessMemory {
                    vm_rss_bytes: rss,
                    ..Default::default()
                }),
                allocator: vec![pb::AllocatorStats {
                    allocated_bytes: alloc,
                    reserved_bytes: reserved,
                    inactive_split_bytes: reserved - alloc,
                    driver_total_bytes: 10_000 * MIB,
                    driver_free_bytes: 10_000 * MIB - reserved - 500 * MIB - 300 * MIB,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn event(t: i64, kind: Kind) -> pb::TimedEvent {
        pb::TimedEvent {
            seq: 100 + t as u64,
            agent_id: String::new(),
            event: Some(pb::Event {
                time_ns: t,
                kind: Some(kind),
            }),
        }
    }

    fn phase(start: bool, allocated: u64) -> Kind {
        Kind::Phase(pb::Phase {
            name: "load".into(),
            start,
            allocated_bytes: allocated,
            ..Default::default()
        })
    }

    /// A server that loads 1 GiB of weights, serves, and fails at t=40, while
    /// pid 77 holds 300 MiB of the device (seen only in the failure's list).
    fn timeline() -> pb::TimelineResponse {
        pb::TimelineResponse {
            hello: Some(pb::Hello {
                pid: 10,
                ..Default::default()
            }),
            samples: vec![
                sample(5, 0, 0, 400 * MIB),
                sample(20, 1024 * MIB, 1100 * MIB, 900 * MIB),
                sample(30, 1500 * MIB, 2000 * MIB, 950 * MIB),
            ],
            events: vec![
                event(10, phase(true, 0)),
                event(20, phase(false, 1024 * MIB)),
                event(
                    40,
                    Kind::ProcessList(pb::ProcessList {
                        host_top_rss: vec![],
                        gpu: vec![
                            pb::GpuProcess {
                                pid: 10,
                                used_bytes: Some(2500 * MIB),
                                ..Default::default()
                            },
                            pb::GpuProcess {
                                pid: 77,
                                used_bytes: Some(300 * MIB),
                                ..Default::default()
                            },
                        ],
                    }),
                ),
            ],
            members: Vec::new(),
            ..Default::default()
        }
    }

    /// The diagnosis's failure for that timeline: a kill at t=40, no OOM.
    fn failure() -> pb::Failure {
        pb::Failure {
            time_ns: 40,
            kind: "signal".into(),
            ..Default::default()
        }
    }

    /// A `device_map="auto"` process reads GPU 0 (ordinal 0) and GPU 3
    /// (ordinal 1, NVML index 3) and fails on the second; its last sample
    /// before the failure is a request boundary's, which reads no NVML.
    fn two_device_timeline() -> pb::TimelineResponse {
        let stats = |ordinal: i32, uuid: &str, alloc: u64, reserved: u64| pb::AllocatorStats {
            device: ordinal,
            device_uuid: uuid.into(),
            allocated_bytes: alloc,
            reserved_bytes: reserved,
            driver_total_bytes: 10_000 * MIB,
            driver_free_bytes: 10_000 * MIB - reserved - 700 * MIB,
            ..Default::default()
        };
        let gpu = |index: i32, uuid: &str, neighbour: u64| pb::GpuDevice {
            index,
            uuid: uuid.into(),
            processes: vec![
                pb::GpuProcessUsage {
                    pid: 10,
                    used_bytes: Some(4000 * MIB),
                    ..Default::default()
                },
                pb::GpuProcessUsage {
                    pid: 77,
                    used_bytes: Some(neighbour),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let at = |t: i64, a: u64, b: u64, gpus: Vec<pb::GpuDevice>| pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                allocator: vec![
                    stats(0, "GPU-aaaa0000", a, a + 100 * MIB),
                    stats(1, "GPU-dddd3333", b, b + 200 * MIB),
                ],
                gpus,
                ..Default::default()
            }),
            ..Default::default()
        };
        pb::TimelineResponse {
            hello: Some(pb::Hello {
                pid: 10,
                ..Default::default()
            }),
            samples: vec![
                at(
                    20,
                    1000 * MIB,
                    3000 * MIB,
                    vec![
                        gpu(0, "GPU-aaaa0000", 100 * MIB),
                        gpu(3, "GPU-dddd3333", 600 * MIB),
                    ],
                ),
                at(30, 1100 * MIB, 3500 * MIB, Vec::new()),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn the_failing_devices_readings_not_the_first_devices() {
        let t = two_device_timeline();
        let fail = pb::Failure {
            time_ns: 40,
            kind: "oom".into(),
            oom_device: Some(1),
            ..Default::default()
        };
        let device = pb::FailedDevice {
            uuid: "GPU-dddd3333".into(),
            ordinal: Some(1),
            nvml_index: Some(3),
            ..Default::default()
        };
        let m = table(&t, Some(&fail), Some(&device));
        let at = &m.points[2];
        assert_eq!(
            at.get("allocated"),
            Some(3500 * MIB),
            "GPU 3's, not GPU 0's 1100 MiB"
        );
        assert_eq!(at.get("reserved"), Some(3700 * MIB));
        assert_eq!(
            at.get("other_processes"),
            Some(600 * MIB),
            "pid 77 on NVML GPU 3, read by the periodic sample before the boundary one"
        );
        // An older diagnosis without the joined device: PyTorch's ordinal
        // still picks the allocator; NVML's index is not that ordinal, so
        // with two GPUs in sight nobody's bytes are guessed.
        let m = table(&t, Some(&fail), None);
        assert_eq!(m.points[2].get("allocated"), Some(3500 * MIB));
        assert_eq!(m.points[2].get("other_processes"), None);
    }

    #[test]
    fn three_moments_from_load_phases() {
        let t = timeline();
        let m = table(&t, Some(&failure()), None);
        let [before, after, at] = &m.points;
        assert_eq!(before.time_ns, Some(5));
        assert_eq!(before.get("allocated"), Some(0));
        assert_eq!(before.get("weights"), None, "no weights before the load");
        assert_eq!(after.time_ns, Some(20));
        assert_eq!(
            after.get("weights"),
            Some(1024 * MIB),
            "the load's end reading"
        );
        assert_eq!(after.get("other_live"), Some(0));
        assert_eq!(at.title, "at failure");
        assert_eq!(at.time_ns, Some(40));
        assert_eq!(at.get("weights"), Some(1024 * MIB), "weights stay resident");
        assert_eq!(at.get("other_live"), Some(476 * MIB));
        assert_eq!(at.get("cached"), Some(500 * MIB));
        assert_eq!(at.get("fragments"), Some(500 * MIB));
        assert_eq!(at.get("host_rss"), Some(950 * MIB));
        assert_eq!(at.get("other_processes"), Some(300 * MIB));
        assert_eq!(
            at.get("non_pytorch"),
            Some(500 * MIB),
            "driver used − reserved − pid 77"
        );
        // Other processes were seen at the failure only: earlier, driver used
        // − reserved would blame their bytes on this process.
        assert_eq!(after.get("non_pytorch"), None);
        assert_eq!(at.get("cgroup_usage"), None);
    }

    #[test]
    fn a_failed_load_has_no_after_load_reading() {
        let mut t = timeline();
        t.events[1] = event(
            20,
            Kind::Phase(pb::Phase {
                name: "load".into(),
                start: false,
                error: "CUDA out of memory".into(),
                ..Default::default()
            }),
        );
        let m = table(&t, Some(&failure()), None);
        assert_eq!(m.points[1].time_ns, None);
        assert!(m.points[1].values.iter().all(Option::is_none));
        assert!(m.notes.iter().any(|n| n.contains("never finished")));
    }

    /// A llama.cpp-like server under `oomscope run`: no allocator, a process
    /// tree, a cgroup with a limit, the host's RAM; killed at t=40.
    fn host_only_timeline() -> pb::TimelineResponse {
        let reading = |t: i64, rss: u64| pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                process: Some(pb::ProcessMemory {
                    vm_rss_bytes: rss,
                    ..Default::default()
                }),
                tree_rss_bytes: rss + 300 * MIB,
                tree_pss_bytes: rss + 200 * MIB,
                cgroup: vec![pb::CgroupLevel {
                    path: "/llama".into(),
                    usage_bytes: rss + 400 * MIB,
                    limit_bytes: 4096 * MIB,
                    ..Default::default()
                }],
                system: Some(pb::SystemMemory {
                    mem_total_bytes: 16_384 * MIB,
                    mem_available_bytes: 9_000 * MIB - rss,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        pb::TimelineResponse {
            samples: vec![reading(5, 100 * MIB), reading(30, 3000 * MIB)],
            ..Default::default()
        }
    }

    #[test]
    fn a_server_without_an_allocator_shows_host_and_cgroup_rows() {
        let m = table(&host_only_timeline(), Some(&failure()), None);
        assert!(!m.allocator);
        let keys: Vec<&str> = m.shown_rows().map(|(_, r)| r.key).collect();
        assert_eq!(
            keys,
            [
                "host_rss",
                "tree_rss",
                "tree_pss",
                "cgroup_usage",
                "cgroup_limit",
                "mem_available"
            ]
        );
        let at = &m.points[2];
        assert_eq!(
            at.get("host_rss"),
            Some(3000 * MIB),
            "the last sample before the death"
        );
        assert_eq!(at.get("tree_pss"), Some(3200 * MIB));
        assert_eq!(at.get("cgroup_limit"), Some(4096 * MIB));
        assert_eq!(at.get("mem_available"), Some(6000 * MIB));

        // With an allocator, its rows come back; a timeline without a tree hides the tree's rows.
        let m = table(&timeline(), Some(&failure()), None);
        assert!(m.allocator);
        let keys: Vec<&str> = m.shown_rows().map(|(_, r)| r.key).collect();
        assert!(keys.contains(&"allocated") && keys.contains(&"host_rss"));
        assert!(!keys.contains(&"tree_rss"), "{keys:?}");
    }

    #[test]
    fn an_empty_timeline_gives_an_empty_table() {
        let m = table(&pb::TimelineResponse::default(), None, None);
        assert!(m
            .points
            .iter()
            .all(|p| p.time_ns.is_none() && p.values.iter().all(Option::is_none)));
    }
}
