//! What `oomscope run` is told: the command, where the collector is, and
//! how to sample, restart and flush; the defaults with their reasons.

use std::path::PathBuf;
use std::time::Duration;

/// How much of the child's stderr is kept as evidence. 64 KiB holds a full
/// Python traceback or a CUDA OOM message with room to spare.
pub const DEFAULT_STDERR_TAIL_BYTES: usize = 64 * 1024;
/// How often the child is sampled from outside. Reading procfs and the cgroup
/// files costs well under a millisecond, so 4 Hz is cheap and still catches
/// growth that kills a process within a few seconds.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
/// The longest wait for the collector to ack everything before exiting.
pub const DEFAULT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Restart backoff: first delay and the cap. Doubling from 0.5 s reaches the
/// cap after 6 restarts; a crash loop is reported once `--restart` is spent.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(500);
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What `oomscope run` is told; the command line's flags, parsed by the cli.
pub struct RunConfig {
    pub command: Vec<String>,
    pub name: String,
    pub collector_url: String,
    pub restart: u32,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub interval: Duration,
    pub stderr_tail_bytes: usize,
    pub flush_timeout: Duration,
    pub spool_dir: Option<PathBuf>,
    /// `--memory-limit`: run the child in a memory cgroup of this size,
    /// made for the run and removed after it.
    pub memory_limit_bytes: Option<u64>,
}
