//! The device allocator at the failed allocation: what was asked, what was
//! live, what was cached, and the limit it ran into. Each number comes from
//! the best source at hand: the snapshot taken at the OOM, then the error
//! text (written at the failure), then the allocator stats the event carries
//! (which a replay takes from the last sample before the failure).
//!
//! `Failure` (the diagnosis's `failure`) is the incident's side of it: the
//! facts a report shows, read once here so that no client reads them again.

use crate::devices::Devices;
use crate::evidence::Evidence;
use crate::pb;
use crate::pb::event::Kind;
use crate::settings::ENV_LABEL_PREFIX;
use crate::timeline::Timeline;
use crate::torch_text::{self, TorchOomText};

#[derive(Clone, Debug, Default)]
pub struct AtFailure {
    pub time_ns: i64,
    pub requested_bytes: u64,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub largest_free_block_bytes: Option<u64>,
    pub inactive_split_bytes: u64,
    pub alloc_retries: u64,
    pub expandable_segments: bool,
    /// Free space in private pools (CUDA graphs, MemPool), from the
    /// snapshot: reserved but held for the pool's owner.
    pub private_pool_free_bytes: u64,
    /// The allocator was `backend:cudaMallocAsync`: it keeps no segment,
    /// split, retry or device-allocation counters, so theirs read 0 for
    /// unknown (`inactive_split_bytes`, `alloc_retries` among them).
    pub cuda_malloc_async: bool,
    /// The per-process cap, else the device total; 0 when unknown.
    pub limit_bytes: u64,
    /// "a per-process cap of ..." or "the device total".
    pub limit_source: &'static str,
    pub context: pb::RequestContext,
    /// The failure came while loading weights.
    pub in_load: bool,
    pub text: TorchOomText,
    /// Read from PyTorch's text on the exit's stderr alone (`oomscope run`
    /// without an in-process agent): no allocator event stands behind it.
    pub from_text: bool,
}

impl AtFailure {
    pub fn reserved_unallocated_bytes(&self) -> u64 {
        self.reserved_bytes.saturating_sub(self.allocated_bytes)
    }

    pub fn from_evidence(
        e: &Evidence,
        oom: Option<(i64, &pb::Oom)>,
        tl: &Timeline,
        devices: &Devices,
    ) -> Option<AtFailure> {
        let Some((time_ns, oom)) = oom else {
            return from_stderr(e, tl, devices);
        };
        let text = torch_text::parse(&oom.error_text);
        let stats = oom.stats.clone().unwrap_or_default();
        let snap = oom.snapshot.as_ref().filter(|s| s.reserved_bytes > 0);
        let (allocated_bytes, reserved_bytes) = match (snap, text.allocated_bytes) {
            (Some(s), _) => (s.allocated_bytes, s.reserved_bytes),
            (None, Some(a)) => match text.reserved_unallocated_bytes {
                Some(r) => (a, a + r),
                // cudaMallocAsync's text leaves the pool's reserved bytes
                // out: the stats of the same failure have them.
                None => (a, stats.reserved_bytes.max(a)),
            },
            (None, None) => (stats.allocated_bytes, stats.reserved_bytes),
        };
        let requested_bytes = [
            oom.requested_bytes,
            oom.observer.as_ref().map_or(0, |o| o.alloc.max(0) as u64),
            text.requested_bytes.unwrap_or(0),
        ]
        .into_iter()
        .find(|&b| b > 0)
        .unwrap_or(0);
        let settings = |s: Option<&pb::AllocatorSettings>| s.is_some_and(|s| s.expandable_segments);
        let expandable_segments = snap.is_some_and(|s| s.expandable_segments)
            || settings(oom.snapshot.as_ref().and_then(|s| s.settings.as_ref()))
            || settings(e.hello.as_ref().and_then(|h| h.allocator_settings.as_ref()));
        let (limit_bytes, limit_source) = limit(devices, oom, &text);
        let in_load = in_load(e, time_ns, tl);
        let cuda_malloc_async = cuda_malloc_async(e, oom, &text);
        Some(AtFailure {
            time_ns,
            requested_bytes,
            allocated_bytes,
            reserved_bytes,
            largest_free_block_bytes: snap.map(|s| s.largest_free_block_bytes),
            inactive_split_bytes: stats.inactive_split_bytes,
            alloc_retries: stats.num_alloc_retries,
            expandable_segments,
            private_pool_free_bytes: snap.map_or(0, |s| s.private_pool_free_bytes),
            cuda_malloc_async,
            limit_bytes,
            limit_source,
            context: oom.context.clone().unwrap_or_default(),
            in_load,
            text,
            from_text: false,
        })
    }
}

/// The backend named in PyTorch's words.
const CUDA_MALLOC_ASYNC: &str = "cudaMallocAsync";

/// The failing allocator was `backend:cudaMallocAsync`: its message says so,
/// the settings name it (the agent's, a snapshot's, the recorded
/// PYTORCH_CUDA_ALLOC_CONF), or the failure's stats are a memory_stats()
/// with bytes reserved and neither a segment nor a device allocation
/// counted: that backend counts neither, while the native allocator counts
/// its device allocations (under expandable segments its segments read 0
/// too, as on the H200 capture).
fn cuda_malloc_async(e: &Evidence, oom: &pb::Oom, text: &TorchOomText) -> bool {
    let names = |s: Option<&pb::AllocatorSettings>| {
        s.is_some_and(|s| {
            s.backend == CUDA_MALLOC_ASYNC || s.alloc_conf.contains(CUDA_MALLOC_ASYNC)
        })
    };
    let hello = e.hello.as_ref();
    let recorded_conf = hello
        .and_then(|h| {
            h.labels
                .get(&format!("{ENV_LABEL_PREFIX}PYTORCH_CUDA_ALLOC_CONF"))
        })
        .is_some_and(|c| c.contains(CUDA_MALLOC_ASYNC));
    let segmentless = oom.stats.as_ref().is_some_and(|s| {
        s.reserved_bytes > 0
            && s.raw.get("segment.all.current") == Some(&0)
            && s.raw.get("num_device_alloc") == Some(&0)
    });
    text.cuda_malloc_async
        || names(hello.and_then(|h| h.allocator_settings.as_ref()))
        || names(oom.snapshot.as_ref().and_then(|s| s.settings.as_ref()))
        || recorded_conf
        || segmentless
}

/// The failure as PyTorch's text on the exit's stderr tells it, where no
/// OOM event does: `oomscope run` sees a worker's crash only there. Only a
/// text that says what was asked and what PyTorch had allocated stands for it.
fn from_stderr(e: &Evidence, tl: &Timeline, devices: &Devices) -> Option<AtFailure> {
    let (time_ns, exit) = e.child_exit()?;
    let text = torch_text::parse(&exit.stderr_tail);
    let (requested_bytes, allocated_bytes) = (text.requested_bytes?, text.allocated_bytes?);
    let reserved_bytes = allocated_bytes + text.reserved_unallocated_bytes.unwrap_or(0);
    let (limit_bytes, limit_source) = limit(devices, &pb::Oom::default(), &text);
    let cuda_malloc_async = cuda_malloc_async(e, &pb::Oom::default(), &text);
    Some(AtFailure {
        time_ns,
        requested_bytes,
        allocated_bytes,
        reserved_bytes,
        largest_free_block_bytes: None,
        inactive_split_bytes: 0,
        alloc_retries: 0,
        expandable_segments: e
            .hello
            .as_ref()
            .and_then(|h| h.allocator_settings.as_ref())
            .is_some_and(|s| s.expandable_segments),
        limit_bytes,
        limit_source,
        context: pb::RequestContext::default(),
        in_load: in_load(e, time_ns, tl),
        text,
        from_text: true,
        cuda_malloc_async,
        private_pool_free_bytes: 0,
    })
}

/// The limit the process ran into on the failing device: a per-process cap
/// (announced, or "X allowed" in the text), else the device's own total (a
/// MIG instance's, not its parent's). The observer's `device_allocated` is
/// the cap or the total as CUDA sees the device, so it serves for either.
/// Never another GPU's figures.
fn limit(devices: &Devices, oom: &pb::Oom, text: &TorchOomText) -> (u64, &'static str) {
    let device = devices.failing();
    if let Some(cap) = device.and_then(|d| d.cap_bytes) {
        return (cap, "the per-process cap");
    }
    if let Some(cap) = text.allowed_bytes {
        return (cap, "the per-process cap");
    }
    if let Some(b) = oom
        .observer
        .as_ref()
        .map(|o| o.device_allocated)
        .filter(|&b| b > 0)
    {
        return (b as u64, "the device's limit");
    }
    if let Some((total, what)) = device.and_then(|d| d.limit()) {
        return (total, what);
    }
    let total = text
        .total_bytes
        .or_else(|| {
            oom.stats
                .as_ref()
                .map(|s| s.driver_total_bytes)
                .filter(|&t| t > 0)
        })
        .unwrap_or(0);
    (total, "the device total")
}

/// Loading when it failed: a load phase began and had not ended, or the last
/// sample before the failure was in a load phase.
fn in_load(e: &Evidence, time_ns: i64, tl: &Timeline) -> bool {
    let mut open = false;
    for ev in e.events.iter().filter(|ev| ev.time_ns <= time_ns) {
        if let Some(Kind::Phase(p)) = &ev.kind {
            if p.name.starts_with("load") {
                // An end with the failure's error is the failure closing the load.
                open = p.start || !p.error.is_empty();
            }
        }
    }
    let last_sample_loading = tl
        .points
        .iter()
        .rev()
        .find(|p| p.time_ns <= time_ns)
        .is_some_and(|p| p.is_load());
    open || last_sample_loading
}

/// The facts of the failure the incident names, as a diagnosis carries them;
/// None without an incident. The OOM and the exit are the ones the analysis
/// judged (nearest the incident); the context and the allocator's last
/// reading come from the samples strictly before it, since one stamped at its
/// very instant may have been taken just after it.
pub fn of_incident(e: &Evidence) -> Option<pb::Failure> {
    let incident = e.incident.as_ref()?;
    let oom = e.oom().map(|(_, o)| o);
    // Only the exit that raised the incident speaks for it.
    let exit = e
        .child_exit()
        .filter(|(t, _)| *t == incident.time_ns)
        .map(|(_, x)| x);
    let before: Vec<&pb::Sample> = e
        .samples
        .iter()
        .filter(|s| s.time_ns < incident.time_ns)
        .collect();
    let context = oom
        .and_then(|o| o.context.as_ref())
        .or_else(|| before.iter().rev().find_map(|s| s.context.as_ref()));
    let stats = oom.and_then(|o| o.stats.clone());
    let stats_from_ns = stats.as_ref().and_then(|stats| {
        let last = before.last()?;
        last.allocator
            .iter()
            .any(|a| a == stats)
            .then_some(last.time_ns)
    });
    let nonzero = |v: u64| (v > 0).then_some(v);
    let text = |t: &str| (!t.is_empty()).then(|| t.to_string());
    Some(pb::Failure {
        time_ns: incident.time_ns,
        kind: incident.kind.clone(),
        // The event's, else its text's (cudaMallocAsync's "Requested : …",
        // where no observer could attach).
        requested_bytes: oom.and_then(|o| {
            nonzero(o.requested_bytes).or_else(|| {
                torch_text::parse(&o.error_text)
                    .requested_bytes
                    .and_then(nonzero)
            })
        }),
        phase: context.and_then(|c| text(&c.phase)),
        active_tokens: context.and_then(|c| nonzero(c.active_tokens)),
        active_sequences: context.and_then(|c| nonzero(c.active_sequences)),
        requests_done: context.and_then(|c| nonzero(c.requests_done)),
        kv_cache_bytes: context.and_then(|c| nonzero(c.kv_cache_bytes)),
        error_text: oom
            .and_then(|o| text(&o.error_text))
            .or_else(|| exit.and_then(|x| text(&x.stderr_tail))),
        oom_device: oom.map(|o| o.device),
        stats,
        stats_from_ns,
        expandable_segments: oom
            .and_then(|o| o.snapshot.as_ref())
            .is_some_and(|s| s.expandable_segments),
    })
}
