//! A preallocated KV pool (vLLM, SGLang, llama.cpp reserve their KV cache as
//! one pool at start-up): its readings over the run, the climb that filled
//! it, the figures the runtime's texts give, and the values a fix proposes
//! from them. Pure measurements; `causes::kv_pool` makes the verdicts.

use crate::evidence::Evidence;
use crate::pb;
use crate::pb::event::Kind;
use crate::settings::{Knob, Runtime, Setting, Settings};

pub const GIB: f64 = (1u64 << 30) as f64;
const MIB: u64 = 1 << 20;

/// A proposed reservation takes this share of the room measured for it: the
/// rest of the server still grows a little after start-up (the API server's
/// buffers, compile caches, a request's activations), so a pool sized to the
/// last byte fails at the first request.
pub const FIT_SHARE: f64 = 0.9;

/// What a runtime still takes after its KV pool is in place and before it
/// serves (vLLM's warm-up: a dummy forward pass at the largest batch, the
/// sampler's buffers), at least: a tiny Llama on vLLM 0.32's CPU build grew
/// 150-250 MiB past the pool, and a pool sized without it was killed again.
pub const AFTER_POOL_MIN_BYTES: u64 = 256 * MIB;

/// The same allowance as a share of the rest, for larger models.
pub const AFTER_POOL_SHARE: f64 = 0.15;

/// The allowance for warm-up after the pool, beside a rest of `rest_bytes`.
pub fn after_pool_allowance(rest_bytes: u64) -> u64 {
    ((rest_bytes as f64 * AFTER_POOL_SHARE) as u64).max(AFTER_POOL_MIN_BYTES)
}

/// A measured need (an activation peak, memory another process took) gets
/// this much on top before a setting is proposed from it: the next batch or
/// the next neighbour may need a little more than the one measured.
pub const NEED_MARGIN: f64 = 0.2;

/// Samples of the final climb to a limit each rise at least this much over
/// the one before: filling a pool (`torch.zeros` of the KV cache) touches
/// hundreds of MiB per sample, while a settled server moves by a few MiB.
pub const CLIMB_MIN_STEP_BYTES: u64 = 4 * MIB;

/// KV pool usage at or above this is a full pool: vLLM admits a waiting
/// request only when all of its prompt's blocks fit, and preempts when a
/// running one cannot get its next block, so a pool of partly filled blocks
/// turns requests away well before 100 %. A real vLLM (0.32, a 40-block
/// pool under 24 concurrent 150-word prompts) peaked at 92-97 % with 6-15
/// requests waiting.
pub const KV_FULL_USAGE: f64 = 0.9;

/// Fewer full readings than this (with requests waiting) are a passing peak.
pub const MIN_FULL_READINGS: usize = 2;

/// The runtime's own use of the device is settled ("profiled") from the
/// first reading at this share of its use at the failure: vLLM sizes its
/// pool from the memory free at that point.
pub const PROFILED_SHARE: f64 = 0.9;

/// Another process that took less than this after the pool was sized is
/// noise (NVML and MemAvailable move by tens of MiB on their own).
pub const MIN_TAKEN_BYTES: u64 = 256 * MIB;

/// vLLM's `gpu_memory_utilization` when the command line does not set it
/// (vLLM's CacheConfig default).
pub const VLLM_DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// One reading of the pool, from the runtime's context (the vLLM plugin's
/// `kv_cache_usage`, or the KV bytes against the capacity).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolReading {
    pub time_ns: i64,
    /// 0..1.
    pub usage: f64,
    pub running: u64,
    pub waiting: u64,
    /// Preemptions since the runtime started (cumulative), where reported.
    pub preemptions: Option<f64>,
    pub capacity_bytes: u64,
}

/// How full the KV pool was, 0..1: the runtime's own figure, else its
/// bytes against its capacity.
pub fn usage(c: &pb::RequestContext) -> Option<f64> {
    c.numbers
        .get("kv_cache_usage")
        .copied()
        .filter(|u| u.is_finite())
        .or_else(|| {
            (c.kv_cache_capacity_bytes > 0)
                .then(|| c.kv_cache_bytes as f64 / c.kv_cache_capacity_bytes as f64)
        })
}

/// The pool's readings, oldest first: samples whose context says how full
/// it was, each once (an unchanged context repeated by later samples is one
/// reading).
pub fn readings(e: &Evidence) -> Vec<PoolReading> {
    let mut out: Vec<PoolReading> = e
        .samples
        .iter()
        .filter_map(|s| {
            let c = s.context.as_ref()?;
            let usage = usage(c)?;
            Some(PoolReading {
                time_ns: s.time_ns,
                usage,
                running: c.active_sequences,
                waiting: c.queued,
                preemptions: c.numbers.get("preemptions").copied(),
                capacity_bytes: c.kv_cache_capacity_bytes,
            })
        })
        .collect();
    out.sort_by_key(|r| r.time_ns);
    // A runtime that stops reporting when idle leaves its last reading in
    // the context: a repeat of it is no new reading.
    out.dedup_by(|later, earlier| {
        (later.usage, later.running, later.waiting, later.preemptions)
            == (
                earlier.usage,
                earlier.running,
                earlier.waiting,
                earlier.preemptions,
            )
    });
    out
}

/// The preemptions at each reading: the rise of the runtime's cumulative
/// counter since the previous reading that carried it (0 for the first). A
/// counter that falls belongs to a restarted runtime, counting from zero:
/// its value is what it preempted since, never the old count taken away.
pub fn preemptions_at(readings: &[PoolReading]) -> Vec<f64> {
    let mut last: Option<f64> = None;
    readings
        .iter()
        .map(|r| {
            let Some(now) = r.preemptions.filter(|p| p.is_finite()) else {
                return 0.0;
            };
            let rise = match last {
                Some(before) if now >= before => now - before,
                Some(_) => now,
                None => 0.0,
            };
            last = Some(now);
            rise
        })
        .collect()
}

/// The pool's size, where the runtime reported it (the largest seen: a pool
/// is reserved once).
pub fn pool_bytes(e: &Evidence) -> Option<u64> {
    let from_oom = e.events.iter().filter_map(|ev| match &ev.kind {
        Some(Kind::Oom(o)) => o.context.as_ref().and_then(own_pool_bytes),
        _ => None,
    });
    e.samples
        .iter()
        .filter_map(|s| s.context.as_ref().and_then(own_pool_bytes))
        .chain(from_oom)
        .max()
}

/// The pool a context's process holds: its capacity, else (a vLLM GPU
/// worker, whose plugin reads its own share of the pool) `vllm.kv_pool_bytes`.
pub fn own_pool_bytes(c: &pb::RequestContext) -> Option<u64> {
    Some(c.kv_cache_capacity_bytes)
        .filter(|&b| b > 0)
        .or_else(|| {
            c.numbers
                .get("vllm.kv_pool_bytes")
                .filter(|b| b.is_finite() && **b >= 1.0)
                .map(|&b| b as u64)
        })
}

/// The plugin's name for what a command-line setting resolved to: the vLLM
/// plugin reports the engine's config (`vllm.max_num_seqs`, ...), which
/// holds the value in force even where the command line left the default.
const RESOLVED: &[(&str, &str)] = &[
    ("--max-num-seqs", "vllm.max_num_seqs"),
    ("--gpu-memory-utilization", "vllm.gpu_memory_utilization"),
    ("--max-model-len", "vllm.max_model_len"),
    ("--max-num-batched-tokens", "vllm.max_num_batched_tokens"),
    ("--kv-cache-memory-bytes", "vllm.kv_cache_memory_bytes"),
    ("--kv-cache-dtype", "vllm.kv_cache_dtype"),
];

/// The newest number the runtime reported under `key` (context numbers).
pub fn reported(e: &Evidence, key: &str) -> Option<f64> {
    e.samples
        .iter()
        .rev()
        .filter_map(|s| s.context.as_ref())
        .find_map(|c| c.numbers.get(key).copied())
        .filter(|v| v.is_finite())
}

/// The newest text the runtime reported under `key` (context labels, else the Hello's).
pub fn reported_label(e: &Evidence, key: &str) -> Option<String> {
    e.samples
        .iter()
        .rev()
        .filter_map(|s| s.context.as_ref())
        .find_map(|c| c.labels.get(key).cloned())
        .or_else(|| e.hello.as_ref()?.labels.get(key).cloned())
        .filter(|v| !v.is_empty())
}

/// What the runtime reported a setting resolved to, as text ("256", "auto").
pub fn resolved(e: &Evidence, setting: &Setting) -> Option<String> {
    let (_, key) = RESOLVED.iter().find(|(n, _)| *n == setting.name)?;
    reported(e, key)
        .map(number)
        .or_else(|| reported_label(e, key))
}

/// A runtime named by what its agent reported: the vLLM plugin's `vllm.*` numbers.
pub fn reported_runtime(e: &Evidence) -> Option<Runtime> {
    e.samples
        .iter()
        .filter_map(|s| s.context.as_ref())
        .any(|c| c.numbers.keys().any(|k| k.starts_with("vllm.")))
        .then_some(Runtime::Vllm)
}

/// "256", "0.9": a number without a needless fraction.
pub fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// `x` rounded down to a multiple of `step` (a proposal never rounds up into
/// the margin it was given).
pub fn floor_to(x: f64, step: f64) -> f64 {
    // The small epsilon keeps 0.5 from reading as 0.4999999.
    ((x / step) + 1e-9).floor() * step
}

/// The KV reservation the settings ask for, in bytes, and the setting that
/// asks: `--kv-cache-memory-bytes` where given, else `VLLM_CPU_KVCACHE_SPACE`
/// (GiB).
pub fn kv_request(s: &Settings) -> Option<(&'static Setting, u64)> {
    let (setting, value) = s.get(Knob::KvCacheSize).filter(|(s, _)| in_bytes(s))?;
    let bytes = match setting.unit {
        "GiB" => value.trim().parse::<f64>().ok()? * GIB,
        _ => parse_size(value)?,
    };
    (bytes > 0.0).then_some((setting, bytes as u64))
}

/// The setting that sizes a host-side KV pool for a proposal: the one set,
/// else the runtime's variable for it (vLLM's CPU backend reads
/// `VLLM_CPU_KVCACHE_SPACE`).
pub fn kv_setting(s: &Settings) -> Option<&'static Setting> {
    if let Some((setting, _)) = s.get(Knob::KvCacheSize).filter(|(s, _)| in_bytes(s)) {
        return Some(setting);
    }
    s.named("VLLM_CPU_KVCACHE_SPACE")
        .map(|(setting, _)| setting)
        .or_else(|| s.setting(Knob::KvCacheSize).filter(|s| in_bytes(s)))
}

/// A KV size setting in bytes or GiB (not one in tokens or blocks, which
/// `token_pool` scales instead).
fn in_bytes(s: &Setting) -> bool {
    matches!(s.unit, "bytes" | "GiB")
}

/// The setting that sizes the KV pool in tokens or blocks, with its value:
/// a size in tokens or blocks where set (SGLang's `--max-total-tokens`,
/// TGI's `--max-batch-total-tokens`, `transformers serve`'s
/// `--cb-num-blocks`), else the context where the runtime reserves the pool
/// for its whole context (llama.cpp: `--ctx-size` × slots). The pool's bytes
/// scale with it.
pub fn token_pool(s: &Settings) -> Option<(&'static Setting, f64)> {
    let value = |(setting, v): (&'static Setting, &str)| {
        parse_count(v).filter(|&n| n > 0.0).map(|n| (setting, n))
    };
    if let Some(sized) = s
        .get(Knob::KvCacheSize)
        .filter(|(setting, _)| !in_bytes(setting))
        .and_then(value)
    {
        return Some(sized);
    }
    match s.runtime? {
        Runtime::LlamaCpp | Runtime::LlamaCppPython => s.get(Knob::MaxContext).and_then(value),
        _ => None,
    }
}

/// "32768", "32k", "1K" as a number: vLLM reads human-readable counts, a
/// lower-case suffix decimal (1k = 1000), an upper-case one binary (1K = 1024).
pub fn parse_count(v: &str) -> Option<f64> {
    let v = v.trim();
    let (n, scale) = match v.chars().last()? {
        'k' => (&v[..v.len() - 1], 1e3),
        'K' => (&v[..v.len() - 1], 1024.0),
        'm' => (&v[..v.len() - 1], 1e6),
        'M' => (&v[..v.len() - 1], 1024.0 * 1024.0),
        _ => (v, 1.0),
    };
    n.parse::<f64>().ok().map(|n| n * scale)
}

/// The KV pool the runtime said it reserved, in bytes: llama.cpp logs each
/// KV buffer as it allocates it ("llama_kv_cache_unified: CPU KV buffer size
/// = 4096.00 MiB"), before filling it, so the line stands even where the
/// kernel killed it filling the pool; the buffers of the last start (one
/// per device, logged in a row) are summed. Builds that log no buffers say
/// "KV self size = … MiB" once the pool is made.
pub fn logged_kv_bytes(stderr: &str) -> Option<u64> {
    let (mut run, mut buffers, mut total) = (0.0, None, None);
    for line in stderr.lines() {
        let lower = line.to_ascii_lowercase();
        match figure_after(line, &lower, "kv buffer size") {
            Some(b) => {
                run += b;
                buffers = Some(run);
            }
            None => run = 0.0,
        }
        if let Some(b) = figure_after(line, &lower, "kv self size") {
            total = Some(b);
        }
    }
    buffers.or(total).filter(|&b| b > 0.0).map(|b| b as u64)
}

/// "= 4096.00 MiB" after `marker` (matched in `lower`) as bytes.
fn figure_after(line: &str, lower: &str, marker: &str) -> Option<f64> {
    let rest = line[lower.find(marker)? + marker.len()..]
        .trim_start()
        .strip_prefix('=')?;
    let mut w = rest.split_whitespace();
    let n = w.next()?.trim_end_matches(',');
    let unit = w.next().unwrap_or("B").trim_end_matches(',');
    parse_size(&format!("{n}{unit}"))
}

/// "4294967296", "4G", "4GiB", "1.5 GB" as bytes (binary units).
pub fn parse_size(v: &str) -> Option<f64> {
    let v = v.trim();
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    let n: f64 = v[..split].parse().ok()?;
    let unit = v[split..].trim().to_ascii_lowercase();
    let scale = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "" => 1.0,
        "k" => 1024.0,
        "m" => 1024.0 * 1024.0,
        "g" => GIB,
        "t" => GIB * 1024.0,
        _ => return None,
    };
    Some(n * scale)
}

/// The final climb to a limit: from the last reading back while each
/// reading rose steeply over the one before (see `final_climb`).
#[derive(Clone, Debug, PartialEq)]
pub struct Climb {
    /// Usage just before the climb: what the rest of the process tree held.
    pub rest_bytes: u64,
    /// Usage at the top of the climb (the last reading before the kill).
    pub top_bytes: u64,
    /// Readings in the climb (after the one it starts from).
    pub steps: usize,
    pub from_ns: i64,
    pub to_ns: i64,
}

/// A step of the final climb rises at least this share of the steepest step
/// after it. Start-up rises too (imports, weights, a worker's runtime: tens of
/// MiB per reading for seconds), and with no pause before the pool it joined
/// the climb: vLLM's CPU worker went 548 MiB -> 1711 MiB in 12 s of such steps,
/// then 1711 -> 1798 -> 2249 MiB filling the pool.
pub const CLIMB_STEEP_SHARE: f64 = 0.1;

/// The climb at the end of `series` (time, usage), oldest first. Readings
/// that fell at the very end (taken as the kill freed memory) are left out.
/// Walking back, a reading belongs to the climb while it rose more than
/// `CLIMB_MIN_STEP_BYTES` and at least `CLIMB_STEEP_SHARE` of the steepest
/// step after it. Where the pool's size is known, the climb (its filling)
/// rose no more than the pool: it starts no earlier than `top - pool`.
/// None without at least one rising step: the samples missed the climb.
pub fn final_climb(series: &[(i64, u64)], pool_bytes: Option<u64>) -> Option<Climb> {
    let mut end = series.len().checked_sub(1)?;
    while end > 0 && series[end].1 < series[end - 1].1 {
        end -= 1;
    }
    let top = series[end].1;
    let mut start = end;
    let mut steepest = 0u64;
    while start > 0 {
        let before = series[start - 1].1;
        let step = series[start].1.saturating_sub(before);
        let floor = CLIMB_MIN_STEP_BYTES.max((steepest as f64 * CLIMB_STEEP_SHARE) as u64);
        // An earlier reading may stand above the top (memory freed before the climb).
        let past_pool = pool_bytes.is_some_and(|p| top.saturating_sub(before) > p);
        if step <= floor || past_pool {
            break;
        }
        steepest = steepest.max(step);
        start -= 1;
    }
    (start < end).then(|| Climb {
        rest_bytes: series[start].1,
        top_bytes: top,
        steps: end - start,
        from_ns: series[start].0,
        to_ns: series[end].0,
    })
}

/// The usage series of the cgroup level whose limit the kernel hit (by
/// path, else the tightest limit), up to `until_ns`, and that level's limit.
pub fn cgroup_series(
    e: &Evidence,
    oom_memcg: &str,
    until_ns: i64,
) -> (Vec<(i64, u64)>, Option<u64>) {
    let pick = |s: &pb::Sample| -> Option<(u64, u64)> {
        let by_path = s.cgroup.iter().find(|l| {
            !l.path.is_empty()
                && (oom_memcg == l.path || oom_memcg.ends_with(&l.path) && l.path != "/")
        });
        let level = by_path.or_else(|| {
            s.cgroup
                .iter()
                .filter(|l| crate::evidence::is_finite_limit(l.limit_bytes))
                .min_by_key(|l| l.limit_bytes)
        })?;
        (level.usage_bytes > 0).then_some((level.usage_bytes, level.limit_bytes))
    };
    let mut limit = None;
    let mut series: Vec<(i64, u64)> = e
        .samples
        .iter()
        .filter(|s| s.time_ns <= until_ns)
        .filter_map(|s| {
            let (usage, l) = pick(s)?;
            if crate::evidence::is_finite_limit(l) {
                limit = Some(l);
            }
            Some((s.time_ns, usage))
        })
        .collect();
    series.sort_by_key(|(t, _)| *t);
    (series, limit)
}

/// A request was served or running before `t_ns`: start-up was over.
pub fn served_before(e: &Evidence, t_ns: i64) -> bool {
    let boundary = e
        .events
        .iter()
        .any(|ev| ev.time_ns < t_ns && matches!(ev.kind, Some(Kind::Request(_))));
    let context = e.samples.iter().filter(|s| s.time_ns < t_ns).any(|s| {
        s.context
            .as_ref()
            .is_some_and(|c| c.requests_done > 0 || c.active_sequences > 0)
    });
    boundary || context
}

/// The figures in a runtime's KV text, where it gives them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TextFigures {
    /// Memory available (free) when the runtime checked.
    pub available_bytes: Option<u64>,
    /// The node's or device's total.
    pub total_bytes: Option<u64>,
    /// What the runtime asked for (the KV reservation, or its memory share).
    pub requested_bytes: Option<u64>,
    /// The memory share asked for (vLLM's gpu_memory_utilization).
    pub fraction: Option<f64>,
    /// Tokens the KV cache can hold (vLLM's context_over_kv texts).
    pub kv_tokens: Option<u64>,
    /// The context asked for (max_model_len).
    pub context_tokens: Option<u64>,
}

/// Reads vLLM's KV texts:
/// "Available memory on node 0 (20.88/23.54 GiB) … less than requested memory for kv (40.0 GiB)",
/// "Free memory on device (6.9/8.0 GiB) on startup is less than desired GPU memory utilization (0.9, 7.2 GiB)",
/// "The model's max seq len (32768) is larger than the maximum number of tokens that can be stored in KV cache (19632)",
/// "… the estimated maximum model length is 58148."
pub fn text_figures(line: &str) -> TextFigures {
    let mut t = TextFigures::default();
    let lower = line.to_ascii_lowercase();
    for marker in ["available memory on node", "free memory on device"] {
        if let Some(inner) = paren_after(line, &lower, marker) {
            if let Some((a, b)) = inner.split_once('/') {
                let unit = b.split_whitespace().nth(1).unwrap_or("B");
                t.available_bytes = size(a.trim(), unit);
                t.total_bytes = parse_size(&b.replace(' ', "")).map(|v| v as u64);
            }
        }
    }
    if let Some(inner) = paren_after(line, &lower, "requested memory for kv") {
        t.requested_bytes = parse_size(&inner.replace(' ', "")).map(|v| v as u64);
    }
    if let Some(inner) = paren_after(line, &lower, "desired gpu memory utilization") {
        if let Some((f, b)) = inner.split_once(',') {
            t.fraction = f.trim().parse().ok();
            t.requested_bytes = parse_size(&b.replace(' ', "")).map(|v| v as u64);
        }
    }
    if let Some(inner) = paren_after(line, &lower, "stored in kv cache") {
        t.kv_tokens = inner.trim().parse().ok();
    }
    if let Some(inner) = paren_after(line, &lower, "max seq len") {
        t.context_tokens = inner.trim().parse().ok();
    }
    if let Some(i) = lower.find("estimated maximum model length is") {
        let rest = &line[i + "estimated maximum model length is".len()..];
        let digits: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        t.kv_tokens = digits.parse().ok().or(t.kv_tokens);
    }
    t
}

/// "20.88" in `unit` ("GiB") as bytes.
fn size(n: &str, unit: &str) -> Option<u64> {
    parse_size(&format!("{n}{unit}")).map(|v| v as u64)
}

/// The text inside the first parentheses after `marker` (matched in `lower`).
fn paren_after<'a>(line: &'a str, lower: &str, marker: &str) -> Option<&'a str> {
    let i = lower.find(marker)? + marker.len();
    let open = line[i..].find('(')? + i + 1;
    let close = line[open..].find(')')? + open;
    Some(&line[open..close])
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB_F: u64 = 1 << 20;

    #[test]
    fn each_runtime_sizes_its_pool_in_its_own_count() {
        let pool = |c: &str| {
            let argv: Vec<String> = c.split_whitespace().map(str::to_string).collect();
            let s = crate::settings::parse(&argv, &Default::default());
            token_pool(&s).map(|(setting, n)| (s.spelling(setting).to_string(), n))
        };
        let some = |flag: &str, n: f64| Some((flag.to_string(), n));
        assert_eq!(
            pool("python3 -m sglang.launch_server --model-path m --max-total-tokens 20000"),
            some("--max-total-tokens", 20000.0)
        );
        assert_eq!(
            pool("text-generation-launcher --model-id m --max-batch-total-tokens 16000"),
            some("--max-batch-total-tokens", 16000.0)
        );
        assert_eq!(
            pool("transformers serve m --continuous-batching --cb-num-blocks 512"),
            some("--cb-num-blocks", 512.0)
        );
        assert_eq!(
            pool("llama-server -m x.gguf -c 8192 -np 4"),
            some("-c", 8192.0)
        );
        assert_eq!(
            pool("python -m llama_cpp.server --model x --n_ctx=4096"),
            some("--n_ctx", 4096.0)
        );
        // A context that is not the pool's size (vLLM sizes it in bytes), or none set.
        assert_eq!(pool("vllm serve m --max-model-len 4096"), None);
        assert_eq!(pool("llama-server -m x.gguf"), None);
        assert_eq!(
            pool("python3 -m sglang.launch_server --model-path m --context-length 4096"),
            None
        );
    }

    #[test]
    fn the_kv_pool_llama_cpp_logged_is_read_from_its_stderr() {
        let one = "print_info: n_layer = 32\nllama_kv_cache_unified:        CPU KV buffer size =  4096.00 MiB\n";
        assert_eq!(logged_kv_bytes(one), Some(4096 * MIB_F));
        // One buffer per device, in a row; an earlier start does not count.
        let split = "llama_kv_cache_init:      CPU KV buffer size =    64.00 MiB\nstarting\nllama_kv_cache_init:      CUDA0 KV buffer size =  1024.00 MiB\nllama_kv_cache_init:      CUDA1 KV buffer size =  1024.00 MiB\nllama_new_context_with_model: KV self size  = 2048.00 MiB, K (f16): 1024.00 MiB, V (f16): 1024.00 MiB\n";
        assert_eq!(logged_kv_bytes(split), Some(2048 * MIB_F));
        assert_eq!(
            logged_kv_bytes(
                "llama_new_context_with_model: KV self size  =  256.00 MiB, K (f16):  128.00 MiB"
            ),
            Some(256 * MIB_F)
        );
        assert_eq!(logged_kv_bytes("no pool here"), None);
        assert_eq!(parse_count("32k"), Some(32000.0));
        assert_eq!(parse_count("32K"), Some(32768.0));
        assert_eq!(parse_count("32768"), Some(32768.0));
    }

    #[test]
    fn the_final_climb_starts_where_usage_stopped_rising_fast() {
        let g = |x: f64| (x * GIB) as u64;
        // Settled at 1.6 GiB (a few KiB of noise), then the pool filled.
        let series = vec![
            (1, g(1.2)),
            (2, g(1.6)),
            (3, g(1.6) + 200_000),
            (4, g(1.6) + 100_000),
            (5, g(1.8)),
            (6, g(2.0)),
            (7, g(2.2)),
        ];
        let c = final_climb(&series, None).unwrap();
        assert_eq!(
            (c.rest_bytes, c.top_bytes, c.steps),
            (g(1.6) + 100_000, g(2.2), 3)
        );
        // A reading after the kill freed memory is not the top.
        let mut after = series.clone();
        after.push((8, g(0.9)));
        assert_eq!(final_climb(&after, None), Some(c));
        // Flat to the end: no climb caught.
        assert_eq!(final_climb(&[(1, g(1.0)), (2, g(1.0) + MIB_F)], None), None);
    }

    /// vLLM 0.32's CPU worker under a 2,250 MiB limit with a 1 GiB pool, as
    /// its supervisor read the cgroup every 250 ms (MiB): start-up rose by
    /// 5-186 MiB a reading for 12 s without a pause, then the pool.
    const VLLM_START_THEN_POOL_MIB: [u64; 48] = [
        571, 740, 820, 855, 875, 908, 930, 946, 966, 978, 999, 1015, 1020, 1027, 1031, 1048, 1062,
        1077, 1100, 1114, 1125, 1137, 1323, 1368, 1391, 1409, 1442, 1466, 1479, 1497, 1508, 1529,
        1544, 1549, 1555, 1559, 1574, 1591, 1597, 1621, 1636, 1651, 1656, 1668, 1706, 1711, 1798,
        2249,
    ];

    #[test]
    fn start_up_rising_right_before_the_pool_is_not_the_pool() {
        let series: Vec<(i64, u64)> = VLLM_START_THEN_POOL_MIB
            .iter()
            .enumerate()
            .map(|(i, m)| (i as i64 * 250_000_000, m * MIB))
            .collect();
        let c = final_climb(&series, None).unwrap();
        assert_eq!(
            (c.rest_bytes, c.top_bytes, c.steps),
            (1711 * MIB, 2249 * MIB, 2)
        );
        // Evenly rising to the end (start-up as steep as the fill): the
        // known pool bounds the climb.
        let even: Vec<(i64, u64)> = (0..40).map(|i| (i, (500 + 50 * i as u64) * MIB)).collect();
        assert_eq!(final_climb(&even, None).unwrap().rest_bytes, 500 * MIB);
        let bounded = final_climb(&even, Some(1024 * MIB)).unwrap();
        assert_eq!((bounded.rest_bytes, bounded.steps), (1450 * MIB, 20));
        assert!(bounded.top_bytes - bounded.rest_bytes <= 1024 * MIB);
        // A reading above the top before the climb (memory freed, then the
        // pool): the climb starts after it, with or without a known pool.
        let freed = [(0, 3000 * MIB), (1, 1700 * MIB), (2, 2200 * MIB)];
        for pool in [None, Some(1024 * MIB)] {
            let c = final_climb(&freed, pool).unwrap();
            assert_eq!((c.rest_bytes, c.steps), (1700 * MIB, 1), "{pool:?}");
        }
    }

    #[test]
    fn vllm_kv_texts_give_their_figures() {
        let cpu = text_figures("ValueError: Available memory on node 0 (20.88/23.54 GiB) on kv cache allocation is less than requested memory for kv (40.0 GiB). Decrease --kv-cache-memory-bytes");
        assert_eq!(cpu.available_bytes, Some((20.88 * GIB) as u64));
        assert_eq!(cpu.total_bytes, Some((23.54 * GIB) as u64));
        assert_eq!(cpu.requested_bytes, Some(40 << 30));
        let gpu = text_figures("ValueError: Free memory on device (6.9/8.0 GiB) on startup is less than desired GPU memory utilization (0.9, 7.2 GiB).");
        assert_eq!(gpu.fraction, Some(0.9));
        assert_eq!(gpu.total_bytes, Some(8 << 30));
        assert_eq!(gpu.requested_bytes, Some((7.2 * GIB) as u64));
        let ctx = text_figures("ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be stored in KV cache (19632). Try increasing");
        assert_eq!(
            (ctx.context_tokens, ctx.kv_tokens),
            (Some(32768), Some(19632))
        );
        let est = text_figures("ValueError: To serve at least one request with the model's max seq len (131072), 52.66 GiB KV cache is needed, which is larger than the available KV cache memory (23.37 GiB). Based on the available memory, the estimated maximum model length is 58148.");
        assert_eq!(
            (est.context_tokens, est.kv_tokens),
            (Some(131072), Some(58148))
        );
    }

    #[test]
    fn sizes_and_rounding() {
        assert_eq!(parse_size("4294967296"), Some(4294967296.0));
        assert_eq!(parse_size("4GiB"), Some(4.0 * GIB));
        assert_eq!(parse_size("512M"), Some(512.0 * 1024.0 * 1024.0));
        assert_eq!(floor_to(0.549, 0.1), 0.5);
        assert!((floor_to(0.5, 0.1) - 0.5).abs() < 1e-12);
        assert_eq!(number(256.0), "256");
        assert_eq!(number(0.85), "0.85");
    }
}
