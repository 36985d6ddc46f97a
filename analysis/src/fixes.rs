//! Fixes: what to change, least risky first, each with how to retest it on
//! the same failing workload. One variable at a time; never "kill unknown
//! processes"; never an unbounded restart.

use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::pb;
use crate::runtime_kind::{self, Allocator, RuntimeKind};
use crate::setting_fixes::{self, load_knobs, with_knobs};
use crate::settings::Knob;
use crate::units::bytes_short;
use oomscope_proto::CauseKind;

fn fix(
    action: impl Into<String>,
    risk: &str,
    retest: impl Into<String>,
    caveat: Option<&str>,
) -> pb::Fix {
    pb::Fix {
        action: action.into(),
        risk: risk.to_string(),
        retest: retest.into(),
        caveat: caveat.map(str::to_string),
    }
}

fn risk_rank(risk: &str) -> u8 {
    match risk {
        "low" => 0,
        "medium" => 1,
        _ => 2,
    }
}

fn metric(c: &pb::Cause, name: &str) -> u64 {
    c.metrics.get(name).copied().unwrap_or(0.0).max(0.0) as u64
}

const SAME_WORKLOAD: &str =
    "rerun the same failing workload (same requests, same concurrency) and compare";

/// Fixes for the causes found (most likely cause first), then for the domain
/// where no cause gave any; ranked least risky first, duplicates dropped.
pub fn rank(f: &Findings, v: &DomainVerdict, causes: &[pb::Cause]) -> Vec<pb::Fix> {
    let mut fixes: Vec<pb::Fix> = causes
        .iter()
        .flat_map(|c| {
            setting_fixes::for_cause(c, f)
                .into_iter()
                .chain(runtime_fix(c, f))
                .chain(for_cause(c, f))
        })
        .collect();
    if fixes.is_empty() && v.failed {
        fixes = for_domain(v.domain, f);
    }
    if f.exit.is_some_and(|(_, x)| x.crash_loop || x.attempt > 0) {
        fixes.push(fix(
            "Keep restarts bounded with backoff (`oomscope run --restart N`) and fix the cause before raising N",
            "low",
            "the same failure recurs on each restart until the cause is fixed; count restarts per hour",
            Some("restarting in a loop hides the cause and can take neighbours down with it"),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    fixes.retain(|x| seen.insert(x.action.clone()));
    // Stable: within a risk, the most likely cause's fixes come first; more capacity comes last of all.
    fixes.sort_by_key(|x| (x.action.starts_with(MORE_CAPACITY), risk_rank(&x.risk)));
    fixes
}

/// Actions that buy hardware start with this; they rank after every other fix.
const MORE_CAPACITY: &str = "More capacity:";

const ONE_REQUEST: &str = "one passing request does not prove capacity: retest at the peak concurrency and the longest context expected";
const EMPTY_CACHE: &str = "empty_cache is not a capacity plan: it returns cached blocks, not live tensors, and the cache refills";
const POOL_EMPTY_CACHE: &str = "TrackingPool::empty_cache() is not a capacity plan: it returns cached segments, not live blocks, and the cache refills";

/// The caveat that emptying the allocator's cache is no plan, in its words;
/// none where no device allocator ran.
fn empty_cache_caveat(rk: &RuntimeKind) -> Option<&'static str> {
    match rk.allocator {
        Allocator::TrackingPool => Some(POOL_EMPTY_CACHE),
        _ if rk.torch_allocator() => Some(EMPTY_CACHE),
        _ => None,
    }
}

/// A host leak's first fix: find what holds the bytes, with the tools of
/// the process's language.
fn host_holder_fix(rk: &RuntimeKind, retest: String) -> pb::Fix {
    if rk.python_tools() {
        fix(
            "Find what the process keeps on the host: a heap census by type, tracemalloc, growing caches or queues",
            "low",
            retest,
            None,
        )
    } else {
        fix(
            "Find the collection that grows with each request (a map keyed by request, a cache without a bound, a Vec that is only pushed to) and bound it (an LRU with a capacity) or clear it when the request ends; to name the holder, profile the heap: `heaptrack <binary>` or dhat (`dhat::Profiler` in a test build) gives the allocation site of what stays",
            "low",
            retest,
            None,
        )
    }
}
const RESTART_BOUNDED: &str = "containment, not a fix: keep restarts bounded (`oomscope run --restart N`), never an unbounded auto-restart loop";
const QUALITY: &str =
    "quality re-evaluation required: rerun the model's accuracy suite at the new precision";

fn gpu_timeline_fixes(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    let rk = runtime_kind::of(f.evidence);
    match c.kind.parse() {
        Ok(CauseKind::KvGrowth) => {
            let cap = crate::capacity::estimate(f.evidence, &f.timeline, f.failure.as_ref());
            let (seqs, tokens) = cap.as_ref().map_or((String::new(), String::new()), |c| {
                (format!(" (estimated safe: {})", c.safe_sequences), format!(" (estimated safe: {})", c.safe_active_tokens))
            });
            vec![
                fix(
                    with_knobs(f, &format!("Cap active sequences{seqs} and total active tokens{tokens}, with a bounded admission queue in front"), &[Knob::MaxSequences, Knob::MaxBatchTokens]),
                    "low",
                    format!("{SAME_WORKLOAD} live bytes at the cap, then step concurrency up to the expected peak"),
                    Some(ONE_REQUEST),
                ),
                fix(
                    with_knobs(f, "Shorten the max context (or retrieve less text per prompt)", &[Knob::MaxContext]),
                    "low",
                    format!("{SAME_WORKLOAD} bytes_per_token × the new max context"),
                    None,
                ),
                fix(
                    with_knobs(f, "Lower the batch size (or max batched tokens)", &[Knob::MaxBatchTokens]),
                    "low",
                    format!("{SAME_WORKLOAD} the peak live bytes"),
                    None,
                ),
                fix(
                    "Serve fewer resident models on this GPU",
                    "medium",
                    format!("{SAME_WORKLOAD} the fixed bytes left for the KV cache"),
                    None,
                ),
                fix(
                    with_knobs(f, "Store the KV cache at lower precision (FP8) or quantize it", &[Knob::KvCacheDtype]),
                    "medium",
                    format!("{SAME_WORKLOAD} bytes_per_token: it should halve"),
                    Some(QUALITY),
                ),
                fix(
                    format!("{MORE_CAPACITY} a GPU with more memory, or tensor parallelism across GPUs"),
                    "high",
                    "rerun the same failing workload on the new placement",
                    Some(ONE_REQUEST),
                ),
            ]
        }
        Ok(CauseKind::Fragmentation) if rk.allocator == Allocator::TrackingPool => pool_fragmentation_fixes(&rk),
        Ok(CauseKind::Fragmentation) => {
            let expandable = c.metrics.get("expandable_segments").is_some_and(|v| *v > 0.0);
            let async_pool = c.metrics.get("cuda_malloc_async").is_some_and(|v| *v > 0.0);
            let mut v = Vec::new();
            if async_pool {
                v.push(fix(
                    "backend:cudaMallocAsync ignores expandable_segments and max_split_size_mb: trim its pool before the large allocations (torch.cuda.empty_cache() trims it to nothing), or switch to the native backend with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                    "low",
                    format!("{SAME_WORKLOAD} the pool's reserved − allocated at the failure"),
                    Some("retest: the native backend divides memory differently"),
                ));
            } else if expandable {
                v.push(fix(
                    "expandable_segments is already on and the failure remains: set max_split_size_mb (e.g. 128) so large blocks are not split",
                    "low",
                    format!("{SAME_WORKLOAD} reserved − allocated at the failure"),
                    Some("retest: expandable_segments did not cure this workload"),
                ));
            } else {
                v.push(fix(
                    "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                    "low",
                    format!("{SAME_WORKLOAD} reserved − allocated at the failure: it is not a cure everywhere, so retest"),
                    None,
                ));
                v.push(fix(
                    "Set max_split_size_mb (e.g. 128) so large blocks are not split",
                    "low",
                    format!("{SAME_WORKLOAD} inactive_split and reserved − allocated at the failure"),
                    None,
                ));
            }
            v.push(fix(
                "Allocate fewer distinct sizes: pad or bucket shapes, preallocate long-lived buffers first",
                "medium",
                format!("{SAME_WORKLOAD} the largest free block at the failure"),
                None,
            ));
            v.push(fix(
                "Restart the worker periodically to reset the fragmented cache",
                "medium",
                "rerun the same workload and count restarts",
                Some(RESTART_BOUNDED),
            ));
            v.push(fix(
                format!("{MORE_CAPACITY} a larger per-process cap or GPU"),
                "high",
                "rerun the same failing workload",
                empty_cache_caveat(&rk),
            ));
            v
        }
        Ok(CauseKind::Leak) => vec![
            {
                let retest = format!("{SAME_WORKLOAD} bytes_per_request between requests: it must fall to 0");
                match rk.allocator {
                    Allocator::TrackingPool => fix(
                        "Find the owner of the retained blocks: the pool's live blocks by tag and allocation site (`TrackingPool::snapshot()`, or `oomscope snapshot`); drop each request's `TrackedSlice`s (its KV blocks, `Tag::Request(id)`) when the request ends",
                        "low",
                        retest,
                        empty_cache_caveat(&rk),
                    ),
                    _ if !rk.gpu => host_holder_fix(&rk, retest),
                    _ => fix(
                        "Find the owner of the retained bytes: allocation sites of live blocks (snapshot) and the retained Python type (heap census); drop references after each request",
                        "low",
                        retest,
                        empty_cache_caveat(&rk),
                    ),
                }
            },
            fix(
                format!(
                    "Until it is fixed, restart the worker before the limit (about {} requests at this rate)",
                    metric(c, "requests_to_limit")
                ),
                "medium",
                "rerun the same workload and confirm the restart comes before the limit",
                Some(RESTART_BOUNDED),
            ),
        ],
        // Python's cycle collector: nothing of it in another language.
        Ok(CauseKind::GcRetained) if !rk.python_tools() => Vec::new(),
        Ok(CauseKind::GcRetained) => vec![
            fix(
                "Break the reference cycles that hold tensors (or call gc.collect() between requests)",
                "low",
                format!("{SAME_WORKLOAD} live bytes between requests without the collection"),
                Some("not a leak: the bytes come back at a collection"),
            ),
            fix(
                "Lower the cycle collector's thresholds (gc.set_threshold) so it runs before the garbage reaches the limit",
                "low",
                format!("{SAME_WORKLOAD} the peak live bytes between collections"),
                None,
            ),
        ],
        Ok(CauseKind::CacheRetention) => vec![fix(
            if rk.allocator == Allocator::TrackingPool {
                "Nothing to fix for this process; if other processes share the GPU, call `TrackingPool::empty_cache()` when the server idles so they can have the cached segments"
            } else {
                "Nothing to fix for this process; if other processes share the GPU, give each a per-process cap (torch.cuda.set_per_process_memory_fraction) or set garbage_collection_threshold"
            },
            "low",
            format!("{SAME_WORKLOAD} reserved bytes at the plateau"),
            empty_cache_caveat(&rk),
        )],
        Ok(CauseKind::WeightsTooLarge) => vec![
            fix(
                "Load fewer resident models on this GPU, or a smaller model",
                "medium",
                "rerun the same load and compare loaded bytes with the limit",
                None,
            ),
            fix(
                "Quantize the weights (8-bit or 4-bit)",
                "medium",
                "rerun the same load: the loaded bytes should shrink by the precision ratio",
                Some(QUALITY),
            ),
            fix(
                format!("{MORE_CAPACITY} tensor parallelism across GPUs, or a GPU with more memory"),
                "high",
                "rerun the same load on the new placement",
                None,
            ),
        ],
        Ok(CauseKind::HostGrowth) => vec![
            // Growth against time (no request marks): no Python heap to census.
            if c.metrics.contains_key("bytes_per_second") {
                fix(
                    "Find what the process keeps on the host: its allocator's heap profile (heaptrack, jemalloc or tcmalloc profiling), growing caches or queues",
                    "low",
                    format!("{SAME_WORKLOAD} host memory over time past its warm-up: it must plateau"),
                    None,
                )
            } else {
                host_holder_fix(&rk, format!("{SAME_WORKLOAD} host RSS between requests: it must plateau"))
            },
            fix(
                "Until it is fixed, restart the worker before the limit",
                "medium",
                "rerun the same workload and confirm the restart comes first",
                Some(RESTART_BOUNDED),
            ),
            fix(
                format!("{MORE_CAPACITY} a larger memory limit or host"),
                "high",
                "rerun the same workload",
                Some("growing swap until the service is unusable is not a fix: the failure only comes slower"),
            ),
        ],
        Ok(CauseKind::SlowGrowth) => vec![fix(
            if c.metrics.contains_key("bytes_per_second") {
                format!(
                    "Nothing urgent: the limit lasts {} at this rate; if that is shorter than the time between restarts or deploys, take heap profiles far apart to name what grows",
                    crate::runway::duration_text(c.metrics.get("seconds_to_limit").copied().unwrap_or(f64::INFINITY))
                )
            } else {
                format!(
                    "Nothing urgent: the limit lasts about {} more requests at this rate; if that is shorter than the time between restarts or deploys, take heap censuses far apart to name what grows",
                    metric(c, "requests_to_limit")
                )
            },
            "low",
            format!("{SAME_WORKLOAD} over more requests: the runway must not shrink"),
            None,
        )],
        _ => Vec::new(),
    }
}

/// Fragmentation in the Rust agent's `TrackingPool`: its own mechanics
/// (PyTorch's sizes, no PyTorch settings to set) and its own API.
fn pool_fragmentation_fixes(rk: &RuntimeKind) -> Vec<pb::Fix> {
    vec![
        fix(
            "Allocate from the TrackingPool in few sizes: one fixed KV block size (a paged cache) and long-lived buffers (weights, the KV pool) first; it rounds to 512 B, serves requests up to 1 MiB from 2 MiB segments and larger ones from 20 MiB segments (10 MiB and up get a segment of their own), so a freed block of a common size is reused whole",
            "low",
            format!("{SAME_WORKLOAD} reserved − allocated and the largest free block at the failure"),
            None,
        ),
        fix(
            "Call `TrackingPool::empty_cache()` before a large allocation after a burst of small ones: it releases every fully free cached segment (the pool does so itself once on an out-of-memory)",
            "low",
            format!("{SAME_WORKLOAD} reserved bytes before the large allocation"),
            Some("it frees whole free segments only: a segment with one live block stays"),
        ),
        fix(
            "Restart the worker periodically to reset the fragmented cache",
            "medium",
            "rerun the same workload and count restarts",
            Some(RESTART_BOUNDED),
        ),
        fix(
            format!("{MORE_CAPACITY} a larger GPU"),
            "high",
            "rerun the same failing workload",
            empty_cache_caveat(rk),
        ),
    ]
}

/// The fix the runtime's text names, in its own settings (the table in
/// `oom_texts`), for the cause that text named.
fn runtime_fix(c: &pb::Cause, f: &Findings) -> Option<pb::Fix> {
    let t = &f.text.as_ref()?.text;
    (t.cause == Some(c.kind.as_str()) && !t.fix.is_empty()).then(|| {
        fix(
            t.fix,
            "low",
            format!("restart {} with the new setting and rerun the same workload; the message must not come back", t.runtime),
            Some(ONE_REQUEST),
        )
    })
}

fn for_cause(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    match c.kind.parse() {
        Ok(CauseKind::StartupFailure) => {
            let named = c.evidence.first().and_then(|l| l.strip_prefix("stderr: "));
            vec![fix(
                match named {
                    Some(line) => format!("Fix the error it failed to start with: `{line}` (the command line, paths, environment or model files it names); memory is not the problem"),
                    None => "Find why it failed to start in its own logs (its stderr named no error): the command line, paths, environment or model files; memory is not the problem".to_string(),
                },
                "low",
                "start it once by hand, without restarts (`oomscope run` without --restart), until it is ready (/health answers) and serves one request; then restore the restart policy",
                Some("raising memory limits or restarting again changes nothing: the same error recurs on every start"),
            )]
        }
        Ok(CauseKind::CgroupLimit) => {
            let owner = f
                .memcg
                .as_ref()
                .map(|m| m.owner_path.clone())
                .or_else(|| f.kernel.map(|(_, k)| k.oom_memcg.clone()).filter(|p| !p.is_empty()))
                .unwrap_or_else(|| "the owning cgroup".to_string());
            let limit = metric(c, "limit_bytes");
            let ancestor = f.memcg.as_ref().is_some_and(|m| m.owner_depth > 0);
            vec![
                fix(
                    format!("Find what grew inside {owner}: compare memory.stat anon, file and shmem over the run"),
                    "low",
                    format!("{SAME_WORKLOAD} memory.peak of {owner}"),
                    Some("page cache and shmem are charged to the cgroup too"),
                ),
                fix(
                    match load_knobs(f) {
                        Some(k) => format!("Cap concurrency so the peak stays under the limit: {k}"),
                        None => "Cap concurrency (max concurrent requests, batch size, max context) so the peak stays under the limit".to_string(),
                    },
                    "low",
                    format!("{SAME_WORKLOAD} memory.peak against the limit"),
                    None,
                ),
                fix(
                    format!(
                        "Right-size the memory limit on {owner} (now {}) to the measured peak plus headroom",
                        bytes_short(limit)
                    ),
                    "medium",
                    format!("{SAME_WORKLOAD} memory.peak: it must plateau below the new limit"),
                    Some(if ancestor {
                        "the limit is on an ancestor shared with siblings: raising the child's own limit does not help"
                    } else {
                        "a larger limit only delays the failure when usage grows without bound"
                    }),
                ),
            ]
        }
        Ok(CauseKind::HostRamExhausted) => vec![
            fix(
                "Find what held host RAM at the failure (the top-RSS process list, this process's RSS over time)",
                "low",
                format!("{SAME_WORKLOAD} MemAvailable and the process's RSS"),
                None,
            ),
            fix(
                with_knobs(f, "Cap concurrency and batch size so the server's host memory peak fits", &[Knob::MaxSequences, Knob::MaxBatchTokens]),
                "low",
                format!("{SAME_WORKLOAD} MemAvailable at the peak"),
                None,
            ),
            fix(
                "Put the server in a cgroup with a memory limit sized from its measured peak, so an overrun fails it alone",
                "medium",
                "rerun the same workload and confirm memory.peak stays under the limit",
                Some("this contains the failure; it does not add memory"),
            ),
            fix(
                "Move the server (or other workloads) to a host with more RAM",
                "high",
                "rerun the same failing workload on the new host",
                None,
            ),
        ],
        Ok(CauseKind::AddressSpaceLimit) => {
            let limit = metric(c, "limit_bytes");
            let peak = metric(c, "vm_peak_bytes");
            vec![
                fix(
                    format!(
                        "Check where RLIMIT_AS ({}) comes from (ulimit -v, systemd LimitAS=, the launcher) and whether it is intended",
                        bytes_short(limit)
                    ),
                    "low",
                    "print `cat /proc/<pid>/limits` in the server's environment",
                    None,
                ),
                fix(
                    format!(
                        "Raise or remove RLIMIT_AS (VmPeak reached {}); bound resident memory with a cgroup limit instead",
                        bytes_short(peak)
                    ),
                    "medium",
                    "rerun the same failing request; it must pass with VmPeak below the new limit",
                    Some("GPU runtimes and allocator pools reserve far more virtual address space than they touch"),
                ),
            ]
        }
        Ok(CauseKind::OvercommitLimit) => {
            let room = metric(c, "commit_room_bytes");
            let request = match metric(c, "requested_bytes") {
                0 => String::new(),
                r => format!(" (the failed request: {})", bytes_short(r)),
            };
            vec![
                fix(
                    format!(
                        "Reserve less at once: CommitLimit had {} left{request}; lower the largest reservation (batch, buffer or pool size) below it",
                        bytes_short(room)
                    ),
                    "low",
                    "rerun the same failing request and compare Committed_AS with CommitLimit",
                    None,
                ),
                fix(
                    "Add swap or raise vm.overcommit_ratio (or vm.overcommit_kbytes) so CommitLimit covers the reservations",
                    "medium",
                    "rerun the same failing request and compare Committed_AS with CommitLimit",
                    Some("strict overcommit refuses by reservation, not by use; it is a host-wide setting"),
                ),
            ]
        }
        Ok(CauseKind::DataLimit) => {
            let limit = metric(c, "limit_bytes");
            vec![
                fix(
                    format!(
                        "Check where RLIMIT_DATA ({}) comes from (ulimit -d, systemd LimitDATA=, prlimit, the launcher) and whether it is intended",
                        bytes_short(limit)
                    ),
                    "low",
                    "print `cat /proc/<pid>/limits` (Max data size) in the server's environment",
                    None,
                ),
                fix(
                    "Raise or remove RLIMIT_DATA; bound resident memory with a cgroup limit instead",
                    "medium",
                    "rerun the same failing request; it must pass under the new limit",
                    Some("since Linux 4.7 RLIMIT_DATA counts private writable mmaps too, so allocator arenas and anonymous buffers run into it"),
                ),
            ]
        }
        Ok(CauseKind::ShmFull) => {
            let total = metric(c, "shm_total_bytes");
            let size = match total {
                0 => String::new(),
                t => format!(" (it is {} here; Docker's default is 64 MiB)", bytes_short(t)),
            };
            vec![
                fix(
                    "Find what fills /dev/shm (stale segments of crashed workers, DataLoader/IPC buffers): `ls -la /dev/shm`, `df /dev/shm`",
                    "low",
                    "watch `df /dev/shm` during the same workload",
                    None,
                ),
                fix(
                    "Put less in /dev/shm at once: fewer DataLoader workers (num_workers, prefetch_factor), or `torch.multiprocessing.set_sharing_strategy('file_system')`",
                    "low",
                    "rerun the same workload and watch /dev/shm use at its peak",
                    Some("file_system sharing leaves files behind if a process dies; fewer workers load slower"),
                ),
                fix(
                    format!("Enlarge /dev/shm to the measured need plus headroom{size}: `docker run --shm-size`, a memory-backed volume on /dev/shm (Kubernetes emptyDir medium: Memory with a sizeLimit), or a tmpfs size= option"),
                    "medium",
                    "rerun the same failing workload and watch /dev/shm use",
                    Some("/dev/shm pages are RAM and count against the cgroup limit"),
                ),
            ]
        }
        Ok(CauseKind::SwapThrash) => vec![
            fix(
                with_knobs(f, "Cap concurrency and batch size to shrink the working set", &[Knob::MaxSequences, Knob::MaxBatchTokens]),
                "low",
                format!("{SAME_WORKLOAD} refaults/s and PSI full avg10"),
                None,
            ),
            fix(
                "Give the working set enough RAM (a larger memory limit or host) so refaults stop",
                "medium",
                format!("{SAME_WORKLOAD} refaults/s and latency"),
                Some("more swap does not fix thrash: it makes the slowdown last longer"),
            ),
        ],
        Ok(CauseKind::ExternalKill) => vec![fix(
            "Find who sent SIGKILL: orchestrator events (liveness probes, evictions), systemd stop timeouts, systemd-oomd/earlyoom logs",
            "low",
            "rerun the same workload and watch those logs at the kill",
            Some("a slow server can fail a liveness probe; lengthen the probe only after finding why it is slow"),
        )],
        Ok(CauseKind::OtherProcess) => {
            let pids: Vec<String> = c.processes.iter().map(|p| p.pid.to_string()).collect();
            vec![
                fix(
                    format!(
                        "Ask the owners of pid {} about their use, or schedule the server where that memory is free",
                        pids.join(", ")
                    ),
                    "low",
                    "rerun the same failing workload when that memory is free",
                    Some("never kill processes you do not own on a shared machine"),
                ),
                fix(
                    with_knobs(f, "Size the server for the memory actually left (lower concurrency, a smaller per-process cap)", &[Knob::MemoryFraction, Knob::MaxSequences]),
                    "low",
                    SAME_WORKLOAD,
                    None,
                ),
            ]
        }
        Ok(CauseKind::NumaBinding) | Ok(CauseKind::HostFragmentation) | Ok(CauseKind::MemoryHighThrottling) => {
            host_kernel_fixes(c, f)
        }
        _ => gpu_timeline_fixes(c, f),
    }
}

/// Fixes for what the kernel's record tells apart from plain exhaustion,
/// and for memory.high throttling. None of them adds RAM: the RAM was there.
fn host_kernel_fixes(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    match c.kind.parse() {
        Ok(CauseKind::NumaBinding) => {
            let nodes = f
                .kernel
                .map(|(_, k)| {
                    if k.constraint == "CONSTRAINT_CPUSET" || k.nodemask == "(null)" {
                        format!("cpuset {} (mems_allowed {})", k.cpuset, k.mems_allowed)
                    } else {
                        format!("the memory policy's nodemask {}", k.nodemask)
                    }
                })
                .unwrap_or_else(|| "the binding".to_string());
            vec![
                fix(
                    format!("Check that the NUMA binding is intended: {nodes}; `numactl --show` and the cpuset's cpuset.mems in the server's environment"),
                    "low",
                    "print the binding where the server starts; compare with each node's MemFree in /sys/devices/system/node/node*/meminfo",
                    None,
                ),
                fix(
                    with_knobs(f, "Shrink what each bound node must hold: fewer workers or less concurrency per node, a smaller per-node KV cache (vLLM CPU: VLLM_CPU_KVCACHE_SPACE), or one model shard per node", &[Knob::MaxSequences, Knob::MaxBatchTokens]),
                    "low",
                    format!("{SAME_WORKLOAD} the bound nodes' MemFree at the peak"),
                    None,
                ),
                fix(
                    "Widen the binding to nodes with free memory: add nodes to cpuset.mems or `numactl --membind`, or interleave (`numactl --interleave=all`)",
                    "medium",
                    format!("{SAME_WORKLOAD} latency too: memory on a remote node is slower"),
                    Some("the host had memory free on the other nodes; adding RAM does not help a process that may not use it"),
                ),
            ]
        }
        Ok(CauseKind::HostFragmentation) => vec![
            fix(
                "Compact memory and see whether the failure recurs: `echo 1 > /proc/sys/vm/compact_memory` (as root); watch /proc/buddyinfo for blocks of the failing order",
                "low",
                "rerun the same workload after compaction and compare /proc/buddyinfo's high orders at the failure",
                Some("compaction is a one-off: fragmentation returns with the same allocation pattern"),
            ),
            fix(
                "Raise vm.min_free_kbytes (about 1-3% of RAM) so the kernel keeps larger free blocks in reserve",
                "medium",
                "rerun the same workload and check /proc/buddyinfo and the kernel log for page allocation failures",
                Some("memory kept free is memory the workload cannot use"),
            ),
            fix(
                "Reserve fewer huge pages (vm.nr_hugepages), or reserve them at boot rather than at run time, so they do not split the free memory",
                "medium",
                "rerun the same workload with the new reservation and check HugePages_Total/HugePages_Free",
                None,
            ),
        ],
        Ok(CauseKind::MemoryHighThrottling) => {
            let high = metric(c, "high_bytes");
            let path = f
                .counters
                .as_ref()
                .and_then(|x| x.levels().find(|l| l.after.high_bytes == high))
                .map_or("the cgroup".to_string(), |l| l.after.path.clone());
            vec![
                fix(
                    format!("Find what grows in {path} past memory.high: compare memory.stat anon, file and shmem over the run"),
                    "low",
                    format!("{SAME_WORKLOAD} memory.events high and memory.pressure"),
                    Some("page cache counts toward memory.high too, and is reclaimed first"),
                ),
                fix(
                    with_knobs(f, "Cap concurrency so usage stays under memory.high", &[Knob::MaxSequences, Knob::MaxBatchTokens]),
                    "low",
                    format!("{SAME_WORKLOAD} memory.events high: it must stop rising"),
                    None,
                ),
                fix(
                    format!(
                        "Raise memory.high on {path} (now {}) to the measured peak plus headroom, below memory.max",
                        bytes_short(high)
                    ),
                    "medium",
                    format!("{SAME_WORKLOAD} latency and memory.pressure"),
                    Some("memory.high is the warning before memory.max: past memory.max the kernel kills"),
                ),
            ]
        }
        _ => Vec::new(),
    }
}

/// Where no cause says more and the evidence lacks what `oomscope run` records.
const RERUN_SUPERVISED: &str =
    "Rerun under `oomscope run` (or with the agent) so before/after counters and samples are recorded";

/// Where no cause says more.
fn for_domain(d: Domain, f: &Findings) -> Vec<pb::Fix> {
    match d {
        Domain::GpuVram => {
            let rk = runtime_kind::of(f.evidence);
            let mut v = vec![fix(
                match load_knobs(f) {
                    Some(k) => format!("Lower concurrency, batch size or max context on this GPU, one at a time: {k}"),
                    None => "Lower concurrency, batch size or max context on this GPU, one at a time".to_string(),
                },
                "low",
                "rerun the same failing request at the new setting, then at the expected peak load",
                Some("one passing request does not prove capacity"),
            )];
            // Where an agent already read the allocator, asking for it sends the user in a circle.
            if !f.timeline.points.iter().any(|p| p.has_allocator) {
                v.push(fix(
                    "Capture the allocator state at the next failure (oomscope agent with snapshots) to separate leak, fragmentation and growth",
                    "low",
                    "reproduce with the same request",
                    empty_cache_caveat(&rk),
                ));
            }
            v
        }
        // Evidence that `oomscope run` recorded already has its counters and
        // samples: telling its user to rerun under it would send them in a circle.
        _ if f.evidence.from_supervisor() => vec![],
        _ => vec![fix(
            RERUN_SUPERVISED,
            "low",
            "reproduce with the same workload and diagnose again",
            None,
        )],
    }
}
