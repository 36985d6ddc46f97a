//! Per-NUMA-node memory: `/sys/devices/system/node/node<N>/meminfo`. A kill
//! bound to some nodes (a cpuset, a memory policy) ran out there, whatever
//! the host as a whole had free.

use std::path::{Path, PathBuf};

use super::text::{kb_line_bytes, read_opt};
use super::HostPaths;
use crate::pb;

/// Nodes read at most: the evidence stays bounded on a large machine.
const MAX_NODES: usize = 64;

/// Where the node directories are: beside the cgroup mount under the same
/// /sys (so a fake tree for tests holds them too).
pub fn node_root(paths: &HostPaths) -> PathBuf {
    paths
        .cgroup_root
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("/sys"))
        .join("devices/system/node")
}

/// Every node's meminfo, by node number; empty where the directory is
/// absent (a kernel without NUMA, a container with a masked /sys).
pub fn read_nodes(root: &Path) -> Vec<pb::NumaNode> {
    let Ok(dir) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut nodes: Vec<pb::NumaNode> = dir
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            let node: u32 = name.to_str()?.strip_prefix("node")?.parse().ok()?;
            let text = read_opt(&e.path().join("meminfo"))?;
            Some(parse_node_meminfo(node, &text))
        })
        .take(MAX_NODES)
        .collect();
    nodes.sort_by_key(|n| n.node);
    nodes
}

/// `Node 0 MemTotal:       32847412 kB` lines (kB there, bytes here;
/// HugePages_Total is a count).
pub fn parse_node_meminfo(node: u32, text: &str) -> pb::NumaNode {
    let mut out = pb::NumaNode {
        node,
        ..Default::default()
    };
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let field = match key.split_whitespace().last() {
            Some("MemTotal") => &mut out.mem_total_bytes,
            Some("MemFree") => &mut out.mem_free_bytes,
            Some("FilePages") => &mut out.file_bytes,
            Some("HugePages_Total") => &mut out.huge_pages_total,
            _ => continue,
        };
        if let Some(v) = kb_line_bytes(rest) {
            *field = v;
        }
    }
    out
}
