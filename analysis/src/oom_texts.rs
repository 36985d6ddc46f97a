//! The runtimes' own words for running out of memory: one table.
//!
//! A server that fails an allocation, or refuses to start because what it
//! reserves does not fit, says so on stderr in its own words. Each entry names
//! the runtime, the words, the memory they speak of, the cause they name,
//! what they mean and what to change first. The most specific entries come
//! first; the generic texts of CUDA, Python, C++ and libc close the table.
//! The collector's incident detection, the domain verdict, the causes and the
//! report's error box all read this one table.

use crate::memory_domain::Domain;
use crate::units::clip;
use oomscope_proto::CauseKind;

/// Which memory a text speaks of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Device memory (VRAM).
    Gpu,
    /// Host RAM: the runtime measured the host's free memory, or a host buffer failed.
    Host,
    /// The memory the runtime computes in: VRAM where the evidence shows a
    /// GPU, else host RAM (vLLM, SGLang, llama.cpp and TGI also run on CPUs).
    Runtime,
    /// An allocation failed, but the text does not say where: the host's
    /// limits (RLIMIT_AS, strict overcommit, the counters) must decide.
    Unsaid,
    /// /dev/shm (a tmpfs): a shared-memory segment found no room there.
    Shm,
}

impl Memory {
    /// The domain the text names; `gpu_seen` says whether the evidence shows a GPU.
    pub fn domain(self, gpu_seen: bool) -> Option<Domain> {
        match self {
            Memory::Gpu => Some(Domain::GpuVram),
            Memory::Host => Some(Domain::HostRam),
            Memory::Runtime if gpu_seen => Some(Domain::GpuVram),
            Memory::Runtime => Some(Domain::HostRam),
            Memory::Unsaid => None,
            Memory::Shm => Some(Domain::Shm),
        }
    }
}

/// How a line is recognised.
#[derive(Clone, Copy, Debug)]
pub enum Words {
    /// These fragments, in this order, ignoring ASCII case.
    InOrder(&'static [&'static str]),
    /// These fragments in any order, ignoring ASCII case.
    All(&'static [&'static str]),
    /// A whole word, exact case (ENOMEM, not MY_ENOMEM).
    Word(&'static str),
    /// "CUDA error 2" or "cuda error: 2", not "error 20".
    CudaError(u32),
}

impl Words {
    fn matches(&self, line: &str, lower: &str) -> bool {
        match *self {
            Words::InOrder(parts) => {
                let mut rest = lower;
                parts.iter().all(|p| match rest.find(p) {
                    Some(i) => {
                        rest = &rest[i + p.len()..];
                        true
                    }
                    None => false,
                })
            }
            Words::All(parts) => parts.iter().all(|p| lower.contains(p)),
            Words::Word(w) => has_word(line, w),
            Words::CudaError(code) => has_error_code(lower, "cuda error", code),
        }
    }
}

/// One runtime's text and what it means.
#[derive(Debug)]
pub struct RuntimeText {
    /// "vLLM", "SGLang", "llama.cpp", "TGI", or the layer for the generic texts.
    pub runtime: &'static str,
    /// Lower case, as matched.
    pub words: Words,
    /// A real line with these words, as the runtime prints it (the tests run each).
    pub example: &'static str,
    pub memory: Memory,
    /// The cause it names (`Cause.kind`); None for the generic texts, whose
    /// cause the rest of the evidence must find.
    pub cause: Option<&'static str>,
    /// What it means, in one line.
    pub meaning: &'static str,
    /// What to change first, in the runtime's own settings; "" for the generic texts.
    pub fix: &'static str,
}

/// The table, most specific first: where several entries match a stderr, the
/// first one in this order speaks for it.
///
/// Sources: vLLM `v1/core/kv_cache_utils.py` and the CPU worker (the KV
/// texts), `v1/worker/gpu_worker.py` (free memory at start-up); SGLang's
/// scheduler (`check_memory`, `update_running_batch`); llama.cpp's
/// `llama-kv-cache.cpp`, `ggml-alloc.c` and `ggml-cuda.cu`;
/// huggingface/text-generation-inference (checked 2026-01,
/// db931fcf): `server/text_generation_server/models/flash_causal_lm.py`
/// `warmup` raises "Not enough memory to handle {n} prefill tokens. You need
/// to decrease `--max-batch-prefill-tokens`" from a torch OOM, and
/// `backends/v3/src/lib.rs` (`V3Error::NotEnoughMemory`) "Not enough memory
/// to handle `max_total_tokens={n}`" when the KV cache cannot hold one
/// request; older routers said "Not enough memory to handle {n} total tokens
/// with {m} prefill tokens" (TGI issues #710, #755); its exllamav2 kernels
/// throw "CUDA out of memory", which the CUDA entries below match.
pub static RUNTIME_TEXTS: &[RuntimeText] = &[
    RuntimeText {
        runtime: "vLLM",
        words: Words::InOrder(&["less than requested memory for kv"]),
        example: "ValueError: Available memory on node 0 (20.88/23.54 GiB) on kv cache allocation is less than requested memory for kv (40.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.",
        memory: Memory::Host,
        cause: Some(CauseKind::KvReservation.as_str()),
        meaning: "vLLM's CPU backend reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE, --kv-cache-memory-bytes) and the NUMA node had less RAM available than that reservation",
        fix: "Lower the KV reservation (VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes) to what the node has available after the weights, with headroom",
    },
    RuntimeText {
        runtime: "vLLM",
        words: Words::InOrder(&["on startup is less than desired gpu memory utilization"]),
        example: "ValueError: Free memory on device (6.9/8.0 GiB) on startup is less than desired GPU memory utilization (0.9, 7.2 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
        memory: Memory::Gpu,
        cause: Some(CauseKind::KvReservation.as_str()),
        meaning: "vLLM reserves gpu_memory_utilization of the device at start (weights, activations, then the KV cache) and less than that was free: other processes hold the rest",
        fix: "Lower gpu_memory_utilization to the share of the device that is free (the KV cache shrinks with it), or run where the device is not shared",
    },
    RuntimeText {
        runtime: "vLLM",
        words: Words::InOrder(&["no available memory for the cache blocks"]),
        example: "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.",
        memory: Memory::Runtime,
        cause: Some(CauseKind::KvNoRoom.as_str()),
        meaning: "after the weights and the profiled activation peak, vLLM's memory budget left nothing for the KV cache",
        fix: "Make room for the KV cache: raise gpu_memory_utilization where the device is not shared, lower max_num_batched_tokens (the profiled activation peak), or serve smaller or quantized weights",
    },
    RuntimeText {
        runtime: "vLLM",
        words: Words::InOrder(&["max seq len", "larger than the maximum number of tokens that can be stored in kv cache"]),
        example: "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be stored in KV cache (19632). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
        memory: Memory::Runtime,
        cause: Some(CauseKind::ContextOverKv.as_str()),
        meaning: "the KV cache that fits holds fewer tokens than one sequence at max_model_len",
        fix: "Lower max_model_len to at most the tokens the KV cache holds (the number in the message), or give the KV cache more memory (gpu_memory_utilization, VLLM_CPU_KVCACHE_SPACE)",
    },
    RuntimeText {
        runtime: "vLLM",
        words: Words::InOrder(&["kv cache is needed, which is larger than the available kv cache memory"]),
        example: "ValueError: To serve at least one request with the model's max seq len (131072), 52.66 GiB KV cache is needed, which is larger than the available KV cache memory (23.37 GiB). Based on the available memory, the estimated maximum model length is 58148.",
        memory: Memory::Runtime,
        cause: Some(CauseKind::ContextOverKv.as_str()),
        meaning: "one sequence at max_model_len needs more KV cache than the memory left for it",
        fix: "Lower max_model_len to the estimated maximum in the message, or give the KV cache more memory (gpu_memory_utilization, a lower max_num_batched_tokens)",
    },
    RuntimeText {
        runtime: "SGLang",
        words: Words::InOrder(&["token_to_kv_pool_allocator memory leak detected"]),
        example: "ValueError: token_to_kv_pool_allocator memory leak detected! self.max_total_num_tokens=15563319, available_size=15563321, evictable_size=0, protected_size=0",
        memory: Memory::Runtime,
        cause: Some(CauseKind::KvPoolLeak.as_str()),
        meaning: "SGLang's idle self-check found KV slots that no request holds and the pool did not get back: a bookkeeping bug in the runtime, not load",
        fix: "Upgrade SGLang or report the bug with this log (radix cache and speculative decoding have had such leaks); as a workaround try --disable-radix-cache",
    },
    RuntimeText {
        runtime: "SGLang",
        words: Words::InOrder(&["kv cache pool is full. retract requests"]),
        example: "KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_token_ratio: 0.9998 -> 1.0000",
        memory: Memory::Runtime,
        cause: Some(CauseKind::KvPoolFull.as_str()),
        meaning: "the running requests' KV outgrew SGLang's token pool, so it evicted requests to recompute them later",
        fix: "Admit less at once: lower --max-running-requests or raise --schedule-conservativeness; raise --mem-fraction-static only where the device has room",
    },
    RuntimeText {
        runtime: "llama.cpp",
        words: Words::InOrder(&["failed to allocate buffer for kv cache"]),
        example: "llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache",
        memory: Memory::Runtime,
        cause: Some(CauseKind::KvReservation.as_str()),
        meaning: "llama.cpp reserves the KV cache for the whole context (--ctx-size × --parallel) at start, and that buffer did not fit",
        fix: "Lower the KV reservation: a smaller --ctx-size (or --parallel), or a quantized KV cache (--cache-type-k/--cache-type-v q8_0)",
    },
    RuntimeText {
        runtime: "llama.cpp",
        words: Words::InOrder(&["failed to allocate compute"]),
        example: "llama_new_context_with_model: failed to allocate compute buffers",
        memory: Memory::Runtime,
        cause: Some(CauseKind::ComputeBuffer.as_str()),
        meaning: "llama.cpp sizes its compute buffer for the largest batch at start, and that buffer did not fit beside the weights and the KV cache",
        fix: "Lower --batch-size/--ubatch-size (the compute buffer grows with them), or offload fewer layers (--n-gpu-layers)",
    },
    RuntimeText {
        runtime: "llama.cpp",
        words: Words::InOrder(&["insufficient memory (attempted to allocate"]),
        example: "ggml_aligned_malloc: insufficient memory (attempted to allocate 36000.00 MB)",
        memory: Memory::Host,
        cause: Some(CauseKind::BufferReservation.as_str()),
        meaning: "a host buffer llama.cpp reserves at start (weights, KV cache or compute) was refused",
        fix: "Lower what llama.cpp reserves: a smaller --ctx-size, --batch-size, or a smaller quantization of the model",
    },
    RuntimeText {
        runtime: "llama.cpp",
        words: Words::InOrder(&["failed to allocate cpu buffer"]),
        example: "alloc_tensor_range: failed to allocate CPU buffer of size 37748736000",
        memory: Memory::Host,
        cause: Some(CauseKind::BufferReservation.as_str()),
        meaning: "a host buffer llama.cpp reserves at start (weights, KV cache or compute) did not fit",
        fix: "Lower what llama.cpp reserves: a smaller --ctx-size, --batch-size, or a smaller quantization of the model",
    },
    RuntimeText {
        runtime: "llama.cpp",
        words: Words::InOrder(&["failed to allocate", "buffer"]),
        example: "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 8109821952",
        memory: Memory::Runtime,
        cause: Some(CauseKind::BufferReservation.as_str()),
        meaning: "a device buffer llama.cpp reserves at start (weights, KV cache or compute) did not fit",
        fix: "Lower what llama.cpp reserves: fewer offloaded layers (--n-gpu-layers), a smaller --ctx-size or --batch-size, or a smaller quantization",
    },
    RuntimeText {
        runtime: "llama.cpp",
        words: Words::InOrder(&["unable to allocate", "buffer"]),
        example: "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
        memory: Memory::Runtime,
        cause: Some(CauseKind::WeightsTooLarge.as_str()),
        meaning: "the model's weights did not fit where llama.cpp was told to put them",
        fix: "Offload fewer layers (--n-gpu-layers), or load a smaller quantization of the model",
    },
    RuntimeText {
        runtime: "llama.cpp",
        words: Words::InOrder(&["cudamalloc failed: out of memory"]),
        example: "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 7734.13 MiB on device 0: cudaMalloc failed: out of memory",
        memory: Memory::Gpu,
        cause: None,
        meaning: "a CUDA allocation of ggml failed: the device had no room for the buffer",
        fix: "",
    },
    RuntimeText {
        runtime: "TGI",
        words: Words::InOrder(&["not enough memory to handle `max_total_tokens="]),
        example: "Error: Backend(NotEnoughMemory(32768)): Not enough memory to handle `max_total_tokens=32768`",
        memory: Memory::Runtime,
        cause: Some(CauseKind::ContextOverKv.as_str()),
        meaning: "TGI's warm-up measured a KV cache that holds fewer tokens than one request at --max-total-tokens",
        fix: "Lower --max-total-tokens (and --max-input-tokens) to what the KV cache holds, or give the shard more memory (fewer other processes, --cuda-memory-fraction)",
    },
    RuntimeText {
        runtime: "TGI",
        words: Words::InOrder(&["not enough memory to handle", "total tokens with", "prefill tokens"]),
        example: "Not enough memory to handle 16000 total tokens with 4096 prefill tokens. You need to decrease `--max-batch-total-tokens` or `--max-batch-prefill-tokens`",
        memory: Memory::Runtime,
        cause: Some(CauseKind::KvReservation.as_str()),
        meaning: "TGI's warm-up could not reserve --max-batch-total-tokens of KV cache beside the largest prefill batch",
        fix: "Lower --max-batch-total-tokens (the KV reservation), then --max-batch-prefill-tokens",
    },
    RuntimeText {
        runtime: "TGI",
        words: Words::InOrder(&["not enough memory to handle", "prefill tokens"]),
        example: "Error: Warmup(Generation(\"Not enough memory to handle 4096 prefill tokens. You need to decrease `--max-batch-prefill-tokens`\"))",
        memory: Memory::Runtime,
        cause: Some(CauseKind::PrefillBatch.as_str()),
        meaning: "TGI's warm-up runs the largest prefill batch it will admit, and that batch ran out of memory",
        fix: "Lower --max-batch-prefill-tokens (the largest prefill batch), then warm up again",
    },
    // /dev/shm out of room. PyTorch's libshm (`torch/lib/libshm/core.cpp`,
    // `c10/core/MapAllocator.cpp`) names its segments `/torch_<pid>_<n>_<n>`
    // and reserves each with posix_fallocate, so a full /dev/shm fails there
    // with ENOSPC; the DataLoader (`torch/csrc/DataLoader.cpp`) reports a
    // worker's SIGBUS with the shm words below. vLLM's shm_broadcast logs only
    // "No available shared memory broadcast block found in N seconds", which
    // is a reader that hangs, not a full /dev/shm: it is not in this table (a
    // ring buffer that cannot be backed dies of SIGBUS, which the signal decides).
    RuntimeText {
        runtime: "PyTorch",
        words: Words::InOrder(&["unable to allocate shared memory(shm) for file"]),
        example: "RuntimeError: unable to allocate shared memory(shm) for file </torch_4012_3046393498_0>: No space left on device (28)",
        memory: Memory::Shm,
        cause: Some(CauseKind::ShmFull.as_str()),
        meaning: "PyTorch reserves every tensor it shares between processes (DataLoader batches, torch.multiprocessing queues) as a file in /dev/shm, and /dev/shm had no room for the next one",
        fix: SHM_FIX,
    },
    RuntimeText {
        runtime: "PyTorch",
        words: Words::InOrder(&["unable to write to file </torch_"]),
        example: "RuntimeError: unable to write to file </torch_2217_1573264347_0>: No space left on device (28)",
        memory: Memory::Shm,
        cause: Some(CauseKind::ShmFull.as_str()),
        meaning: "PyTorch writes every tensor it shares between processes into a file in /dev/shm (where posix_fallocate is not supported), and /dev/shm had no room for the next one",
        fix: SHM_FIX,
    },
    RuntimeText {
        runtime: "PyTorch",
        words: Words::InOrder(&["dataloader worker", "is killed by signal: bus error"]),
        example: "RuntimeError: DataLoader worker (pid 4012) is killed by signal: Bus error. It is possible that dataloader's workers are out of shared memory. Please try to raise your shared memory limit.",
        memory: Memory::Shm,
        cause: Some(CauseKind::ShmFull.as_str()),
        meaning: "a DataLoader worker died of SIGBUS writing a batch into a shared-memory segment that /dev/shm could not back",
        fix: SHM_FIX,
    },
    RuntimeText {
        runtime: "PyTorch",
        words: Words::InOrder(&["bus error", "insufficient shared memory"]),
        example: "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
        memory: Memory::Shm,
        cause: Some(CauseKind::ShmFull.as_str()),
        meaning: "a DataLoader worker took SIGBUS writing a batch into a shared-memory segment that /dev/shm could not back",
        fix: SHM_FIX,
    },
    RuntimeText {
        runtime: "libc",
        words: Words::All(&["no space left on device", "/dev/shm"]),
        example: "OSError: [Errno 28] No space left on device: '/dev/shm/batch-7'",
        memory: Memory::Shm,
        cause: Some(CauseKind::ShmFull.as_str()),
        meaning: "a write to /dev/shm failed with ENOSPC: the tmpfs is at its size",
        fix: SHM_FIX,
    },
    // The generic texts: they say that an allocation failed, not why.
    RuntimeText {
        runtime: "CUDA",
        words: Words::InOrder(&["cuda", "out of memory"]),
        example: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 139.81 GiB",
        memory: Memory::Gpu,
        cause: None,
        meaning: "a device allocation failed",
        fix: "",
    },
    RuntimeText {
        runtime: "CUDA",
        words: Words::All(&["out of memory", "cuda"]),
        example: "RuntimeError: out of memory (CUDA allocator)",
        memory: Memory::Gpu,
        cause: None,
        meaning: "a device allocation failed",
        fix: "",
    },
    RuntimeText {
        runtime: "CUDA",
        words: Words::InOrder(&["cuda_error_out_of_memory"]),
        example: "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY",
        memory: Memory::Gpu,
        cause: None,
        meaning: "the driver refused a device allocation (error 2)",
        fix: "",
    },
    RuntimeText {
        runtime: "CUDA",
        words: Words::InOrder(&["cudaerrormemoryallocation"]),
        example: "cudaMalloc returned cudaErrorMemoryAllocation",
        memory: Memory::Gpu,
        cause: None,
        meaning: "the runtime refused a device allocation (error 2)",
        fix: "",
    },
    RuntimeText {
        runtime: "PyTorch",
        words: Words::InOrder(&["outofmemoryerror"]),
        example: "torch.OutOfMemoryError: Tried to allocate 2.00 GiB",
        memory: Memory::Gpu,
        cause: None,
        meaning: "PyTorch's caching allocator could not get a device block",
        fix: "",
    },
    RuntimeText {
        runtime: "PyTorch",
        words: Words::InOrder(&["allocation on device", "would exceed allowed memory"]),
        example: "Allocation on device 0 would exceed allowed memory. (out of memory)",
        memory: Memory::Gpu,
        cause: None,
        meaning: "PyTorch's cudaMallocAsync backend could not get device memory from the driver's pool",
        fix: "",
    },
    RuntimeText {
        runtime: "CUDA",
        words: Words::CudaError(2),
        example: "DriverError: CUDA error 2",
        memory: Memory::Gpu,
        cause: None,
        meaning: "CUDA error 2 (out of memory); under a finite RLIMIT_AS it can also be the host's address space",
        fix: "",
    },
    RuntimeText {
        runtime: "Python",
        words: Words::InOrder(&["memoryerror"]),
        example: "MemoryError",
        memory: Memory::Unsaid,
        cause: None,
        meaning: "Python could not allocate",
        fix: "",
    },
    RuntimeText {
        runtime: "C++",
        words: Words::InOrder(&["bad_alloc"]),
        example: "terminate called after throwing an instance of 'std::bad_alloc'",
        memory: Memory::Unsaid,
        cause: None,
        meaning: "operator new could not allocate",
        fix: "",
    },
    RuntimeText {
        runtime: "libc",
        words: Words::Word("ENOMEM"),
        example: "mmap failed: ENOMEM",
        memory: Memory::Unsaid,
        cause: None,
        meaning: "the kernel refused memory (ENOMEM)",
        fix: "",
    },
    RuntimeText {
        runtime: "libc",
        words: Words::InOrder(&["cannot allocate memory"]),
        example: "OSError: [Errno 12] Cannot allocate memory",
        memory: Memory::Unsaid,
        cause: None,
        meaning: "the kernel refused memory (ENOMEM)",
        fix: "",
    },
    RuntimeText {
        runtime: "any",
        words: Words::InOrder(&["out of memory"]),
        example: "runtime: out of memory: cannot allocate 1073741824-byte block",
        memory: Memory::Unsaid,
        cause: None,
        meaning: "an allocation failed",
        fix: "",
    },
];

/// What to change first when /dev/shm is full: its size (Docker gives 64
/// MiB), or less in it at once.
const SHM_FIX: &str = "Give /dev/shm room for what is in flight: `docker run --shm-size=<measured peak + headroom>` (or `--ipc=host`), a memory-backed volume on /dev/shm (Kubernetes: emptyDir medium Memory with a sizeLimit); or put less in it at once: fewer DataLoader workers (num_workers, prefetch_factor) or `torch.multiprocessing.set_sharing_strategy('file_system')`";

/// ENOSPC with no path, as a failed write prints it ("OSError: [Errno 28] No
/// space left on device"): it names no filesystem, so it is not in the table;
/// it speaks of /dev/shm only where /dev/shm was full (see [`enospc_on_full_shm`]).
pub static ENOSPC_ON_FULL_SHM: RuntimeText = RuntimeText {
    runtime: "libc",
    words: Words::InOrder(&["no space left on device"]),
    example: "OSError: [Errno 28] No space left on device",
    memory: Memory::Shm,
    cause: Some(CauseKind::ShmFull.as_str()),
    meaning: "a write failed with ENOSPC while /dev/shm was full: the tmpfs is at its size",
    fix: SHM_FIX,
};

/// At or above this share of its size /dev/shm is full: a bare ENOSPC then
/// speaks of it (and a SIGBUS is a full /dev/shm, not a truncated file).
pub const SHM_FULL_FRACTION: f64 = 0.95;

/// The bare ENOSPC of a stderr, taken for /dev/shm's when /dev/shm was full
/// (`shm_used` of `shm_total`, at its fullest around the death).
pub fn enospc_on_full_shm(stderr: &str, shm_used: u64, shm_total: u64) -> Option<TextMatch> {
    let full = shm_total > 0 && shm_used as f64 >= shm_total as f64 * SHM_FULL_FRACTION;
    if !full {
        return None;
    }
    let line = stderr.lines().rev().find(|l| {
        ENOSPC_ON_FULL_SHM.words.matches(l, &l.to_ascii_lowercase()) || has_word(l, "ENOSPC")
    })?;
    Some(TextMatch {
        text: &ENOSPC_ON_FULL_SHM,
        line: clip(line.trim(), 240),
        gpu_line: false,
    })
}

/// The entry that speaks for a stderr, and the line it quotes.
#[derive(Clone, Debug)]
pub struct TextMatch {
    pub text: &'static RuntimeText,
    /// The last line with its words (the last is nearest the death), trimmed and bounded.
    pub line: String,
    /// A line of the same stderr names device memory: a `Runtime` text then
    /// speaks of the GPU whatever the rest of the evidence shows.
    pub gpu_line: bool,
}

impl TextMatch {
    /// The domain it names; `gpu_seen` says whether the evidence shows a GPU.
    pub fn domain(&self, gpu_seen: bool) -> Option<Domain> {
        self.text.memory.domain(gpu_seen || self.gpu_line)
    }
}

/// The first entry (in table order) whose words a line of `stderr` has.
pub fn find(stderr: &str) -> Option<TextMatch> {
    let mut best: Option<(usize, &str)> = None;
    let mut gpu_line = false;
    for line in stderr.lines() {
        let Some(i) = entry_of(line) else { continue };
        gpu_line |= RUNTIME_TEXTS[i].memory == Memory::Gpu;
        // Ties go to the later line, nearer the death.
        if best.is_none_or(|(b, _)| i <= b) {
            best = Some((i, line));
        }
    }
    best.map(|(i, line)| TextMatch {
        text: &RUNTIME_TEXTS[i],
        line: clip(line.trim(), 240),
        gpu_line,
    })
}

/// The index of the first entry whose words the line has.
fn entry_of(line: &str) -> Option<usize> {
    let lower = line.to_ascii_lowercase();
    RUNTIME_TEXTS
        .iter()
        .position(|t| t.words.matches(line, &lower))
}

/// True when a line (or any line of a text) is a runtime's memory text.
pub fn is_oom_text(text: &str) -> bool {
    text.lines().any(|l| entry_of(l).is_some())
}

/// True when the text names a *device* allocation failure.
pub fn is_cuda_oom_text(text: &str) -> bool {
    text.lines()
        .any(|l| entry_of(l).is_some_and(|i| RUNTIME_TEXTS[i].memory == Memory::Gpu))
}

/// The last line with a memory text, trimmed and bounded: what an incident's
/// summary quotes.
pub fn oom_line(stderr: &str) -> Option<String> {
    stderr
        .lines()
        .rev()
        .find(|l| entry_of(l).is_some())
        .map(|l| clip(l.trim(), 240))
}

/// The last line that names device memory, trimmed and bounded.
pub fn cuda_oom_line(text: &str) -> Option<String> {
    text.lines()
        .rev()
        .find(|l| entry_of(l).is_some_and(|i| RUNTIME_TEXTS[i].memory == Memory::Gpu))
        .map(|l| clip(l.trim(), 240))
}

/// "cuda error 2" or "cuda error: 2" followed by a non-digit (not "error 20").
fn has_error_code(lower: &str, prefix: &str, code: u32) -> bool {
    let code = code.to_string();
    lower.match_indices(prefix).any(|(i, _)| {
        let rest = lower[i + prefix.len()..].trim_start_matches([' ', ':', '=']);
        rest.strip_prefix(code.as_str())
            .is_some_and(|after| !after.starts_with(|c: char| c.is_ascii_digit()))
    })
}

/// `word` not embedded in a longer identifier.
fn has_word(line: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    line.match_indices(word).any(|(i, _)| {
        let before_ok = line[..i].chars().next_back().is_none_or(|c| !is_ident(c));
        let after_ok = line[i + word.len()..]
            .chars()
            .next()
            .is_none_or(|c| !is_ident(c));
        before_ok && after_ok
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_speaks_for_its_own_entry() {
        for (i, t) in RUNTIME_TEXTS.iter().enumerate() {
            assert_eq!(
                entry_of(t.example),
                Some(i),
                "{} example {:?} is taken by another entry",
                t.runtime,
                t.example
            );
            let m = find(&format!("loading...\n{}\nshutting down\n", t.example)).unwrap();
            assert!(std::ptr::eq(m.text, t));
            assert_eq!(m.line, clip(t.example, 240), "the line is quoted");
            // A cause comes with a meaning and a fix; the generic texts name neither.
            assert!(!t.meaning.is_empty());
            assert_eq!(t.cause.is_some(), !t.fix.is_empty(), "{}", t.example);
        }
    }

    #[test]
    fn each_named_cause_is_a_cause_kind() {
        for t in RUNTIME_TEXTS.iter().chain([&ENOSPC_ON_FULL_SHM]) {
            if let Some(k) = t.cause {
                assert!(k.parse::<CauseKind>().is_ok(), "{k} ({})", t.example);
            }
        }
    }

    #[test]
    fn each_runtime_text_names_its_domain() {
        let domain = |s: &str, gpu: bool| find(s).and_then(|m| m.domain(gpu));
        let vllm_cpu = "ValueError: Available memory on node 0 (20.88/23.54 GiB) on kv cache allocation is less than requested memory for kv (40.0 GiB).";
        assert_eq!(domain(vllm_cpu, true), Some(Domain::HostRam));
        let cache = "ValueError: No available memory for the cache blocks.";
        assert_eq!(domain(cache, true), Some(Domain::GpuVram));
        assert_eq!(domain(cache, false), Some(Domain::HostRam), "vllm-cpu");
        // A CUDA line beside a llama.cpp text puts it on the device.
        let llama = "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 5000.00 MiB on device 0: cudaMalloc failed: out of memory\nllama_kv_cache_init: failed to allocate buffer for kv cache\n";
        let m = find(llama).unwrap();
        assert_eq!(m.text.cause, Some("kv_reservation"));
        assert_eq!(m.domain(false), Some(Domain::GpuVram));
        assert_eq!(
            m.line,
            "llama_kv_cache_init: failed to allocate buffer for kv cache"
        );
        assert_eq!(
            domain("MemoryError", true),
            None,
            "the host's limits decide"
        );
    }

    #[test]
    fn host_allocation_failures_are_recognised() {
        assert!(is_oom_text(
            "Traceback (most recent call last):\nMemoryError\n"
        ));
        assert!(is_oom_text("terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc"));
        assert!(is_oom_text("mmap failed: ENOMEM"));
        assert!(is_oom_text("OSError: [Errno 12] Cannot allocate memory"));
        assert!(is_oom_text("fatal: Out Of Memory"));
        assert!(is_oom_text(
            "runtime: out of memory: cannot allocate 1073741824-byte block"
        ));
    }

    #[test]
    fn cuda_failures_are_recognised() {
        let torch = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 139.81 GiB";
        assert!(is_oom_text(torch) && is_cuda_oom_text(torch));
        assert!(is_cuda_oom_text(
            "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY"
        ));
        assert!(is_cuda_oom_text("DriverError: CUDA error 2"));
        assert!(is_cuda_oom_text("CUDA error: out of memory"));
        assert!(!is_cuda_oom_text("MemoryError"));
    }

    #[test]
    fn look_alikes_are_not_oom() {
        assert!(!is_oom_text(""));
        assert!(!is_oom_text("CUDA error 20: invalid device"));
        assert!(!is_oom_text("ENOMEMX is not a code; MY_ENOMEM neither"));
        assert!(!is_oom_text("KeyError: 'memory'\nexit status 1"));
        assert!(!is_oom_text(
            "INFO KV cache pool usage 0.93, 12 running requests"
        ));
        assert!(!is_oom_text(
            "Not enough memory to handle image header (ihdr)"
        ));
    }

    #[test]
    fn a_full_dev_shm_speaks_for_itself() {
        let shm = |s: &str| find(s).and_then(|m| m.domain(true));
        for text in [
            "Traceback (most recent call last):\nOSError: [Errno 28] No space left on device: '/dev/shm/seg-3'",
            "write /dev/shm/nccl-abc: no space left on device",
            "RuntimeError: unable to allocate shared memory(shm) for file </torch_77_1_0>: No space left on device (28)",
            "RuntimeError: DataLoader worker (pid(s) 81, 82) is killed by signal: Bus error. It is possible that dataloader's workers are out of shared memory.",
        ] {
            assert_eq!(shm(text), Some(Domain::Shm), "{text}");
            assert!(is_oom_text(text) && !is_cuda_oom_text(text), "{text}");
        }
        // The shm words win over a generic text on a later line.
        let m = find("RuntimeError: unable to write to file </torch_9_1_2>: No space left on device (28)\nMemoryError\n").unwrap();
        assert_eq!(m.text.cause, Some("shm_full"));
    }

    #[test]
    fn a_bare_enospc_speaks_of_dev_shm_only_when_it_was_full() {
        let err =
            "Traceback (most recent call last):\nOSError: [Errno 28] No space left on device\n";
        let m = enospc_on_full_shm(err, 32 << 20, 32 << 20).unwrap();
        assert_eq!(m.line, "OSError: [Errno 28] No space left on device");
        assert_eq!(m.domain(false), Some(Domain::Shm));
        assert!(enospc_on_full_shm("write: ENOSPC", 31 << 20, 32 << 20).is_some());
        assert!(
            enospc_on_full_shm(err, 20 << 20, 32 << 20).is_none(),
            "a full disk elsewhere"
        );
        assert!(enospc_on_full_shm(err, 0, 0).is_none(), "no reading");
        assert!(enospc_on_full_shm("MemoryError", 32 << 20, 32 << 20).is_none());
    }

    #[test]
    fn other_full_disks_and_shm_hangs_are_not_memory() {
        assert!(!is_oom_text(
            "OSError: [Errno 28] No space left on device: '/tmp/ckpt.pt'"
        ));
        // vLLM's ring buffer waiting on a slow reader: a hang, not a full /dev/shm.
        assert!(!is_oom_text("INFO [shm_broadcast.py:548] No available shared memory broadcast block found in 60 seconds. This typically happens when some processes are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache quantization)."));
        assert!(!is_oom_text(
            "RuntimeError: DataLoader worker (pid 4012) is killed by signal: Killed."
        ));
    }

    #[test]
    fn the_last_matching_line_is_quoted() {
        let err = "warning: low memory\nMemoryError: first\nstill going\nMemoryError: second\n";
        assert_eq!(oom_line(err).as_deref(), Some("MemoryError: second"));
        assert_eq!(find(err).unwrap().line, "MemoryError: second");
    }
}
