//! Fixes in the runtime's own settings: each names the flag or variable a
//! user types (from `settings`), its current value where the command line,
//! the recorded environment or the runtime's plugin says it, and a proposed
//! value computed from the cause's measured figures (its `proposed_*`
//! metrics). Where the runtime is unknown the wording stays generic.

use crate::findings::Findings;
use crate::kv_pool_figures::{self, FIT_SHARE, GIB, NEED_MARGIN};
use crate::pb;
use crate::settings::{self, Knob, Runtime, Setting, Settings, SETTINGS};
use crate::units::bytes_short;
use oomscope_proto::{CauseKind, Role};

/// Defaults worth saying where a setting is not set: the base a proposal
/// was computed from (vLLM's CacheConfig: gpu_memory_utilization = 0.9).
const DEFAULTS: &[(Runtime, &str, &str)] = &[(Runtime::Vllm, "--gpu-memory-utilization", "0.9")];

/// How a setting stands now: "now 64", "not set", "not set; vLLM resolved
/// 256", or "current value not recorded" where nothing recorded it.
pub fn now(f: &Findings, s: &Setting) -> String {
    if let Some(v) = f.settings.values.get(s.name) {
        return if v.is_empty() {
            "now on".to_string()
        } else {
            format!("now {v}")
        };
    }
    if let Some(r) = kv_pool_figures::resolved(f.evidence, s) {
        return format!("not set; {} resolved {r}", s.runtime.name());
    }
    let hello = f.evidence.hello.as_ref();
    // A flag is known unset where the runtime's own command line was
    // recorded; a variable where `oomscope run` recorded the environment.
    let recorded = if s.name.starts_with('-') {
        hello.is_some_and(|h| settings::detect(&h.command) == Some(s.runtime))
    } else {
        hello.is_some_and(|h| h.role == Role::Supervisor)
    };
    if recorded {
        match DEFAULTS
            .iter()
            .find(|(r, n, _)| *r == s.runtime && *n == s.name)
        {
            Some((r, _, d)) => format!("not set: {}'s default {d}", r.name()),
            None => "not set".to_string(),
        }
    } else {
        "current value not recorded".to_string()
    }
}

/// "`--max-num-seqs` (now 64)".
pub fn named(f: &Findings, s: &Setting) -> String {
    format!("`{}` ({})", f.settings.spelling(s), now(f, s))
}

/// The runtime's setting for `knob`, named with its value; None where the
/// runtime is unknown or has no such setting.
pub fn knob(f: &Findings, knob: Knob) -> Option<String> {
    f.settings.setting(knob).map(|s| named(f, s))
}

/// `generic` as is where the runtime is unknown, else followed by the
/// runtime's settings for `knobs`: "Cap concurrency: `--max-num-seqs` (now 64), ...".
pub fn with_knobs(f: &Findings, generic: &str, knobs: &[Knob]) -> String {
    let names: Vec<String> = knobs.iter().filter_map(|&k| knob(f, k)).collect();
    if names.is_empty() {
        generic.to_string()
    } else {
        format!("{generic}: {}", names.join(", "))
    }
}

/// "max concurrent requests, batch size, max context" in the runtime's words.
pub fn load_knobs(f: &Findings) -> Option<String> {
    let names: Vec<String> = [Knob::MaxSequences, Knob::MaxBatchTokens, Knob::MaxContext]
        .into_iter()
        .filter_map(|k| knob(f, k))
        .collect();
    (!names.is_empty()).then(|| names.join(", "))
}

/// "`--gpu-memory-utilization 0.84`", "`VLLM_CPU_KVCACHE_SPACE=0.5`".
/// The flag is said as the command line typed it (`--n-ctx`, `-c`).
fn assign(settings: &Settings, s: &Setting, value: &str) -> String {
    let name = settings.spelling(s);
    if s.name.starts_with('-') {
        format!("`{name} {value}`")
    } else {
        format!("`{name}={value}`")
    }
}

/// The assignment that sets the KV pool to `bytes` through `s`. A whole-GiB
/// variable (vLLM parses VLLM_CPU_KVCACHE_SPACE as an int) cannot say less
/// than 1 GiB: the runtime's bytes flag says it instead.
fn kv_assign(settings: &Settings, s: &Setting, bytes: f64) -> String {
    if s.unit == "GiB" && bytes < GIB {
        if let Some(b) = SETTINGS
            .iter()
            .find(|b| b.runtime == s.runtime && b.knob == s.knob && b.unit == "bytes")
        {
            return format!(
                "{} instead of `{}`, which takes whole GiB",
                assign(settings, b, &kv_value(b, bytes)),
                s.name
            );
        }
    }
    assign(settings, s, &kv_value(s, bytes))
}

/// A KV size in the setting's unit (whole GiB, rounded down, else bytes).
fn kv_value(s: &Setting, bytes: f64) -> String {
    match s.unit {
        "GiB" => format!("{}", (bytes / GIB).floor() as u64),
        _ => format!("{}", bytes.round() as u64),
    }
}

fn metric(c: &pb::Cause, name: &str) -> Option<f64> {
    c.metrics.get(name).copied().filter(|v| v.is_finite())
}

fn fix(action: String, risk: &str, retest: String, caveat: Option<&str>) -> pb::Fix {
    pb::Fix {
        action,
        risk: risk.to_string(),
        retest,
        caveat: caveat.map(str::to_string),
    }
}

const SMALLER_POOL: &str = "a smaller pool holds fewer tokens: fewer sequences run at once, and a full pool makes requests wait (watch kv_cache_usage and waiting requests)";
const QUALITY: &str =
    "quality re-evaluation required: rerun the model's accuracy suite at the new precision";

/// The fixes of a cause in the runtime's settings, most specific first.
pub fn for_cause(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    match c.kind.parse() {
        Ok(CauseKind::KvReservation) => kv_reservation(c, f),
        Ok(CauseKind::ContextOverKv) => context_over_kv(c, f),
        Ok(CauseKind::KvNoRoom) => kv_no_room(f),
        Ok(CauseKind::KvPoolFull) => knob(f, Knob::MaxSequences)
            .map(|n| {
                vec![fix(
                    format!("Admit fewer requests at once: lower {n}"),
                    "low",
                    restart_retest(
                        f,
                        "the pool must stop overflowing (no retracted or preempted requests)",
                    ),
                    None,
                )]
            })
            .unwrap_or_default(),
        Ok(CauseKind::ActivationHeadroom) => activation_headroom(c, f),
        Ok(CauseKind::TakenAfterProfiling) => taken_after_profiling(c, f),
        Ok(CauseKind::KvPoolSaturation) => kv_pool_saturation(c, f),
        Ok(CauseKind::NonPytorchMemory) => non_pytorch_memory(c, f),
        _ => Vec::new(),
    }
}

/// A variable every PyTorch process reads, by name (`NCCL_BUFFSIZE`).
fn variable(name: &str) -> Option<&'static Setting> {
    SETTINGS
        .iter()
        .find(|s| s.runtime == Runtime::Pytorch && s.name == name)
}

/// Memory outside PyTorch's allocator explained the failure: fewer captured
/// CUDA graphs (or none), smaller NCCL buffers and cuBLAS workspaces, each
/// retested by that memory at the failure.
fn non_pytorch_memory(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    let lacked_bytes = metric(c, "lacked_bytes").unwrap_or(0.0);
    // A bare context's worth explains it, but nothing here gives it back.
    if metric(c, "beyond_context_bytes").unwrap_or(0.0) < lacked_bytes {
        return Vec::new();
    }
    let lacked = bytes_short(lacked_bytes as u64);
    let outside = bytes_short(metric(c, "non_pytorch_bytes").unwrap_or(0.0) as u64);
    let retest = |what: &str| {
        restart_retest(
            f,
            &format!(
                "{what}; the process's use of the device outside PyTorch (NVML's figure for it, or \"this process has … in use\" in PyTorch's message, minus torch.cuda.memory_reserved()) was {outside} and must fall by more than the {lacked} the allocation lacked"
            ),
        )
    };
    let graphs = match (knob(f, Knob::CudaGraphs), knob(f, Knob::Eager)) {
        // Eager already: no graphs to capture fewer of.
        _ if f.settings.get(Knob::Eager).is_some() => None,
        (Some(sizes), Some(eager)) => Some(format!(
            "Capture CUDA graphs for fewer batch sizes: lower {sizes}, or capture none with {eager}"
        )),
        _ => Some("Where the process captures CUDA graphs (torch.cuda.graph, torch.compile's reduce-overhead mode), capture fewer batch sizes or run those steps eagerly".to_string()),
    };
    let mut out: Vec<pb::Fix> = graphs
        .into_iter()
        .map(|action| {
            fix(
                action,
                "low",
                retest("the same workload must pass"),
                Some("without graphs decoding is slower: retest the latency too"),
            )
        })
        .collect();
    if let Some(s) = variable("NCCL_BUFFSIZE") {
        out.push(fix(
            format!(
                "Where the process uses NCCL (tensor or pipeline parallel), shrink its buffers: {} (NCCL's default: 4194304 bytes for each pair of GPUs), e.g. {}",
                named(f, s),
                assign(&f.settings, s, "1048576")
            ),
            "medium",
            retest("collectives must still run at the expected speed"),
            Some("smaller buffers can slow collectives"),
        ));
    }
    if let Some(s) = variable("CUBLAS_WORKSPACE_CONFIG") {
        out.push(fix(
            format!(
                "Bound cuBLAS's workspaces (one per handle and stream): {}, e.g. {}",
                named(f, s),
                assign(&f.settings, s, ":16:8")
            ),
            "medium",
            retest("matmul throughput must stay acceptable"),
            Some("a few MiB per stream: it matters with many streams or threads"),
        ));
    }
    out
}

fn runtime_name(f: &Findings) -> &'static str {
    f.runtime().map_or("the server", Runtime::name)
}

fn restart_retest(f: &Findings, then: &str) -> String {
    format!(
        "restart {} with the new value and rerun the same workload: {then}",
        runtime_name(f)
    )
}

/// The reservation did not fit: at start-up under a cgroup limit (room
/// measured before the final climb), or as the runtime's text says (the
/// memory available, or the free share of the device).
fn kv_reservation(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    let runtime = runtime_name(f);
    let mut out = Vec::new();
    if let Some(share) = metric(c, "proposed_memory_fraction") {
        let total = metric(c, "total_bytes").unwrap_or(0.0) as u64;
        let free = metric(c, "available_bytes").unwrap_or(0.0) as u64;
        let why = format!(
            "{:.0}% of the share that was free at start-up ({} of {}), the rest left for other processes",
            FIT_SHARE * 100.0,
            bytes_short(free),
            bytes_short(total)
        );
        let action = match f.settings.setting(Knob::MemoryFraction) {
            Some(s) => format!(
                "Lower the memory share to what is free: {} ({}): {why}",
                assign(&f.settings, s, &format!("{share:.2}")),
                now(f, s)
            ),
            None => format!("Lower the runtime's memory share to {share:.2}: {why}"),
        };
        out.push(fix(
            action,
            "low",
            restart_retest(f, "start-up must pass the free-memory check"),
            Some(SMALLER_POOL),
        ));
    }
    let proposed = metric(c, "proposed_kv_bytes");
    let rest = metric(c, "rest_bytes");
    let limit = metric(c, "limit_bytes").unwrap_or(0.0);
    let why = match (rest, metric(c, "available_bytes")) {
        (Some(r), _) => format!(
            "the {} cgroup limit less the {} the rest of {runtime} held before the pool and its warm-up after it, with {:.0}% headroom",
            bytes_short(limit as u64),
            bytes_short(r as u64),
            (1.0 - FIT_SHARE) * 100.0
        ),
        (None, Some(a)) => format!(
            "below the {} available when {runtime} checked, with {:.0}% headroom",
            bytes_short(a as u64),
            (1.0 - FIT_SHARE) * 100.0
        ),
        _ => String::new(),
    };
    let retest = restart_retest(
        f,
        "start-up must finish under the same limit (memory.peak below it) and the first requests pass; then step up to the expected concurrency",
    );
    match proposed {
        Some(p) if p > 0.0 => {
            let action = match kv_pool_figures::kv_setting(&f.settings) {
                Some(s) => format!(
                    "Lower the KV reservation to what fits: {} ({}; in {}): {why}",
                    kv_assign(&f.settings, s, p),
                    now(f, s),
                    s.unit
                ),
                // Sized in tokens, blocks or by the context: scaled where the pool's bytes are known.
                None => match scaled_pool(c, f, p) {
                    Some(scaled) => {
                        format!("Lower the KV reservation to what fits: {scaled}: {why}")
                    }
                    None => with_knobs(
                        f,
                        &format!(
                            "Lower the KV reservation to what fits, {} ({why})",
                            bytes_short(p as u64)
                        ),
                        &[Knob::MaxContext, Knob::MaxSequences, Knob::KvCacheDtype],
                    ),
                },
            };
            out.push(fix(action, "low", retest, Some(SMALLER_POOL)));
        }
        Some(_) => {
            let r = rest.or(metric(c, "available_bytes")).unwrap_or(0.0) as u64;
            out.push(fix(
                format!(
                    "The KV pool does not fit at all: {runtime} held {} before the pool, leaving no room under the {} limit; raise the limit or serve a smaller (or quantized) model",
                    bytes_short(r),
                    bytes_short(limit as u64)
                ),
                "medium",
                retest,
                None,
            ));
        }
        None => {}
    }
    // The other way round: keep the pool, give the cgroup what it needs.
    if let (Some(r), Some(pool)) = (rest, metric(c, "kv_pool_bytes")) {
        let need = (r + pool) / FIT_SHARE;
        out.push(fix(
            format!(
                "Or keep the pool ({}) and raise the memory limit to at least {}: the {} the rest held plus the pool, with {:.0}% headroom",
                bytes_short(pool as u64),
                bytes_short(need as u64),
                bytes_short(r as u64),
                (1.0 - FIT_SHARE) * 100.0
            ),
            "medium",
            format!("restart {runtime} under the new limit: memory.peak must settle below it"),
            Some("only where the host has that memory to give"),
        ));
    }
    out
}

/// A pool sized in tokens, blocks or by the context (`kv_pool_figures::token_pool`)
/// brought down to `proposed` bytes: the setting's value scaled by proposed
/// over the pool's bytes (the cause's figure, else what the runtime logged
/// reserving it), rounded down (a context to a multiple of 256). None where
/// the pool's bytes are unknown: no value is guessed.
/// "`--n_ctx 8192` (now 32768; the 4.0 GiB pool llama-cpp-python logged scales with it)".
fn scaled_pool(c: &pb::Cause, f: &Findings, proposed: f64) -> Option<String> {
    let (s, current) = kv_pool_figures::token_pool(&f.settings)?;
    let (pool, whose) = match metric(c, "kv_pool_bytes").or(metric(c, "requested_bytes")) {
        Some(b) => (b, "asked for"),
        None => (
            f.exit
                .and_then(|(_, x)| kv_pool_figures::logged_kv_bytes(&x.stderr_tail))?
                as f64,
            "logged",
        ),
    };
    if pool <= proposed {
        return None;
    }
    let raw = current * proposed / pool;
    let step = if s.knob == Knob::MaxContext && raw >= CONTEXT_STEP {
        CONTEXT_STEP
    } else {
        1.0
    };
    let value = kv_pool_figures::floor_to(raw, step);
    (value >= 1.0).then(|| {
        format!(
            "{} ({}; the {} pool {} {} scales with it)",
            assign(&f.settings, s, &kv_pool_figures::number(value)),
            now(f, s),
            bytes_short(pool as u64),
            runtime_name(f),
            whose
        )
    })
}

/// A proposed context is a multiple of this many tokens.
const CONTEXT_STEP: f64 = 256.0;

fn context_over_kv(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    let (Some(tokens), Some(s)) = (
        metric(c, "proposed_max_context"),
        f.settings.setting(Knob::MaxContext),
    ) else {
        return Vec::new();
    };
    vec![fix(
        format!(
            "Lower the context to what the KV cache holds: {} ({}), the tokens {} measured for its pool",
            assign(&f.settings, s, &kv_pool_figures::number(tokens)),
            now(f, s),
            runtime_name(f)
        ),
        "low",
        restart_retest(f, "start-up must pass, and the longest prompt expected must fit"),
        Some("longer prompts are then refused; give the KV cache more memory instead where they are needed"),
    )]
}

fn kv_no_room(f: &Findings) -> Vec<pb::Fix> {
    let (Some(batch), Some(share)) = (knob(f, Knob::MaxBatchTokens), knob(f, Knob::MemoryFraction))
    else {
        return Vec::new();
    };
    vec![fix(
        format!(
            "Make room for the KV cache: lower {batch} (the activation peak profiled at start), or raise {share} where the device is not shared"
        ),
        "low",
        restart_retest(f, "start-up must allocate a KV cache, and its logged size must hold the longest context"),
        None,
    )]
}

fn activation_headroom(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    let need = metric(c, "activation_peak_bytes").unwrap_or(0.0);
    let headroom = metric(c, "headroom_bytes").unwrap_or(0.0);
    let mut out = Vec::new();
    if let (Some(p), Some(s)) = (
        metric(c, "proposed_memory_fraction"),
        f.settings.setting(Knob::MemoryFraction),
    ) {
        out.push(fix(
            format!(
                "Leave the activations room beside the pool: {} ({}): the pool shrinks and the headroom ({} now) takes the measured peak of {} plus {:.0}%",
                assign(&f.settings, s, &format!("{p:.2}")),
                now(f, s),
                bytes_short(headroom as u64),
                bytes_short(need as u64),
                NEED_MARGIN * 100.0
            ),
            "low",
            restart_retest(f, "the same batch must pass; the KV cache size the runtime logs at start shrinks by about the same bytes"),
            Some(SMALLER_POOL),
        ));
    }
    out.push(fix(
        with_knobs(
            f,
            "Lower the batch's activation peak (fewer tokens per step, fewer sequences at once)",
            &[Knob::MaxBatchTokens, Knob::MaxSequences],
        ),
        "low",
        restart_retest(
            f,
            "the peak allocated bytes of the largest batch must stay under the headroom",
        ),
        Some("throughput per step falls with the batch"),
    ));
    out
}

fn taken_after_profiling(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    let taken = metric(c, "taken_bytes").unwrap_or(0.0);
    let total = metric(c, "total_bytes").unwrap_or(0.0);
    let mut out = Vec::new();
    if f.evidence.gpu_seen() {
        if let Some(s) = f.settings.setting(Knob::MemoryFraction) {
            let current = f
                .settings
                .values
                .get(s.name)
                .cloned()
                .or_else(|| kv_pool_figures::resolved(f.evidence, s))
                .and_then(|v| v.parse::<f64>().ok())
                .or((s.runtime == Runtime::Vllm)
                    .then_some(kv_pool_figures::VLLM_DEFAULT_GPU_MEMORY_UTILIZATION));
            if let Some(cur) = current.filter(|_| total > 0.0) {
                let p = kv_pool_figures::floor_to(cur - taken * (1.0 + NEED_MARGIN) / total, 0.01);
                if p > 0.0 {
                    out.push(fix(
                        format!(
                            "Size the pool for the memory actually left: {} ({}): it leaves the {} others took plus {:.0}%",
                            assign(&f.settings, s, &format!("{p:.2}")),
                            now(f, s),
                            bytes_short(taken as u64),
                            NEED_MARGIN * 100.0
                        ),
                        "low",
                        restart_retest(f, "while the other process holds its memory, no OOM"),
                        Some(SMALLER_POOL),
                    ));
                }
            }
        }
        let devices = f
            .settings
            .values
            .get("CUDA_VISIBLE_DEVICES")
            .map_or(String::new(), |d| {
                format!(" (`CUDA_VISIBLE_DEVICES` now {d})")
            });
        out.push(fix(
            format!("Give each instance its own GPU{devices}, so no other process shares the memory the pool was sized from"),
            "medium",
            "rerun the same workload with the other instance running".to_string(),
            None,
        ));
    } else if let (Some((s, kv)), Runtime::Vllm) = (
        kv_pool_figures::kv_request(&f.settings),
        f.runtime().unwrap_or(Runtime::Unknown),
    ) {
        let p =
            kv_pool_figures::floor_to((kv as f64 - taken * (1.0 + NEED_MARGIN)) / GIB, 0.1) * GIB;
        if p > 0.0 {
            out.push(fix(
                format!(
                    "Size the pool for the memory actually left: {} ({}): it leaves the {} others took plus {:.0}%",
                    kv_assign(&f.settings, s, p),
                    now(f, s),
                    bytes_short(taken as u64),
                    NEED_MARGIN * 100.0
                ),
                "low",
                restart_retest(f, "while the other process holds its memory, no OOM"),
                Some(SMALLER_POOL),
            ));
        }
    }
    out
}

fn kv_pool_saturation(c: &pb::Cause, f: &Findings) -> Vec<pb::Fix> {
    let running = metric(c, "proposed_max_sequences");
    let cap = metric(c, "max_sequences");
    let retest = "rerun the same load and watch kv_cache_usage, waiting requests and preemptions: preemptions must stop, and the time in the queue is then the latency cost".to_string();
    let mut out = Vec::new();
    match (f.settings.setting(Knob::MaxSequences), running) {
        (Some(s), Some(n)) if cap.is_none_or(|cap| n < cap) => out.push(fix(
            format!(
                "Cap the sequences at what the pool holds: {} ({}), the running count when the pool was full, so requests wait in the queue instead of being preempted and recomputed",
                assign(&f.settings, s, &kv_pool_figures::number(n)),
                now(f, s)
            ),
            "low",
            retest.clone(),
            Some("this bounds latency under overload, not capacity: the pool's size sets how many run"),
        )),
        (Some(s), _) => out.push(fix(
            format!("Cap the sequences at what the pool holds: {}", named(f, s)),
            "low",
            retest.clone(),
            None,
        )),
        (None, Some(n)) => out.push(fix(
            format!(
                "Cap concurrent sequences at about {} (the running count when the pool was full), with a bounded queue in front",
                kv_pool_figures::number(n)
            ),
            "low",
            retest.clone(),
            None,
        )),
        (None, None) => {}
    }
    let grow = if f.evidence.gpu_seen() {
        knob(f, Knob::MemoryFraction)
    } else {
        kv_pool_figures::kv_setting(&f.settings).map(|s| named(f, s))
    };
    if let Some(g) = grow {
        let pool = metric(c, "kv_pool_bytes").map_or(String::new(), |p| {
            format!(" (the pool is {} now)", bytes_short(p as u64))
        });
        out.push(fix(
            format!(
                "Give the KV pool more memory where the {} has room: raise {g}{pool}",
                if f.evidence.gpu_seen() {
                    "device"
                } else {
                    "host"
                }
            ),
            "medium",
            retest.clone(),
            Some("only memory that is free for the whole run: the pool is reserved at start-up"),
        ));
    }
    if let Some(s) = f.settings.setting(Knob::KvCacheDtype) {
        let value = match s.runtime {
            Runtime::LlamaCpp => "q8_0",
            // llama-cpp-python takes ggml's type number: 8 is q8_0.
            Runtime::LlamaCppPython => "8",
            _ => "fp8",
        };
        out.push(fix(
            format!(
                "Store the KV cache at lower precision: {} ({}): the pool holds about twice the tokens",
                assign(&f.settings, s, value),
                now(f, s)
            ),
            "medium",
            retest.clone(),
            Some(QUALITY),
        ));
    }
    if let Some(ctx) = knob(f, Knob::MaxContext) {
        out.push(fix(
            format!("Cap the context where long prompts are not needed: lower {ctx}"),
            "medium",
            retest,
            Some("longer prompts are then refused"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assignment_reads_as_typed() {
        let env = settings::SETTINGS
            .iter()
            .find(|s| s.name == "VLLM_CPU_KVCACHE_SPACE")
            .unwrap();
        // Whole GiB only: vLLM parses the variable as an int.
        assert_eq!(
            assign(&Settings::default(), env, &kv_value(env, 2.7 * GIB)),
            "`VLLM_CPU_KVCACHE_SPACE=2`"
        );
        let flag = settings::SETTINGS
            .iter()
            .find(|s| s.name == "--kv-cache-memory-bytes")
            .unwrap();
        assert_eq!(
            assign(&Settings::default(), flag, &kv_value(flag, 0.5 * GIB)),
            "`--kv-cache-memory-bytes 536870912`"
        );
    }
}
