//! What the migration examples share: PyTorch-sized samples.

use std::collections::HashMap;

use oomscope_collector::pb;
use oomscope_collector::pb::agent_message::Body;

/// Sample `seq` of one agent: 122 allocator counters, one in eight moving
/// with `seq` (~4.5 KB complete), 250 ms apart.
pub fn torch_sample(seq: u64) -> pb::AgentMessage {
    let raw: HashMap<String, i64> = (0..122)
        .map(|k: i64| {
            let moving = if k % 8 == 0 { seq as i64 * 4096 } else { 0 };
            (
                format!("allocated_bytes.small_pool.counter_{k}"),
                k * 1_000_003 + moving,
            )
        })
        .collect();
    pb::AgentMessage {
        seq,
        body: Some(Body::Sample(pb::Sample {
            time_ns: 1_700_000_000_000_000_000 + seq as i64 * 250_000_000,
            allocator: vec![pb::AllocatorStats {
                device: 0,
                allocated_bytes: seq * 4096,
                reserved_bytes: seq * 8192,
                raw,
                ..Default::default()
            }],
            ..Default::default()
        })),
    }
}

/// The examples' last argument: where the store goes (default: the temp dir).
pub fn store_dir(arg: Option<&String>) -> std::path::PathBuf {
    arg.map_or_else(std::env::temp_dir, std::path::PathBuf::from)
}
