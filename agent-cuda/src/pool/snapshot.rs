//! The pool as a `SnapshotSummary`, the digest the PyTorch agent makes of
//! `torch.cuda.memory._snapshot()`, with the same caps.

use std::collections::HashMap;

use oomscope_agent_core::torch::{add_site, top_sites, MAX_SEGMENTS_FREE};

use super::state::State;
use crate::pb;

/// Where a block was allocated, as "file:line".
pub fn site_name(site: &std::panic::Location<'_>) -> String {
    format!("{}:{}", site.file(), site.line())
}

pub fn summarize(
    state: &State,
    device: i32,
    settings: pb::AllocatorSettings,
) -> pb::SnapshotSummary {
    let mut s = pb::SnapshotSummary {
        device,
        settings: Some(settings),
        ..Default::default()
    };
    let (mut alloc_n, mut alloc_b, mut free_n, mut free_b) = (0u64, 0u64, 0u64, 0u64);
    let mut sites = HashMap::new();
    let mut tags = HashMap::new();
    let mut segments_free = Vec::new();
    for (seg_id, seg) in state.segments.iter() {
        s.segments += 1;
        s.reserved_bytes += seg.size;
        let (mut allocated, mut largest) = (0u64, 0u64);
        for (_, b) in state.segment_blocks(seg_id) {
            if b.allocated {
                alloc_n += 1;
                alloc_b += b.size;
                allocated += b.size;
                s.requested_bytes += b.requested;
                if let Some(site) = b.site {
                    add_site(&mut sites, site_name(site), b.size);
                }
                if let Some(tag) = &b.tag {
                    add_site(&mut tags, tag.to_string(), b.size);
                }
            } else {
                free_n += 1;
                free_b += b.size;
                largest = largest.max(b.size);
            }
        }
        s.allocated_bytes += allocated;
        s.largest_free_block_bytes = s.largest_free_block_bytes.max(largest);
        if largest > 0 {
            segments_free.push(pb::SegmentFree {
                address: seg.addr,
                total_bytes: seg.size,
                allocated_bytes: allocated,
                largest_free_block_bytes: largest,
                pool: if seg.small { "small" } else { "large" }.into(),
                private_pool: false,
            });
        }
    }
    segments_free.sort_by(|a, b| {
        b.largest_free_block_bytes
            .cmp(&a.largest_free_block_bytes)
            .then(a.address.cmp(&b.address))
    });
    segments_free.truncate(MAX_SEGMENTS_FREE);
    s.segments_free = segments_free;
    s.blocks = vec![
        pb::BlockStateCount {
            state: "active_allocated".into(),
            count: alloc_n,
            bytes: alloc_b,
        },
        pb::BlockStateCount {
            state: "inactive".into(),
            count: free_n,
            bytes: free_b,
        },
    ];
    s.live_by_site = top_sites(sites);
    s.live_by_tag = top_sites(tags);
    s
}
