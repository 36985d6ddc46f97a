//! The pool as a `SnapshotSummary`, the digest the PyTorch agent makes of
//! `torch.cuda.memory._snapshot()`, with the same caps.

use std::collections::HashMap;

use oomscope_agent_core::torch::{MAX_SEGMENTS_FREE, MAX_SITES, OTHER_SITES};

use super::state::State;
use crate::pb;

/// Where a block was allocated, as "file:line".
pub fn site_name(site: &std::panic::Location<'_>) -> String {
    format!("{}:{}", site.file(), site.line())
}

fn add(map: &mut HashMap<String, (u64, u64)>, key: String, bytes: u64) {
    let e = map.entry(key).or_default();
    e.0 += bytes;
    e.1 += 1;
}

/// Largest first; past [`MAX_SITES`] the rest fold into one entry, so the
/// list still sums to the live bytes.
fn capped(map: HashMap<String, (u64, u64)>) -> Vec<pb::SiteBytes> {
    let mut v: Vec<pb::SiteBytes> = map
        .into_iter()
        .map(|(site, (bytes, blocks))| pb::SiteBytes {
            site,
            bytes,
            blocks,
        })
        .collect();
    v.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
    if v.len() > MAX_SITES {
        let rest = v.split_off(MAX_SITES - 1);
        v.push(pb::SiteBytes {
            site: OTHER_SITES.to_string(),
            bytes: rest.iter().map(|s| s.bytes).sum(),
            blocks: rest.iter().map(|s| s.blocks).sum(),
        });
    }
    v
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
                    add(&mut sites, site_name(site), b.size);
                }
                if let Some(tag) = &b.tag {
                    add(&mut tags, tag.to_string(), b.size);
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
    s.live_by_site = capped(sites);
    s.live_by_tag = capped(tags);
    s
}
