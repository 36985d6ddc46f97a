//! What the kernel's record says beyond "the machine ran out": a kill bound
//! to some NUMA nodes (a cpuset, a memory policy) ran out on those nodes,
//! and a high-order allocation can fail with plenty free when no block is
//! large enough (fragmentation). Both are host RAM, and neither is cured by
//! more RAM. Measured here once; `causes::host_kernel` and `domain` read it.

use crate::evidence::KMSG_LAG_NS;
use crate::findings::{Findings, LOW_AVAILABLE_FRACTION};
use crate::pb;
use crate::units::{bytes_short, seconds};

/// At or above this order an allocation failure with memory free is
/// fragmentation. 3 is the kernel's PAGE_ALLOC_COSTLY_ORDER (32 KiB with
/// 4 KiB pages): up to it the kernel compacts and retries hard before it
/// fails, so an order-1 or -2 failure nearly always means memory itself ran
/// out; above it the allocation is "costly" and fails as soon as no block
/// of that size is free (THP, large kmalloc, DMA buffers, jumbo frames).
pub const HIGH_ORDER_MIN: u32 = 3;

/// A node list as the kernel prints it (`%*pbl`): "0-1,3" -> [0, 1, 3].
/// None for "(null)", the empty list, or anything else.
pub fn parse_node_list(s: &str) -> Option<Vec<u32>> {
    let mut nodes = Vec::new();
    for part in s.trim().split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                // A bitmap of at most 1024 nodes: a longer range is garbage.
                if b < a || b - a > 1024 {
                    return None;
                }
                nodes.extend(a..=b);
            }
            None => nodes.push(part.parse().ok()?),
        }
    }
    (!nodes.is_empty()).then_some(nodes)
}

/// Node numbers as the kernel writes them: [0, 1, 3] -> "0-1,3".
pub fn node_list(nodes: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < nodes.len() {
        let mut j = i;
        while j + 1 < nodes.len() && nodes[j + 1] == nodes[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", nodes[i], nodes[j])
        } else {
            nodes[i].to_string()
        });
        i = j + 1;
    }
    out.join(",")
}

/// A kill confined to some nodes, with those nodes' memory and the others'.
#[derive(Clone, Debug)]
pub struct NumaBinding<'a> {
    pub constraint: &'a str,
    pub nodes: Vec<u32>,
    /// Where the node list comes from, e.g. "cpuset numa0's mems_allowed".
    pub source: String,
    /// The newest per-node reading before the death, split by the binding.
    pub allowed: Vec<&'a pb::NumaNode>,
    pub others: Vec<&'a pb::NumaNode>,
    /// Where that reading comes from; None when no node was read.
    pub reading: Option<String>,
    /// Free memory on the allowed nodes at the kill, from the record's zone
    /// lists (the kernel shows only those nodes); None when not logged.
    pub free_at_kill: Option<u64>,
}

impl NumaBinding<'_> {
    pub fn nodes_text(&self) -> String {
        node_list(&self.nodes)
    }

    fn sum(nodes: &[&pb::NumaNode], f: fn(&pb::NumaNode) -> u64) -> u64 {
        nodes.iter().map(|n| f(n)).sum()
    }

    pub fn allowed_total(&self) -> u64 {
        Self::sum(&self.allowed, |n| n.mem_total_bytes)
    }

    pub fn allowed_free(&self) -> u64 {
        Self::sum(&self.allowed, |n| n.mem_free_bytes)
    }

    pub fn others_free(&self) -> u64 {
        Self::sum(&self.others, |n| n.mem_free_bytes)
    }

    /// "node 0: MemFree 80.0 MiB of 64.0 GiB", one per node.
    pub fn describe(nodes: &[&pb::NumaNode]) -> String {
        nodes
            .iter()
            .map(|n| {
                format!(
                    "node {}: MemFree {} of {}",
                    n.node,
                    bytes_short(n.mem_free_bytes),
                    bytes_short(n.mem_total_bytes)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The evidence lines: the binding, the allowed nodes' memory, the rest's.
    pub fn evidence(&self) -> Vec<String> {
        let mut ev = vec![format!(
            "{}: the kill was confined to NUMA node(s) {} ({}); memory on the other nodes could not be used",
            self.constraint,
            self.nodes_text(),
            self.source
        )];
        if let Some(free) = self.free_at_kill {
            ev.push(format!(
                "free on node(s) {} at the kill: {} (the kernel's zone lists)",
                self.nodes_text(),
                bytes_short(free)
            ));
        }
        match &self.reading {
            Some(label) => {
                ev.push(format!(
                    "allowed {} ({label})",
                    Self::describe(&self.allowed)
                ));
                if !self.others.is_empty() {
                    ev.push(format!(
                        "not allowed: {}; {} free there",
                        Self::describe(&self.others),
                        bytes_short(self.others_free())
                    ));
                }
            }
            None => ev.push("per-node memory (/sys/devices/system/node) was not read".into()),
        }
        ev
    }
}

/// The kill's NUMA binding: a CONSTRAINT_CPUSET kill is bound to the
/// cpuset's mems_allowed, a CONSTRAINT_MEMORY_POLICY kill to the policy's
/// nodemask (mems_allowed where the record has none). None for any other kill.
pub fn numa_binding<'a>(f: &Findings<'a>) -> Option<NumaBinding<'a>> {
    let (_, k) = f.kernel?;
    let (nodes, source) = match k.constraint.as_str() {
        "CONSTRAINT_CPUSET" => (
            parse_node_list(&k.mems_allowed),
            format!("cpuset {}'s mems_allowed", k.cpuset),
        ),
        "CONSTRAINT_MEMORY_POLICY" => match parse_node_list(&k.nodemask) {
            Some(n) => (Some(n), "the memory policy's nodemask".to_string()),
            None => (
                parse_node_list(&k.mems_allowed),
                "mems_allowed (the record has no nodemask)".to_string(),
            ),
        },
        _ => return None,
    };
    let nodes = nodes.unwrap_or_default();
    let e = f.evidence;
    let death = e.death_time();
    let reading = e
        .samples
        .iter()
        .rev()
        .filter(|s| death.is_none_or(|d| s.time_ns <= d))
        .find(|s| !s.numa_nodes.is_empty());
    let (allowed, others) = reading.map_or((Vec::new(), Vec::new()), |s| {
        s.numa_nodes.iter().partition(|n| nodes.contains(&n.node))
    });
    let label = reading.map(|s| match death {
        Some(d) => format!(
            "the last sample, {} before the death",
            seconds(d - s.time_ns)
        ),
        None => "the last sample".to_string(),
    });
    let free_at_kill = (!k.zones.is_empty()).then(|| {
        k.zones
            .iter()
            .filter(|z| nodes.is_empty() || nodes.contains(&z.node))
            .map(|z| z.free_bytes)
            .sum()
    });
    Some(NumaBinding {
        constraint: k.constraint.as_str(),
        nodes,
        source,
        allowed,
        others,
        reading: label,
        free_at_kill,
    })
}

/// A failed allocation of 2^order pages, from the kernel's OOM record or
/// its "page allocation failure" warning, and whether memory was free.
#[derive(Clone, Debug)]
pub struct HighOrder {
    pub order: u32,
    pub pid: u32,
    pub task: String,
    /// The kernel's line, for quoting.
    pub line: String,
    /// True for a "page allocation failure" (no kill).
    pub warning: bool,
    /// Free on the zones the kernel showed, their high watermarks summed,
    /// and the free bytes in blocks of at least `order`; None when the
    /// record has no zone lists.
    pub free_bytes: Option<u64>,
    pub high_bytes: Option<u64>,
    pub free_at_order_bytes: Option<u64>,
    /// (MemAvailable, MemTotal, where read) before the death, where the
    /// zone lists are missing.
    pub available: Option<(u64, u64, String)>,
    /// Memory was free (above the zones' high watermarks, else MemAvailable
    /// at or above LOW_AVAILABLE_FRACTION of MemTotal): the failure was the
    /// block size, not the amount.
    pub fragmented: bool,
}

impl HighOrder {
    /// The size asked for, at the zones' page size (4 KiB where unknown).
    pub fn request_bytes(&self, page_bytes: u64) -> u64 {
        page_bytes << self.order
    }

    pub fn evidence(&self) -> Vec<String> {
        let what = if self.warning {
            "the kernel refused"
        } else {
            "the kernel's OOM record:"
        };
        let mut ev = vec![format!("kernel: {}", self.line)];
        ev.push(format!(
            "{what} an order-{} allocation ({} contiguous) for pid {} ({}); order {} and above count as high-order here (the kernel's costly order is 3)",
            self.order,
            bytes_short(self.request_bytes(4096)),
            self.pid,
            self.task,
            HIGH_ORDER_MIN
        ));
        if let (Some(free), Some(high)) = (self.free_bytes, self.high_bytes) {
            let at_order = self.free_at_order_bytes.map_or(String::new(), |b| {
                format!(
                    "; in blocks of order {} or more: {}",
                    self.order,
                    bytes_short(b)
                )
            });
            ev.push(format!(
                "free at the failure {} against high watermarks of {} (the kernel's zone lists){at_order}",
                bytes_short(free),
                bytes_short(high)
            ));
        } else if let Some((avail, total, label)) = &self.available {
            ev.push(format!(
                "MemAvailable {} of MemTotal {} ({label}); the record has no zone lists",
                bytes_short(*avail),
                bytes_short(*total)
            ));
        }
        ev.push(if self.fragmented {
            "memory was free but not in blocks large enough: fragmentation, not exhaustion".into()
        } else {
            "little memory was free: a high-order request at exhaustion".into()
        });
        ev
    }
}

/// The high-order failure behind this failure: the kernel's OOM kill of a
/// process of the instance (not a memcg kill: a cgroup's limit counts pages,
/// not blocks), else a "page allocation failure" of one of its processes
/// where the process failed. None below HIGH_ORDER_MIN.
pub fn high_order(f: &Findings) -> Option<HighOrder> {
    let e = f.evidence;
    let from_kill = f
        .kernel
        .filter(|(_, k)| k.constraint != "CONSTRAINT_MEMCG")
        .and_then(|(_, k)| {
            let order = k.order.filter(|&o| o >= HIGH_ORDER_MIN)?;
            let line = k
                .lines
                .iter()
                .find(|l| l.contains("invoked oom-killer"))
                .cloned()
                .unwrap_or_default();
            Some((order, k.pid, k.task.clone(), line, false, &k.zones))
        });
    let from_warning = || {
        if !f.failed {
            return None;
        }
        let (_, a) = alloc_failure(e)?;
        (a.order >= HIGH_ORDER_MIN).then(|| {
            (
                a.order,
                a.pid,
                a.task.clone(),
                a.line.clone(),
                true,
                &a.zones,
            )
        })
    };
    let (order, pid, task, line, warning, zones) = from_kill.or_else(from_warning)?;
    let free: u64 = zones.iter().map(|z| z.free_bytes).sum();
    let high: u64 = zones.iter().map(|z| z.high_bytes).sum();
    let with_marks = !zones.is_empty() && zones.iter().all(|z| z.high_bytes > 0);
    let at_order = zones.iter().filter(|z| !z.blocks.is_empty()).map(|z| {
        z.blocks
            .iter()
            .enumerate()
            .skip(order as usize)
            .map(|(o, n)| n.saturating_mul(z.page_bytes << o))
            .sum::<u64>()
    });
    let free_at_order_bytes = zones
        .iter()
        .any(|z| !z.blocks.is_empty())
        .then(|| at_order.sum());
    let available = f
        .system_at_death()
        .filter(|(s, _)| s.mem_total_bytes > 0)
        .map(|(s, label)| (s.mem_available_bytes, s.mem_total_bytes, label));
    let fragmented = if with_marks {
        free > high
    } else {
        available
            .as_ref()
            .is_some_and(|(a, t, _)| *a as f64 >= *t as f64 * LOW_AVAILABLE_FRACTION)
    };
    Some(HighOrder {
        order,
        pid,
        task,
        line,
        warning,
        free_bytes: with_marks.then_some(free),
        high_bytes: with_marks.then_some(high),
        free_at_order_bytes,
        available: (!with_marks).then_some(available).flatten(),
        fragmented,
    })
}

/// The newest "page allocation failure" the kernel logged for a process of
/// this instance (`oomscope run` sends only its own tree's); where an exit
/// is judged, within that child's life (as the kernel's kill record is).
pub fn alloc_failure(e: &crate::Evidence) -> Option<(i64, &pb::KernelAllocFailure)> {
    let life = e.child_exit().map(|(t, x)| {
        t.saturating_sub(x.runtime_ns as i64 + KMSG_LAG_NS)..=t.saturating_add(KMSG_LAG_NS)
    });
    e.events.iter().rev().find_map(|ev| match &ev.kind {
        Some(pb::event::Kind::KernelAllocFailure(a))
            if life.as_ref().is_none_or(|l| l.contains(&ev.time_ns)) =>
        {
            Some((ev.time_ns, a))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_read_and_write_as_the_kernel_prints_them() {
        assert_eq!(parse_node_list("0-1,3"), Some(vec![0, 1, 3]));
        assert_eq!(parse_node_list("0"), Some(vec![0]));
        assert_eq!(parse_node_list("(null)"), None);
        assert_eq!(parse_node_list(""), None);
        assert_eq!(parse_node_list("3-1"), None);
        assert_eq!(node_list(&[0, 1, 3]), "0-1,3");
        assert_eq!(node_list(&[2]), "2");
        assert_eq!(node_list(&[0, 1, 2, 3]), "0-3");
    }
}
