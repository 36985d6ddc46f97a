//! The runtime's own settings, read from the command line it was started
//! with (and the environment variables it reads), so that a fix can name the
//! flag a user actually types, with its current value, and `compare` can
//! name the one flag that changed between two runs.
//!
//! One table per runtime lists the settings that size memory. Everything
//! else on the command line is kept too, by its own flag name, except what
//! says where the server listens (ports and hosts), which is never a memory
//! variable.

use std::collections::BTreeMap;

use crate::launch;
use crate::pb;

/// A serving runtime whose settings oomscope knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Runtime {
    Vllm,
    Sglang,
    LlamaCpp,
    /// llama.cpp's Python bindings' server (`python -m llama_cpp.server`):
    /// the same engine, its own flags (`--n_ctx`, `--n_gpu_layers`).
    LlamaCppPython,
    Tgi,
    /// Hugging Face's `transformers serve`.
    TransformersServe,
    /// oomscope's reference PyTorch server (runtimes/pytorch-server).
    ReferencePytorch,
    /// oomscope's reference Rust server (runtimes/rust-server).
    ReferenceRust,
    /// Any other PyTorch process.
    Pytorch,
    Unknown,
}

impl Runtime {
    /// The runtime's name as its users write it.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Vllm => "vLLM",
            Runtime::Sglang => "SGLang",
            Runtime::LlamaCpp => "llama.cpp",
            Runtime::LlamaCppPython => "llama-cpp-python",
            Runtime::Tgi => "TGI",
            Runtime::TransformersServe => "transformers serve",
            Runtime::ReferencePytorch => "the reference PyTorch server",
            Runtime::ReferenceRust => "the reference Rust server",
            Runtime::Pytorch => "PyTorch",
            Runtime::Unknown => "the server",
        }
    }

    /// It reserves its KV cache as one pool at start-up (rather than growing
    /// it with tokens): its OOMs come at the reservation, beside the pool,
    /// or from others taking memory after it sized the pool.
    pub fn preallocates_kv(self) -> bool {
        matches!(
            self,
            Runtime::Vllm | Runtime::Sglang | Runtime::LlamaCpp | Runtime::LlamaCppPython
        )
    }

    /// The runtime a memory text's table entry names ("vLLM", ...).
    pub fn from_name(name: &str) -> Option<Runtime> {
        [
            Runtime::Vllm,
            Runtime::Sglang,
            Runtime::LlamaCpp,
            Runtime::LlamaCppPython,
            Runtime::Tgi,
            Runtime::TransformersServe,
        ]
        .into_iter()
        .find(|r| r.name().eq_ignore_ascii_case(name) || r.agent_name() == Some(name))
    }

    /// How an agent names the runtime in `Hello.runtime` (the vLLM plugin's "vllm").
    fn agent_name(self) -> Option<&'static str> {
        match self {
            Runtime::Vllm => Some("vllm"),
            Runtime::Sglang => Some("sglang"),
            Runtime::LlamaCpp => Some("llama.cpp"),
            Runtime::Tgi => Some("tgi"),
            _ => None,
        }
    }
}

/// What one memory setting is for, so that a fix can pick it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Knob {
    /// The share of the device the runtime takes for itself (weights + KV + activations).
    MemoryFraction,
    /// The KV cache reservation, in bytes or GiB.
    KvCacheSize,
    /// How many sequences run at once.
    MaxSequences,
    /// Tokens per scheduler step (batch of prefill tokens).
    MaxBatchTokens,
    /// The longest context accepted.
    MaxContext,
    /// The KV cache's element type (fp8 halves it).
    KvCacheDtype,
    /// Skips CUDA graphs and compilation (less memory, slower).
    Eager,
    /// How many batch sizes are captured as CUDA graphs (each holds memory
    /// outside PyTorch's allocator).
    CudaGraphs,
    /// NCCL's communication buffers (outside PyTorch's allocator).
    CommBuffers,
    /// cuBLAS's workspaces (outside PyTorch's allocator).
    Workspaces,
    /// Layers on the GPU (llama.cpp).
    GpuLayers,
    /// Prefill chunk size.
    PrefillChunk,
    /// The caching allocator's configuration.
    AllocatorConf,
    /// Tokens per KV block, where the pool is sized in blocks.
    KvBlockSize,
}

/// One known memory setting of a runtime: its flag (or variable) and what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub runtime: Runtime,
    /// The flag as typed (`--max-num-seqs`) or the variable (`VLLM_CPU_KVCACHE_SPACE`).
    pub name: &'static str,
    pub knob: Knob,
    /// The unit its value is in, for a proposed value.
    pub unit: &'static str,
}

const fn s(runtime: Runtime, name: &'static str, knob: Knob, unit: &'static str) -> Setting {
    Setting {
        runtime,
        name,
        knob,
        unit,
    }
}

/// The memory settings of each runtime (from each runtime's documented CLI).
pub const SETTINGS: &[Setting] = &[
    s(
        Runtime::Vllm,
        "--gpu-memory-utilization",
        Knob::MemoryFraction,
        "fraction",
    ),
    s(
        Runtime::Vllm,
        "--kv-cache-memory-bytes",
        Knob::KvCacheSize,
        "bytes",
    ),
    s(
        Runtime::Vllm,
        "VLLM_CPU_KVCACHE_SPACE",
        Knob::KvCacheSize,
        "GiB",
    ),
    s(
        Runtime::Vllm,
        "--max-num-seqs",
        Knob::MaxSequences,
        "sequences",
    ),
    s(
        Runtime::Vllm,
        "--max-num-batched-tokens",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    s(Runtime::Vllm, "--max-model-len", Knob::MaxContext, "tokens"),
    s(
        Runtime::Vllm,
        "--kv-cache-dtype",
        Knob::KvCacheDtype,
        "dtype",
    ),
    s(Runtime::Vllm, "--enforce-eager", Knob::Eager, "switch"),
    s(
        Runtime::Vllm,
        "--max-cudagraph-capture-size",
        Knob::CudaGraphs,
        "tokens",
    ),
    s(
        Runtime::Vllm,
        "--cudagraph-capture-sizes",
        Knob::CudaGraphs,
        "sizes",
    ),
    s(
        Runtime::Sglang,
        "--mem-fraction-static",
        Knob::MemoryFraction,
        "fraction",
    ),
    s(
        Runtime::Sglang,
        "--max-running-requests",
        Knob::MaxSequences,
        "sequences",
    ),
    s(
        Runtime::Sglang,
        "--context-length",
        Knob::MaxContext,
        "tokens",
    ),
    // The KV pool in tokens, where set (else sized from --mem-fraction-static).
    s(
        Runtime::Sglang,
        "--max-total-tokens",
        Knob::KvCacheSize,
        "tokens",
    ),
    s(
        Runtime::Sglang,
        "--max-prefill-tokens",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    s(
        Runtime::Sglang,
        "--chunked-prefill-size",
        Knob::PrefillChunk,
        "tokens",
    ),
    s(
        Runtime::Sglang,
        "--kv-cache-dtype",
        Knob::KvCacheDtype,
        "dtype",
    ),
    s(
        Runtime::Sglang,
        "--cuda-graph-max-bs",
        Knob::CudaGraphs,
        "sequences",
    ),
    s(
        Runtime::Sglang,
        "--disable-cuda-graph",
        Knob::Eager,
        "switch",
    ),
    s(Runtime::LlamaCpp, "--ctx-size", Knob::MaxContext, "tokens"),
    s(Runtime::LlamaCpp, "--parallel", Knob::MaxSequences, "slots"),
    s(
        Runtime::LlamaCpp,
        "--cache-type-k",
        Knob::KvCacheDtype,
        "dtype",
    ),
    s(
        Runtime::LlamaCpp,
        "--cache-type-v",
        Knob::KvCacheDtype,
        "dtype",
    ),
    s(Runtime::LlamaCpp, "--flash-attn", Knob::Eager, "switch"),
    s(
        Runtime::LlamaCpp,
        "--n-gpu-layers",
        Knob::GpuLayers,
        "layers",
    ),
    s(
        Runtime::LlamaCpp,
        "--batch-size",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    s(
        Runtime::LlamaCpp,
        "--ubatch-size",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    // llama-cpp-python's server: pydantic settings, flags by field name
    // (its docs: `python3 -m llama_cpp.server --model M --n_gpu_layers 35`).
    s(
        Runtime::LlamaCppPython,
        "--n_ctx",
        Knob::MaxContext,
        "tokens",
    ),
    s(
        Runtime::LlamaCppPython,
        "--n_gpu_layers",
        Knob::GpuLayers,
        "layers",
    ),
    s(
        Runtime::LlamaCppPython,
        "--n_batch",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    s(
        Runtime::LlamaCppPython,
        "--n_ubatch",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    // A ggml type number (8 = q8_0), not a name.
    s(
        Runtime::LlamaCppPython,
        "--type_k",
        Knob::KvCacheDtype,
        "ggml type",
    ),
    s(
        Runtime::LlamaCppPython,
        "--type_v",
        Knob::KvCacheDtype,
        "ggml type",
    ),
    // TGI sizes its KV reservation in tokens (`--max-batch-total-tokens`).
    s(
        Runtime::Tgi,
        "--max-batch-total-tokens",
        Knob::KvCacheSize,
        "tokens",
    ),
    s(
        Runtime::Tgi,
        "--max-input-tokens",
        Knob::MaxContext,
        "tokens",
    ),
    s(
        Runtime::Tgi,
        "--max-total-tokens",
        Knob::MaxContext,
        "tokens",
    ),
    s(
        Runtime::Tgi,
        "--max-batch-prefill-tokens",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    s(
        Runtime::Tgi,
        "--max-concurrent-requests",
        Knob::MaxSequences,
        "requests",
    ),
    s(
        Runtime::Tgi,
        "--kv-cache-dtype",
        Knob::KvCacheDtype,
        "dtype",
    ),
    s(
        Runtime::TransformersServe,
        "--max-model-len",
        Knob::MaxContext,
        "tokens",
    ),
    // With `--continuous-batching`: the paged KV cache, in blocks of `--cb-block-size` tokens.
    s(
        Runtime::TransformersServe,
        "--cb-num-blocks",
        Knob::KvCacheSize,
        "blocks",
    ),
    s(
        Runtime::TransformersServe,
        "--cb-block-size",
        Knob::KvBlockSize,
        "tokens",
    ),
    s(
        Runtime::TransformersServe,
        "--cb-max-batch-tokens",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    s(
        Runtime::TransformersServe,
        "--cb-max-memory-percent",
        Knob::MemoryFraction,
        "fraction",
    ),
    s(
        Runtime::Tgi,
        "--cuda-memory-fraction",
        Knob::MemoryFraction,
        "fraction",
    ),
    s(
        Runtime::ReferencePytorch,
        "--max-active",
        Knob::MaxSequences,
        "sequences",
    ),
    s(
        Runtime::ReferencePytorch,
        "--max-context",
        Knob::MaxContext,
        "tokens",
    ),
    s(
        Runtime::ReferencePytorch,
        "--max-total-tokens",
        Knob::MaxBatchTokens,
        "tokens",
    ),
    s(
        Runtime::ReferencePytorch,
        "--memory-cap",
        Knob::MemoryFraction,
        "fraction",
    ),
    s(
        Runtime::ReferenceRust,
        "--max-active",
        Knob::MaxSequences,
        "sequences",
    ),
    s(
        Runtime::ReferenceRust,
        "--capacity",
        Knob::KvCacheSize,
        "bytes",
    ),
    s(
        Runtime::Pytorch,
        "PYTORCH_CUDA_ALLOC_CONF",
        Knob::AllocatorConf,
        "options",
    ),
    s(
        Runtime::Pytorch,
        "NCCL_BUFFSIZE",
        Knob::CommBuffers,
        "bytes",
    ),
    s(
        Runtime::Pytorch,
        "CUBLAS_WORKSPACE_CONFIG",
        Knob::Workspaces,
        "options",
    ),
];

/// Other spellings of a setting, per runtime, as each runtime's docs write
/// them: short flags, renamed flags that still work. A long flag is matched
/// with `_` and `-` alike (vLLM, SGLang and argparse-style CLIs take both).
const ALIASES: &[(Runtime, &str, &str)] = &[
    (Runtime::LlamaCpp, "-c", "--ctx-size"),
    (Runtime::LlamaCpp, "--n-ctx", "--ctx-size"),
    (Runtime::LlamaCpp, "-np", "--parallel"),
    (Runtime::LlamaCpp, "-ngl", "--n-gpu-layers"),
    (Runtime::LlamaCpp, "--gpu-layers", "--n-gpu-layers"),
    (Runtime::LlamaCpp, "-b", "--batch-size"),
    (Runtime::LlamaCpp, "-ub", "--ubatch-size"),
    (Runtime::LlamaCpp, "-fa", "--flash-attn"),
    (Runtime::LlamaCpp, "-ctk", "--cache-type-k"),
    (Runtime::LlamaCpp, "-ctv", "--cache-type-v"),
    (Runtime::LlamaCpp, "-m", "--model"),
    (Runtime::LlamaCppPython, "--ctx-size", "--n_ctx"),
    (Runtime::LlamaCppPython, "-c", "--n_ctx"),
    // TGI renamed --max-input-length (still accepted, with a warning).
    (Runtime::Tgi, "--max-input-length", "--max-input-tokens"),
];

/// A long flag with `_` read as `-` (`--max_model_len` is `--max-model-len`).
fn normal(flag: &str) -> String {
    if flag.starts_with("--") {
        flag.replace('_', "-")
    } else {
        flag.to_string()
    }
}

/// The setting's name (or the alias's) that `flag` spells for `runtime`.
fn canonical(runtime: Option<Runtime>, flag: &str) -> String {
    let n = normal(flag);
    let Some(r) = runtime else {
        return n;
    };
    ALIASES
        .iter()
        .filter(|(ar, _, _)| *ar == r)
        .find(|(_, alias, _)| normal(alias) == n)
        .map(|(_, _, name)| (*name).to_string())
        .or_else(|| {
            SETTINGS
                .iter()
                .find(|s| s.runtime == r && normal(s.name) == n)
                .map(|s| s.name.to_string())
        })
        .unwrap_or(n)
}

/// Flags that say where a server listens or logs: never a memory variable.
const NOT_SETTINGS: &[&str] = &[
    "--port",
    "--host",
    "--hostname",
    "--uds",
    "--api-key",
    "--ssl-keyfile",
    "--ssl-certfile",
    "--log-level",
    "--uvicorn-log-level",
];

/// Environment variables that size a runtime's memory, which `oomscope run`
/// records (as `env.NAME` Hello labels) so that fixes can name them.
pub const MEMORY_ENV: &[&str] = &[
    "VLLM_CPU_KVCACHE_SPACE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    // Memory outside PyTorch's allocator: NCCL's buffers, cuBLAS's workspaces.
    "NCCL_BUFFSIZE",
    "CUBLAS_WORKSPACE_CONFIG",
];

/// How `oomscope run` records a memory variable of its environment: the Hello
/// label `env.NAME`.
pub const ENV_LABEL_PREFIX: &str = "env.";

/// A command line read as a runtime's settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    pub runtime: Option<Runtime>,
    /// Every flag (the setting's name where it is one: aliases and `_`
    /// spellings resolved) with its value ("" for a switch), and the memory
    /// variables from the environment.
    pub values: BTreeMap<String, String>,
    /// The flag as the command line typed it (`--n-ctx`, `-c`), by the name
    /// in `values`, where it differs: a fix says it the user's way.
    pub typed: BTreeMap<String, String>,
    /// What is not a flag: the launcher and program (`python3 -m
    /// llama_cpp.server`, `vllm serve`), the model path.
    pub positional: Vec<String>,
}

impl Settings {
    /// The current value of the runtime's setting for `knob`, with the
    /// setting, where the command line set it.
    pub fn get(&self, knob: Knob) -> Option<(&'static Setting, &str)> {
        let runtime = self.runtime?;
        SETTINGS
            .iter()
            .filter(|s| s.knob == knob && (s.runtime == runtime || s.runtime == Runtime::Pytorch))
            .find_map(|s| self.values.get(s.name).map(|v| (s, v.as_str())))
    }

    /// The runtime's setting for `knob`, set or not (the first in the table).
    pub fn setting(&self, knob: Knob) -> Option<&'static Setting> {
        let runtime = self.runtime?;
        SETTINGS
            .iter()
            .find(|s| s.knob == knob && s.runtime == runtime)
    }

    /// The flag or variable as the user types it: the command line's own
    /// spelling where it set the setting, else the setting's name.
    pub fn spelling<'a>(&'a self, s: &'a Setting) -> &'a str {
        self.typed.get(s.name).map_or(s.name, String::as_str)
    }

    /// The runtime's setting called `name` (`VLLM_CPU_KVCACHE_SPACE`), with
    /// its value where the command line or environment set it.
    pub fn named(&self, name: &str) -> Option<(&'static Setting, Option<&str>)> {
        let runtime = self.runtime?;
        let s = SETTINGS
            .iter()
            .find(|s| s.name == name && s.runtime == runtime)?;
        Some((s, self.values.get(name).map(String::as_str)))
    }
}

/// The settings a Hello records: its command line, and the memory variables
/// `oomscope run` put in its labels (`env.NAME`). Where the command line
/// names no runtime, the agent's own word for it (`Hello.runtime`, which the
/// vLLM plugin sets) decides.
pub fn of_hello(hello: &pb::Hello) -> Settings {
    let env: BTreeMap<String, String> = hello
        .labels
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix(ENV_LABEL_PREFIX)
                .map(|name| (name.to_string(), v.clone()))
        })
        .collect();
    let mut s = parse(&hello.command, &env);
    if matches!(s.runtime, None | Some(Runtime::Pytorch)) {
        if let Some(r) = Runtime::from_name(&hello.runtime) {
            s.runtime = Some(r);
        }
    }
    s
}

/// Modules a Python interpreter runs as a runtime (`python -m MODULE`), by
/// prefix: each runtime's documented entry points.
const MODULES: &[(&str, Runtime)] = &[
    // `python -m vllm.entrypoints.openai.api_server`, `vllm.entrypoints.cli.main`.
    ("vllm.entrypoints", Runtime::Vllm),
    ("vllm", Runtime::Vllm),
    // `python -m sglang.launch_server`.
    ("sglang.launch_server", Runtime::Sglang),
    ("llama_cpp.server", Runtime::LlamaCppPython),
    // `python -m text_generation_server.cli serve` (what the launcher starts).
    ("text_generation_server", Runtime::Tgi),
];

/// Programs that are a runtime by name, with the subcommand that serves
/// where the program does more than serve.
const PROGRAMS: &[(&str, Option<&str>, Runtime)] = &[
    ("vllm", None, Runtime::Vllm),
    ("sglang", Some("serve"), Runtime::Sglang),
    ("llama-server", None, Runtime::LlamaCpp),
    ("llama-cli", None, Runtime::LlamaCpp),
    ("text-generation-launcher", None, Runtime::Tgi),
    ("text-generation-server", None, Runtime::Tgi),
    ("transformers", Some("serve"), Runtime::TransformersServe),
    (
        "transformers-cli",
        Some("serve"),
        Runtime::TransformersServe,
    ),
    ("oomscope-rust-server", None, Runtime::ReferenceRust),
];

/// Which runtime `command` starts: by its program (a binary, a script) or
/// the module its interpreter runs, however launched (`uv run`, `python3.11
/// -X dev -m`), and the subcommand that serves.
pub fn detect(command: &[String]) -> Option<Runtime> {
    let l = launch::read(command);
    let base = |s: &str| s.rsplit('/').next().unwrap_or(s).to_string();
    let args = &command[l.program_end.min(command.len())..];
    let serves = |sub: Option<&str>| sub.is_none_or(|sub| args.first().is_some_and(|a| a == sub));
    if let Some(m) = &l.module {
        let in_package = |p: &str| m == p || m.starts_with(&format!("{p}."));
        if let Some((_, r)) = MODULES.iter().find(|(p, _)| in_package(p)) {
            return Some(*r);
        }
        // `python -m transformers serve` (its CLI's package).
        if in_package("transformers") && serves(Some("serve")) {
            return Some(Runtime::TransformersServe);
        }
    }
    if let Some(program) = l.program.map(|i| base(&command[i])) {
        if let Some((_, _, r)) = PROGRAMS
            .iter()
            .find(|(p, sub, _)| *p == program && serves(*sub))
        {
            return Some(*r);
        }
    }
    if command.join(" ").contains("pytorch-server/server.py") {
        return Some(Runtime::ReferencePytorch);
    }
    if command.first().is_some_and(|w| launch::is_python(w)) || l.module.is_some() {
        return Some(Runtime::Pytorch);
    }
    None
}

/// Reads `command` (and the memory variables in `env`) as settings. The
/// launcher's words (`python3 -m llama_cpp.server`) are the program, never
/// a setting.
pub fn parse(command: &[String], env: &BTreeMap<String, String>) -> Settings {
    let runtime = detect(command);
    let mut out = Settings {
        runtime,
        ..Default::default()
    };
    let start = launch::read(command).program_end.min(command.len());
    out.positional.extend(command[..start].iter().cloned());
    let mut i = start;
    while i < command.len() {
        let w = &command[i];
        if w.len() > 1 && w.starts_with('-') && !is_number(w) {
            let (flag, value, took_next) = match w.split_once('=') {
                Some((n, v)) => (n, v.to_string(), false),
                None => match command.get(i + 1) {
                    Some(v) if !v.starts_with('-') || is_number(v) => (w.as_str(), v.clone(), true),
                    _ => (w.as_str(), String::new(), false),
                },
            };
            let name = canonical(runtime, flag);
            if !NOT_SETTINGS.contains(&name.as_str()) {
                if name != flag {
                    out.typed.insert(name.clone(), flag.to_string());
                }
                out.values.insert(name, value);
            }
            i += if took_next { 2 } else { 1 };
        } else {
            out.positional.push(w.clone());
            i += 1;
        }
    }
    for name in MEMORY_ENV {
        if let Some(v) = env.get(*name) {
            out.values.insert((*name).to_string(), v.clone());
        }
    }
    out
}

fn is_number(s: &str) -> bool {
    s.parse::<f64>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn a_vllm_command_line_reads_as_its_settings_without_ports() {
        let env = BTreeMap::from([("VLLM_CPU_KVCACHE_SPACE".to_string(), "4".to_string())]);
        let s = parse(
            &argv("/venv/bin/vllm serve /models/llama --port 8000 --host 0.0.0.0 --max-num-seqs 64 --gpu-memory-utilization=0.85 --enforce-eager --max-model-len 4096"),
            &env,
        );
        assert_eq!(s.runtime, Some(Runtime::Vllm));
        assert_eq!(
            s.values.get("--max-num-seqs").map(String::as_str),
            Some("64")
        );
        assert_eq!(
            s.values.get("--gpu-memory-utilization").map(String::as_str),
            Some("0.85")
        );
        assert_eq!(
            s.values.get("--enforce-eager").map(String::as_str),
            Some("")
        );
        assert!(!s.values.contains_key("--port") && !s.values.contains_key("--host"));
        assert_eq!(s.positional, argv("/venv/bin/vllm serve /models/llama"));
        let (setting, v) = s.get(Knob::KvCacheSize).unwrap();
        assert_eq!((setting.name, v), ("VLLM_CPU_KVCACHE_SPACE", "4"));
        assert_eq!(s.get(Knob::MaxSequences).unwrap().1, "64");
    }

    #[test]
    fn llama_cpp_short_flags_mean_their_long_names() {
        let s = parse(
            &argv("./llama-server -m m.gguf -c 8192 -np 4 -ngl 99 --port 8080"),
            &BTreeMap::new(),
        );
        assert_eq!(s.runtime, Some(Runtime::LlamaCpp));
        assert_eq!(s.get(Knob::MaxContext).unwrap().1, "8192");
        assert_eq!(s.get(Knob::MaxSequences).unwrap().1, "4");
        assert_eq!(s.get(Knob::GpuLayers).unwrap().1, "99");
    }

    #[test]
    fn each_runtime_is_detected_by_its_program() {
        let d = |c: &str| detect(&argv(c));
        assert_eq!(
            d("python -m sglang.launch_server --model-path m"),
            Some(Runtime::Sglang)
        );
        assert_eq!(
            d("text-generation-launcher --model-id m"),
            Some(Runtime::Tgi)
        );
        assert_eq!(
            d("python -m vllm.entrypoints.openai.api_server"),
            Some(Runtime::Vllm)
        );
        assert_eq!(
            d("python runtimes/pytorch-server/server.py --port 1"),
            Some(Runtime::ReferencePytorch)
        );
        assert_eq!(
            d("oomscope-rust-server --capacity 1"),
            Some(Runtime::ReferenceRust)
        );
        assert_eq!(d("python3 app.py"), Some(Runtime::Pytorch));
        assert_eq!(d("sh -c x"), None);
    }

    #[test]
    fn a_hello_gives_its_command_and_its_recorded_environment() {
        let hello = pb::Hello {
            command: argv("/venv/bin/vllm serve /m --max-num-seqs 8"),
            labels: [
                ("env.VLLM_CPU_KVCACHE_SPACE".to_string(), "1".to_string()),
                ("capture_file".to_string(), "x".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let s = of_hello(&hello);
        assert_eq!(s.runtime, Some(Runtime::Vllm));
        let (setting, v) = s.named("VLLM_CPU_KVCACHE_SPACE").unwrap();
        assert_eq!((setting.unit, v), ("GiB", Some("1")));
        assert!(!s.values.contains_key("capture_file"));
        // A plugin's word decides where the command line does not.
        let plugin = pb::Hello {
            command: argv("python3 serve.py"),
            runtime: "vllm".into(),
            ..Default::default()
        };
        assert_eq!(of_hello(&plugin).runtime, Some(Runtime::Vllm));
        assert_eq!(Runtime::from_name("vLLM"), Some(Runtime::Vllm));
        assert!(Runtime::Vllm.preallocates_kv() && !Runtime::Pytorch.preallocates_kv());
    }

    /// The runtime and context setting of each command line, as each
    /// runtime's docs write its launch.
    #[test]
    fn each_runtime_is_recognised_however_launched() {
        // The command line, its runtime, and its context flag as typed with its value.
        type Case = (&'static str, Runtime, Option<(&'static str, &'static str)>);
        let cases: &[Case] = &[
            ("vllm serve meta-llama/Llama-3.1-8B --max-model-len 8192", Runtime::Vllm, Some(("--max-model-len", "8192"))),
            ("python -m vllm.entrypoints.openai.api_server --model m --max_model_len=4096", Runtime::Vllm, Some(("--max_model_len", "4096"))),
            ("/venv/bin/python3.11 -m vllm.entrypoints.openai.api_server --model m --max-model-len=2048", Runtime::Vllm, Some(("--max-model-len", "2048"))),
            ("uv run vllm serve m --max-model-len 1024", Runtime::Vllm, Some(("--max-model-len", "1024"))),
            ("python3 -m sglang.launch_server --model-path m --context-length 4096", Runtime::Sglang, Some(("--context-length", "4096"))),
            ("python -X dev -m sglang.launch_server --model-path m --context_length 4096", Runtime::Sglang, Some(("--context_length", "4096"))),
            ("./build/bin/llama-server -m model.gguf --ctx-size 8192", Runtime::LlamaCpp, Some(("--ctx-size", "8192"))),
            ("llama-server -m model.gguf -c 8192", Runtime::LlamaCpp, Some(("-c", "8192"))),
            ("llama-server -m model.gguf --n-ctx 8192", Runtime::LlamaCpp, Some(("--n-ctx", "8192"))),
            ("python3 -m llama_cpp.server --model m.gguf --n_ctx 32768", Runtime::LlamaCppPython, Some(("--n_ctx", "32768"))),
            ("python -m llama_cpp.server --model m.gguf --n-ctx=32768", Runtime::LlamaCppPython, Some(("--n-ctx", "32768"))),
            ("uv run --with llama-cpp-python python3 -B -m llama_cpp.server --model m.gguf --n_ctx=2048", Runtime::LlamaCppPython, Some(("--n_ctx", "2048"))),
            ("text-generation-launcher --model-id m --max-input-tokens 1024 --max-total-tokens 2048", Runtime::Tgi, Some(("--max-input-tokens", "1024"))),
            ("text-generation-launcher --model-id m --max-input-length 1000", Runtime::Tgi, Some(("--max-input-length", "1000"))),
            ("text-generation-server serve m --sharded false", Runtime::Tgi, None),
            ("transformers serve ./tiny --device cpu --max-model-len 512", Runtime::TransformersServe, Some(("--max-model-len", "512"))),
            ("/v/bin/transformers-cli serve ./tiny --max_model_len 512", Runtime::TransformersServe, Some(("--max_model_len", "512"))),
        ];
        for (c, runtime, context) in cases {
            let s = parse(&argv(c), &BTreeMap::new());
            assert_eq!(s.runtime, Some(*runtime), "{c}");
            if let Some((typed, value)) = context {
                let (setting, v) = s
                    .get(Knob::MaxContext)
                    .unwrap_or_else(|| panic!("{c}: {s:?}"));
                assert_eq!(v, *value, "{c}");
                assert_eq!(s.spelling(setting), *typed, "{c}");
            }
            // The launcher is the program, never a setting.
            assert!(
                !s.values.contains_key("-m") && !s.values.contains_key("-X"),
                "{c}: {s:?}"
            );
        }
        // Not a runtime: a script, a module of its own, another program.
        let d = |c: &str| detect(&argv(c));
        assert_eq!(
            d("python3 -m myapp.server --n_ctx 8"),
            Some(Runtime::Pytorch)
        );
        assert_eq!(d("transformers env"), None);
        assert_eq!(d("python -m transformers.models.x"), Some(Runtime::Pytorch));
        assert_eq!(d("sglang version"), None);
    }

    #[test]
    fn the_module_and_the_interpreter_options_are_positional() {
        let s = parse(
            &argv("python3 -u -m llama_cpp.server --model /m/q.gguf --n_ctx 32768 --n_gpu_layers -1 --port 8000"),
            &BTreeMap::new(),
        );
        assert_eq!(s.positional, argv("python3 -u -m llama_cpp.server"));
        assert_eq!(
            s.values,
            BTreeMap::from([
                ("--model".to_string(), "/m/q.gguf".to_string()),
                ("--n_ctx".to_string(), "32768".to_string()),
                ("--n_gpu_layers".to_string(), "-1".to_string()),
            ])
        );
        assert_eq!(s.get(Knob::GpuLayers).unwrap().1, "-1");
    }

    #[test]
    fn negative_numbers_are_values_not_flags() {
        let s = parse(&argv("llama-server --n-gpu-layers -1"), &BTreeMap::new());
        assert_eq!(
            s.values.get("--n-gpu-layers").map(String::as_str),
            Some("-1")
        );
    }
}
