//! A cgroup's OOM-kill count, and which increments are its own: pure.
//!
//! v2 counts kills at the level itself in `memory.events.local`; v1's
//! `memory.oom_control` `oom_kill` and v2's `memory.events` count them
//! hierarchically (an ancestor counts its descendants' kills), so there a
//! level's own kills are its increase less its watched children's.

use oomscope_agent_core::pb;

/// The OOM kills a level's files count: (own where the kernel says so, hierarchical).
pub fn kills(level: &pb::CgroupLevel) -> Count {
    match level.version.as_str() {
        "v1" => Count {
            local: None,
            total: level.oom_control_oom_kill,
        },
        _ => Count {
            // memory.events.local arrived in Linux 5.2; a zero there with a
            // non-zero hierarchical count may be an older kernel, but it
            // equally is a parent whose children were killed: trust it when
            // the file was read (the level is not partial).
            local: (!level.partial).then_some(level.local_oom_kill),
            total: level.events_oom_kill,
        },
    }
}

/// One reading of a level's kill counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Count {
    /// Kills of this very level, where the kernel counts them apart.
    pub local: Option<u64>,
    /// Kills of this level and its descendants.
    pub total: u64,
}

/// The kills that are this level's own between two readings: the local
/// count's increase where there is one, else the total's increase less the
/// increase of its watched children's totals. A counter that went down (a
/// cgroup removed and made again under the same name) counts from zero.
pub fn own_increase(before: Count, now: Count, children_increase: u64) -> u64 {
    match (before.local, now.local) {
        (Some(b), Some(n)) => increase(b, n),
        _ => increase(before.total, now.total).saturating_sub(children_increase),
    }
}

/// `now - before`, or `now` when the counter restarted.
pub fn increase(before: u64, now: u64) -> u64 {
    if now >= before {
        now - before
    } else {
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_kills_are_the_local_increase_else_the_total_less_the_childrens() {
        let c = |local, total| Count { local, total };
        assert_eq!(own_increase(c(Some(1), 3), c(Some(2), 5), 3), 1);
        // v1: hierarchical only.
        assert_eq!(own_increase(c(None, 3), c(None, 5), 2), 0);
        assert_eq!(own_increase(c(None, 3), c(None, 5), 1), 1);
        assert_eq!(own_increase(c(None, 3), c(None, 3), 0), 0);
        // Made again: counts from zero.
        assert_eq!(own_increase(c(None, 5), c(None, 1), 0), 1);
    }
}
