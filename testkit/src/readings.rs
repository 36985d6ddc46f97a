//! A process's host reading at a request boundary, as an agent sends it:
//! the RSS, the host's memory and the request count. Growth tests build
//! their series from it (analysis's verdicts, the CLI's leak hunts).

use oomscope_proto::v1 as pb;

/// One reading of process `pid` at `time_ns`: `rss` resident bytes on a
/// host of `mem_total` bytes, `requests_done` requests ended, in `phase`.
pub fn host_reading(
    time_ns: i64,
    pid: u32,
    rss: u64,
    mem_total: u64,
    phase: &str,
    requests_done: u64,
) -> pb::Sample {
    pb::Sample {
        time_ns,
        process: Some(pb::ProcessMemory {
            pid,
            vm_rss_bytes: rss,
            ..Default::default()
        }),
        system: Some(pb::SystemMemory {
            mem_total_bytes: mem_total,
            ..Default::default()
        }),
        context: Some(pb::RequestContext {
            phase: phase.into(),
            requests_done,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A few allocator pages of scatter for reading `i` (0 to 12 pages),
/// deterministic: a real series is never a straight line.
pub fn page_jitter(i: u64) -> u64 {
    (i * 7919 % 13) * 4096
}
