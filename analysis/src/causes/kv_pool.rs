//! Verdicts for runtimes that preallocate their KV cache as one pool at
//! start-up (vLLM, SGLang, llama.cpp). Their memory does not grow with
//! tokens, so they fail differently from a server whose KV grows:
//!
//! - the reservation does not fit at start: the runtime's own text (see
//!   `oom_texts`), or the kernel kills the process filling the pool
//!   (`kv_reservation_kill`);
//! - a batch's activations outgrow the headroom left beside the pool
//!   (`activation_headroom`);
//! - another process takes memory after the pool was sized (`taken_after_profiling`);
//! - the pool is full and requests wait or are preempted: a capacity bound
//!   and a latency cause, not an OOM (`kv_pool_saturation`, with or without
//!   a failure).
//!
//! Each cause carries the figures a fix proposes a setting from
//! (`proposed_*` metrics); `fixes` names the runtime's own setting.

use std::collections::HashMap;

use super::{cause, non_pytorch};
use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::kv_pool_figures::{self, FIT_SHARE, GIB, KV_FULL_USAGE, MIN_FULL_READINGS, NEED_MARGIN};
use crate::pb;
use crate::settings::{Knob, Runtime};
use crate::units::{bytes, bytes_short, seconds, time};
use oomscope_proto::CauseKind;

/// Growers of another process's memory named in the evidence, at most.
const MAX_NAMED: usize = 5;

/// The kernel killed the process that fills the KV pool while the runtime
/// was starting (before any request), under a cgroup limit: the
/// reservation did not fit beside the rest of the server. What fits is
/// measured from the cgroup's usage before the final climb.
pub fn kv_reservation_kill(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let (kill_ns, k) = f.kernel?;
    if v.domain != Domain::Cgroup || !f.preallocated_kv() || !kv_on_host(f) {
        return None;
    }
    let e = f.evidence;
    if kv_pool_figures::served_before(e, kill_ns) || !holds_kv(e, k, kill_ns) {
        return None;
    }
    let runtime = f.runtime().map_or("the runtime", Runtime::name);
    let (series, level_limit) = kv_pool_figures::cgroup_series(e, &k.oom_memcg, kill_ns);
    let limit = [
        Some(k.memcg_limit_bytes),
        v.cgroup.as_ref().map(|c| c.limit_bytes),
        level_limit,
    ]
    .into_iter()
    .flatten()
    .find(|&l| crate::evidence::is_finite_limit(l))?;
    let mut evidence = vec![format!(
        "the kernel killed {} (pid {}) while {runtime} was starting, before any request: the process that fills the KV pool",
        if k.task.is_empty() { "the process" } else { k.task.as_str() },
        k.pid
    )];
    let mut metrics = vec![("limit_bytes", limit as f64)];
    let request = kv_pool_figures::kv_request(&f.settings);
    // The pool the runtime stated it made (vLLM's worker plugin reads its
    // own, in that member's samples): the size where no setting says it.
    let stated = std::iter::once(e)
        .chain(&e.members)
        .filter_map(kv_pool_figures::pool_bytes)
        .max();
    if let Some((s, b)) = request {
        evidence.push(format!(
            "{}={} asks for a KV pool of {}",
            s.name,
            f.settings.values.get(s.name).map_or("", String::as_str),
            bytes_short(b)
        ));
        metrics.push(("kv_pool_bytes", b as f64));
    } else if let Some(b) = stated {
        evidence.push(format!(
            "{runtime} stated a KV pool of {} before the kill",
            bytes_short(b)
        ));
        metrics.push(("kv_pool_bytes", b as f64));
    }
    let pool = request.map(|(_, b)| b).or(stated);
    match kv_pool_figures::final_climb(&series, pool) {
        Some(c) => {
            let warmup = kv_pool_figures::after_pool_allowance(c.rest_bytes);
            let room = limit as f64 - c.rest_bytes as f64 - warmup as f64;
            let proposed = kv_pool_figures::floor_to(room.max(0.0) * FIT_SHARE / GIB, 0.1) * GIB;
            evidence.push(format!(
                "the cgroup's usage climbed from {} to {} over the last {} samples before the kill ({}): the pool being filled",
                bytes_short(c.rest_bytes),
                bytes_short(c.top_bytes),
                c.steps,
                seconds(c.to_ns - c.from_ns)
            ));
            evidence.push(format!(
                "the rest of {runtime} held {} before that climb, and its warm-up after the pool takes about {} more, so {} of the {} limit is left for the KV pool",
                bytes(c.rest_bytes),
                bytes_short(warmup),
                bytes_short(room.max(0.0) as u64),
                bytes_short(limit)
            ));
            if let Some(b) = pool.filter(|b| c.rest_bytes + b > limit) {
                evidence.push(format!(
                    "{} + the {} pool = {}, over the {} limit",
                    bytes_short(c.rest_bytes),
                    bytes_short(b),
                    bytes_short(c.rest_bytes + b),
                    bytes_short(limit)
                ));
            }
            metrics.extend([
                ("rest_bytes", c.rest_bytes as f64),
                ("climb_bytes", (c.top_bytes - c.rest_bytes) as f64),
                ("kv_room_bytes", room.max(0.0)),
                ("proposed_kv_bytes", proposed.round()),
            ]);
        }
        None => evidence.push(
            "the samples did not catch the climb to the limit, so the room left for the pool is not measured (sample faster: `oomscope run --interval 100ms`)"
                .to_string(),
        ),
    }
    Some(cause(CauseKind::KvReservation, 0.96, evidence, &metrics))
}

/// The pool lives in host memory: vLLM's CPU backend (its variable is set,
/// or no GPU is in sight), or any preallocating runtime without a GPU.
fn kv_on_host(f: &Findings) -> bool {
    let cpu_variable = f.settings.values.contains_key("VLLM_CPU_KVCACHE_SPACE");
    (f.runtime() == Some(Runtime::Vllm) && cpu_variable) || !f.evidence.gpu_seen()
}

/// The victim fills the pool: a worker or scheduler by its title (vLLM's
/// `VLLM::Worker`, SGLang's scheduler), else the largest process of the
/// supervised tree, else the only process there is.
fn holds_kv(e: &crate::Evidence, k: &pb::KernelOomKill, kill_ns: i64) -> bool {
    let title = k.task.to_ascii_lowercase();
    // vocab: "worker" in a process title (vLLM's `VLLM::Worker`)
    if title.contains("worker") || title.contains("scheduler") {
        return true;
    }
    let tree = e
        .samples
        .iter()
        .rev()
        .filter(|s| s.time_ns <= kill_ns)
        .find(|s| !s.tree.is_empty());
    match tree {
        Some(s) => s
            .tree
            .iter()
            .max_by_key(|p| p.rss_bytes)
            .is_some_and(|p| p.pid == k.pid),
        None => e.child_exit().is_some_and(|(_, x)| x.pid == k.pid),
    }
}

/// The device figures at the failure: the allocator's, else PyTorch's text.
struct AtOom {
    time_ns: i64,
    allocated: u64,
    requested: u64,
    /// The device's use outside PyTorch's allocator (CUDA context, NCCL,
    /// graphs' private pools), where read.
    non_torch: Option<u64>,
    total: Option<u64>,
    context: pb::RequestContext,
    in_load: bool,
}

fn at_oom(f: &Findings) -> Option<AtOom> {
    if let Some(x) = &f.failure {
        // This process's own, never the device's use minus reserved (that
        // counts other processes too).
        let uuid = f.oom.map_or("", |(_, o)| o.device_uuid.as_str());
        let non_torch =
            non_pytorch::measure(f, &x.text, x.reserved_bytes, x.time_ns, uuid).map(|m| m.bytes);
        return Some(AtOom {
            time_ns: x.time_ns,
            allocated: x.allocated_bytes,
            requested: x.requested_bytes,
            non_torch,
            total: Some(x.limit_bytes).filter(|&l| l > 0),
            context: x.context.clone(),
            in_load: x.in_load,
        });
    }
    // A worker's OOM that only its stderr tells (the supervisor's view).
    let (t, exit) = f.exit?;
    let text = crate::torch_text::parse(&exit.stderr_tail);
    let allocated = text.allocated_bytes?;
    let reserved = allocated + text.reserved_unallocated_bytes.unwrap_or(0);
    Some(AtOom {
        time_ns: t,
        allocated,
        requested: text.requested_bytes?,
        non_torch: non_pytorch::measure(f, &text, reserved, t, "").map(|m| m.bytes),
        total: text.allowed_bytes.or(text.total_bytes),
        context: pb::RequestContext::default(),
        in_load: false,
    })
}

/// The weights' bytes, as the runtime or its Hello reported them.
fn weights_bytes(e: &crate::Evidence) -> Option<u64> {
    let from_context = e
        .samples
        .iter()
        .filter_map(|s| s.context.as_ref())
        .map(|c| c.weight_bytes.max(c.loaded_bytes))
        .max()
        .filter(|&w| w > 0);
    from_context.or_else(|| {
        let h = e.hello.as_ref()?;
        Some(h.models.iter().map(|m| m.bytes).sum::<u64>()).filter(|&w| w > 0)
    })
}

/// An activation peak outgrew the headroom left beside the pool: on a GPU,
/// at run time (not the start-up's reservation), with the pool fixed.
/// headroom = total − weights − KV pool − non-PyTorch memory, set against
/// what the batch at the failure needed.
pub fn activation_headroom(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::GpuVram {
        return None;
    }
    let e = f.evidence;
    let pool = kv_pool_figures::pool_bytes(e);
    if !f.preallocated_kv() && pool.is_none() {
        return None;
    }
    let at = at_oom(f)?;
    let running = batch_at(f, &at);
    if at.in_load || (!kv_pool_figures::served_before(e, at.time_ns) && running.0 == 0) {
        return None;
    }
    let total = Some(f.device_limit).filter(|&t| t > 0).or(at.total)?;
    let weights = weights_bytes(e);
    let (held, held_line) = match (weights, pool) {
        (Some(w), Some(p)) => (
            w + p,
            format!("weights {} − KV pool {}", bytes_short(w), bytes_short(p)),
        ),
        _ => {
            let idle = idle_allocated(f, at.time_ns)?;
            (
                pool.map_or(idle, |p| idle.max(p)),
                format!(
                    "the weights and the KV pool {} (allocated between requests)",
                    bytes_short(idle)
                ),
            )
        }
    };
    let non_torch = at.non_torch.unwrap_or(0);
    let headroom = total.saturating_sub(held + non_torch);
    let live_beyond = at.allocated.saturating_sub(held);
    let need = live_beyond + at.requested;
    let runtime = f.runtime().map_or("the runtime", Runtime::name);
    let mut evidence = vec![
        format!(
            "{runtime} keeps its KV pool reserved for the whole run; what is left beside it for activations is the device's {} − {held_line} − non-PyTorch {} = headroom {}",
            bytes_short(total),
            match at.non_torch {
                Some(n) => bytes_short(n),
                None => "(not read)".to_string(),
            },
            bytes(headroom)
        ),
        format!(
            "at the failure the activations needed {}: {} live beyond the weights and the pool, plus the failed allocation of {}",
            bytes(need),
            bytes_short(live_beyond),
            bytes_short(at.requested)
        ),
    ];
    let (sequences, tokens) = running;
    if sequences > 0 || tokens > 0 {
        evidence.push(format!(
            "the batch at the failure: {sequences} running sequences, {tokens} tokens"
        ));
    }
    evidence.push(format!(
        "the pool did not grow (it was reserved at start-up): this batch's activation peak outgrew the headroom {runtime} left beside it"
    ));
    let mut metrics = vec![
        ("total_bytes", total as f64),
        ("held_bytes", held as f64),
        ("headroom_bytes", headroom as f64),
        ("activation_peak_bytes", need as f64),
        ("requested_bytes", at.requested as f64),
        ("active_sequences", sequences as f64),
        ("batch_tokens", tokens as f64),
    ];
    // Unknown stays out, never 0.
    if let Some(n) = at.non_torch {
        metrics.push(("non_torch_bytes", n as f64));
    }
    if let Some(w) = weights {
        metrics.push(("weights_bytes", w as f64));
    }
    if let Some(p) = pool {
        metrics.push(("kv_pool_bytes", p as f64));
    }
    // A lower memory share shrinks the pool by the same bytes and leaves them
    // to activations; it cannot give more than the pool has.
    if let Some(now) = memory_fraction(f) {
        let deficit = need as f64 * (1.0 + NEED_MARGIN) - headroom as f64;
        let proposed = kv_pool_figures::floor_to(now - deficit.max(0.0) / total as f64, 0.01);
        let fits = pool.is_none_or(|p| deficit < p as f64) && proposed > 0.0;
        metrics.push(("memory_fraction", now));
        if fits {
            metrics.push(("proposed_memory_fraction", proposed));
        }
    }
    Some(cause(
        CauseKind::ActivationHeadroom,
        0.85,
        evidence,
        &metrics,
    ))
}

/// The memory share in force: the command line's, the plugin's resolved
/// value, else vLLM's default.
fn memory_fraction(f: &Findings) -> Option<f64> {
    let setting = f.settings.setting(Knob::MemoryFraction)?;
    f.settings
        .values
        .get(setting.name)
        .and_then(|v| v.parse().ok())
        .or_else(|| kv_pool_figures::resolved(f.evidence, setting).and_then(|v| v.parse().ok()))
        .or((f.runtime() == Some(Runtime::Vllm))
            .then_some(kv_pool_figures::VLLM_DEFAULT_GPU_MEMORY_UTILIZATION))
}

/// Sequences and tokens in the batch at the failure: its context, else the
/// last sample's before it.
fn batch_at(f: &Findings, at: &AtOom) -> (u64, u64) {
    let tokens = |c: &pb::RequestContext| c.active_tokens.max(c.batch_size);
    if at.context.active_sequences > 0 || tokens(&at.context) > 0 {
        return (at.context.active_sequences, tokens(&at.context));
    }
    f.evidence
        .samples
        .iter()
        .rev()
        .filter(|s| s.time_ns <= at.time_ns)
        .find_map(|s| s.context.as_ref())
        .map_or((0, 0), |c| (c.active_sequences, tokens(c)))
}

/// Allocated bytes at the last reading between requests before `t_ns`:
/// after start-up, the weights and the pool.
fn idle_allocated(f: &Findings, t_ns: i64) -> Option<u64> {
    f.timeline
        .device()
        .filter(|p| p.time_ns < t_ns && !p.in_request() && !p.is_load() && p.allocated > 0)
        .last()
        .map(|p| p.allocated)
}

/// One reading of who held the memory that ran out.
struct Holding {
    time_ns: i64,
    own: u64,
    others: u64,
    /// Other processes by pid (GPU only): bytes and command.
    by_pid: HashMap<u32, (u64, String)>,
}

/// Another process took memory after the runtime sized its pool: the pool
/// counted that memory as free. From the first reading at which the
/// runtime's own use had settled to the failure.
pub fn taken_after_profiling(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let e = f.evidence;
    if !f.preallocated_kv() && kv_pool_figures::pool_bytes(e).is_none() {
        return None;
    }
    let death = e.death_time()?;
    let (place, total, series) = match v.domain {
        Domain::GpuVram => gpu_holdings(f, death)?,
        Domain::HostRam => host_holdings(f, death)?,
        _ => return None,
    };
    let last = series.last()?;
    let settled = series
        .iter()
        .find(|r| r.own > 0 && r.own as f64 >= kv_pool_figures::PROFILED_SHARE * last.own as f64)?;
    let taken = last.others.saturating_sub(settled.others);
    if taken < kv_pool_figures::MIN_TAKEN_BYTES || settled.time_ns >= last.time_ns {
        return None;
    }
    let runtime = f.runtime().map_or("the runtime", Runtime::name);
    let mut evidence = vec![
        format!(
            "{runtime} sized its KV pool from the memory free at start-up; at {} its own use had settled ({}) and other processes held {} {place}",
            time(settled.time_ns),
            bytes_short(settled.own),
            bytes_short(settled.others)
        ),
        format!(
            "by the failure other processes held {}: they took {} after the pool was sized, memory the pool had counted on as free",
            bytes_short(last.others),
            bytes(taken)
        ),
    ];
    let mut growers: Vec<pb::CauseProcess> = last
        .by_pid
        .iter()
        .filter_map(|(&pid, (b, cmd))| {
            let before = settled.by_pid.get(&pid).map_or(0, |x| x.0);
            (*b > before).then(|| pb::CauseProcess {
                pid,
                bytes: b - before,
                user: None,
                command: Some(cmd.clone()).filter(|c| !c.is_empty()),
            })
        })
        .collect();
    growers.sort_by_key(|p| std::cmp::Reverse(p.bytes));
    growers.truncate(MAX_NAMED);
    for p in &growers {
        evidence.push(format!(
            "pid {}{} took {} {place} after the pool was sized",
            p.pid,
            p.command
                .as_ref()
                .map_or(String::new(), |c| format!(" ({c})")),
            bytes_short(p.bytes)
        ));
    }
    evidence.push(
        "another instance or process on the same memory: coordinate with its owner or give each its own device; never kill processes you do not own"
            .to_string(),
    );
    let mut c = cause(
        CauseKind::TakenAfterProfiling,
        0.8,
        evidence,
        &[
            ("taken_bytes", taken as f64),
            ("others_at_profile_bytes", settled.others as f64),
            ("others_at_failure_bytes", last.others as f64),
            ("own_bytes", last.own as f64),
            ("total_bytes", total as f64),
        ],
    );
    c.processes = growers;
    Some(c)
}

/// NVML's per-process use of the failing device, before the death; pids
/// that cannot be placed as this process's or another's count for neither.
fn gpu_holdings(f: &Findings, death: i64) -> Option<(String, u64, Vec<Holding>)> {
    let e = f.evidence;
    let dev = f.devices.failing()?;
    let commands: HashMap<u32, String> = e
        .process_list()
        .into_iter()
        .flat_map(|l| l.gpu.iter().map(|p| (p.pid, p.command.clone())))
        .collect();
    let mut total = 0;
    let series: Vec<Holding> = e
        .samples
        .iter()
        .filter(|s| s.time_ns <= death)
        .filter_map(|s| {
            let g = s
                .gpus
                .iter()
                .find(|g| dev.read_by(g) && !g.processes.is_empty())?;
            total = g.total_bytes;
            let reserved = s
                .allocator
                .iter()
                .find(|a| Some(a.device) == dev.ordinal)
                .map(|a| a.reserved_bytes);
            let mut h = Holding {
                time_ns: s.time_ns,
                own: 0,
                others: 0,
                by_pid: HashMap::new(),
            };
            for p in f.devices.reading_holders(e, g, reserved) {
                let Some(used) = p.used_bytes else { continue };
                if p.is_own() {
                    h.own += used;
                } else if p.is_other() {
                    h.others += used;
                    let command = commands.get(&p.pid).cloned().unwrap_or_default();
                    h.by_pid.insert(p.pid, (used, command));
                }
            }
            Some(h)
        })
        .collect();
    (!series.is_empty()).then_some((dev.place(), total, series))
}

/// Host RAM held by others: MemTotal − MemAvailable − the supervised tree's RSS.
fn host_holdings(f: &Findings, death: i64) -> Option<(String, u64, Vec<Holding>)> {
    let mut total = 0;
    let series: Vec<Holding> = f
        .evidence
        .samples
        .iter()
        .filter(|s| s.time_ns < death && s.tree_rss_bytes > 0)
        .filter_map(|s| {
            let m = s.system.as_ref().filter(|m| m.mem_total_bytes > 0)?;
            total = m.mem_total_bytes;
            Some(Holding {
                time_ns: s.time_ns,
                own: s.tree_rss_bytes,
                others: m
                    .mem_total_bytes
                    .saturating_sub(m.mem_available_bytes)
                    .saturating_sub(s.tree_rss_bytes),
                by_pid: HashMap::new(),
            })
        })
        .collect();
    (!series.is_empty()).then_some(("of host RAM".to_string(), total, series))
}

/// The pool was full with requests waiting (and, where counted, preempted):
/// a capacity bound and a latency cause, not an OOM. Read from the runtime's
/// own context (the vLLM plugin's `kv_cache_usage`, `queued`,
/// `preemptions`), with or without a failure. A full pool that kept every
/// request it was given running (nothing waited, nothing was preempted)
/// bounded nothing: it is no cause and gets no fix (`full_without_pressure`
/// states it as a fact).
pub fn kv_pool_saturation(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let e = f.evidence;
    let readings = kv_pool_figures::readings(e);
    let preempted = kv_pool_figures::preemptions_at(&readings);
    // Full while something waited or was preempted since the reading before.
    let full: Vec<&kv_pool_figures::PoolReading> = readings
        .iter()
        .zip(&preempted)
        .filter(|(r, p)| r.usage >= KV_FULL_USAGE && (r.waiting > 0 || **p > 0.0))
        .map(|(r, _)| r)
        .collect();
    let preemptions: f64 = preempted.iter().sum();
    let peak_usage = readings.iter().map(|r| r.usage).fold(0.0, f64::max);
    // A preemption is itself the proof of a full pool (the scheduler
    // preempts only when no block is free), though the gauge may have missed it.
    let preempted_full = preemptions > 0.0 && peak_usage >= KV_FULL_USAGE;
    if full.len() < MIN_FULL_READINGS && !preempted_full {
        return None;
    }
    let runtime = f.runtime().map_or("the runtime", Runtime::name);
    let waiting = full.iter().map(|r| r.waiting).max().unwrap_or(0);
    let mut running: Vec<u64> = full.iter().map(|r| r.running).collect();
    running.sort_unstable();
    let running_at_full = running.get(running.len() / 2).copied().unwrap_or(0);
    let span = match (full.first(), full.last()) {
        (Some(a), Some(b)) => b.time_ns - a.time_ns,
        _ => 0,
    };
    let mut evidence = vec![format!(
        "{runtime}'s KV pool was {:.0}% full with up to {waiting} requests waiting ({running_at_full} running) in {} readings over {}",
        peak_usage * 100.0,
        full.len(),
        seconds(span)
    )];
    if preemptions > 0.0 {
        evidence.push(format!(
            "{} preemptions in the window: {runtime} evicted running requests to free KV blocks and will recompute them",
            kv_pool_figures::number(preemptions)
        ));
    }
    let mut metrics = vec![
        ("kv_cache_usage", peak_usage),
        ("waiting", waiting as f64),
        ("running", running_at_full as f64),
        ("preemptions", preemptions),
        ("full_readings", full.len() as f64),
        ("full_seconds", span as f64 / 1e9),
    ];
    if let Some(p) = kv_pool_figures::pool_bytes(e) {
        metrics.push(("kv_pool_bytes", p as f64));
        let per_sequence = p as f64 / running_at_full.max(1) as f64;
        evidence.push(format!(
            "the pool of {} held {running_at_full} running sequences: about {} each at this load",
            bytes_short(p),
            bytes_short(per_sequence as u64)
        ));
    }
    let blocks = kv_pool_figures::reported(e, "vllm.num_gpu_blocks");
    let block_size = kv_pool_figures::reported(e, "vllm.block_size");
    if let (Some(b), Some(s)) = (blocks, block_size) {
        metrics.push(("kv_pool_tokens", b * s));
    }
    let cap = f
        .settings
        .setting(Knob::MaxSequences)
        .and_then(|s| {
            f.settings
                .values
                .get(s.name)
                .cloned()
                .or_else(|| kv_pool_figures::resolved(e, s))
        })
        .and_then(|v| v.parse::<f64>().ok());
    if let Some(cap) = cap {
        metrics.push(("max_sequences", cap));
        if (running_at_full as f64) < cap {
            evidence.push(format!(
                "KV-bound: {running_at_full} sequences ran of the {} the sequence cap allows, so the pool, not the cap, set the concurrency",
                kv_pool_figures::number(cap)
            ));
        }
    }
    if running_at_full > 0 {
        metrics.push(("proposed_max_sequences", running_at_full as f64));
    }
    evidence.push(if v.failed {
        "a full pool is a capacity bound, not an out-of-memory failure by itself: requests queue and preempted ones are recomputed".to_string()
    } else {
        "not an out-of-memory failure: nothing failed; a full pool makes requests wait (a capacity bound and a latency cause)".to_string()
    });
    // Beside a failure it is the lesser story.
    let confidence = if v.failed { 0.4 } else { 0.7 };
    Some(cause(
        CauseKind::KvPoolSaturation,
        confidence,
        evidence,
        &metrics,
    ))
}

/// "KV pool full (usage 100 %) with nothing waiting or preempted: ..." where
/// the pool was full in at least MIN_FULL_READINGS readings yet no request
/// waited and none was preempted: a fact for the diagnosis's evidence (the
/// load fitted), not a cause.
pub fn full_without_pressure(f: &Findings) -> Option<String> {
    let readings = kv_pool_figures::readings(f.evidence);
    let full: Vec<&kv_pool_figures::PoolReading> = readings
        .iter()
        .filter(|r| r.usage >= KV_FULL_USAGE)
        .collect();
    let preempted: f64 = kv_pool_figures::preemptions_at(&readings).iter().sum();
    if full.len() < MIN_FULL_READINGS || preempted > 0.0 || full.iter().any(|r| r.waiting > 0) {
        return None;
    }
    let runtime = f.runtime().map_or("the runtime", Runtime::name);
    let usage = full.iter().map(|r| r.usage).fold(0.0, f64::max);
    let running = full.iter().map(|r| r.running).max().unwrap_or(0);
    Some(format!(
        "KV pool full (usage {:.0} %) with nothing waiting or preempted: {runtime} ran every request it was given ({running} at most at once, in {} full readings), so the pool bounded nothing and no capacity change follows",
        usage * 100.0,
        full.len()
    ))
}
