//! Command-line switches. Each scenario is one switch so a test (or a
//! person) can reproduce one failure at a time.

use clap::Parser;

const MIB: u64 = 1 << 20;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "oomscope-rust-server",
    about = "A small inference server on the oomscope tracking pool"
)]
pub struct Config {
    /// HTTP address; port 0 picks a free one (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// The collector (default: OOMSCOPE_COLLECTOR, else http://127.0.0.1:7433).
    #[arg(long)]
    pub collector: Option<String>,
    #[arg(long, default_value = "rust-server")]
    pub name: String,
    /// auto: the CUDA device when libcuda and a GPU are there, else simulated.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cuda", "sim"])]
    pub device: String,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Capacity of the simulated device, in bytes.
    #[arg(long, default_value_t = 1 << 30)]
    pub capacity: u64,
    /// Weights to load at start, in bytes (more than the device holds: weights_too_large).
    #[arg(long, default_value_t = 256 * MIB)]
    pub model_bytes: u64,
    /// The weights load as this many equal layers.
    #[arg(long, default_value_t = 8)]
    pub layers: u64,
    /// KV cache bytes per token (all layers).
    #[arg(long, default_value_t = 64 * 1024)]
    pub kv_bytes_per_token: u64,
    /// Tokens per KV page; a sequence grows one page per decode step.
    #[arg(long, default_value_t = 256)]
    pub page_tokens: u64,
    /// Sequences decoding at once; more wait (0 = no limit).
    #[arg(long, default_value_t = 0)]
    pub max_active: usize,
    /// Keep a block per finished request (a leak).
    #[arg(long)]
    pub leak: bool,
    /// Bytes kept per request with --leak.
    #[arg(long, default_value_t = 8 * MIB)]
    pub leak_bytes: u64,
    /// After loading, fill the device with prefix-cache entries and keep
    /// every other one; each decode step then needs a workspace larger than
    /// any hole (fragmentation).
    #[arg(long)]
    pub fragment: bool,
    /// Workspace per decode step with --fragment.
    #[arg(long, default_value_t = 24 * MIB)]
    pub workspace_bytes: u64,
    /// Time per decode step, in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub step_ms: u64,
    /// Full (host + allocator) samples this often, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub sample_interval_ms: u64,
}
