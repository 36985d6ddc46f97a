//! cgroup v2 details: memory.high throttling, memory.oom.group and
//! memory.swap.max. Over memory.high the kernel does not kill: it reclaims
//! and throttles the group's allocations, so the server slows (a warning
//! before an OOM at memory.max). memory.oom.group makes one OOM kill take
//! every task of the group. memory.swap.max bounds what the group may swap,
//! whatever the host's SwapTotal.

use crate::counters::LevelChange;
use crate::findings::Findings;
use crate::thrash::{THRASH_MIN_SOME_AVG10, THRASH_MIN_STALL_SHARE};
use crate::units::{bytes_short, seconds};

/// What memory.events `high` and memory.pressure show over the window at
/// the nearest level (own first) with memory.high set whose `high` count rose.
#[derive(Clone, Debug, PartialEq)]
pub struct HighThrottle {
    pub path: String,
    pub high_bytes: u64,
    /// memory.max of that level; 0 = none.
    pub max_bytes: u64,
    pub usage_bytes: u64,
    pub peak_bytes: u64,
    pub events_before: u64,
    pub events_after: u64,
    pub window_ns: i64,
    /// The level's memory.pressure "some" stall time over the window, and
    /// its avg10 at the end; None when the level has no PSI reading.
    pub stall_us: Option<u64>,
    pub some_avg10: f64,
    /// The stall is large enough to be felt (the thrash rule's thresholds).
    pub slowed: bool,
}

impl HighThrottle {
    pub fn events(&self) -> u64 {
        self.events_after - self.events_before
    }

    pub fn stall_share(&self) -> f64 {
        match self.stall_us {
            Some(us) if self.window_ns > 0 => us as f64 * 1e3 / self.window_ns as f64,
            _ => 0.0,
        }
    }

    pub fn evidence(&self) -> Vec<String> {
        let mut ev = vec![format!(
            "cgroup {} memory.events high {} -> {} over {}: usage went over memory.high {} (now {}, peak {}), so the kernel reclaimed and throttled the group's allocations",
            self.path,
            self.events_before,
            self.events_after,
            seconds(self.window_ns),
            bytes_short(self.high_bytes),
            bytes_short(self.usage_bytes),
            bytes_short(self.peak_bytes)
        )];
        ev.push(match self.stall_us {
            Some(us) => format!(
                "cgroup {} memory.pressure some stall +{:.3} s = {:.1}% of the window, avg10 {:.2}%: {}",
                self.path,
                us as f64 / 1e6,
                self.stall_share() * 100.0,
                self.some_avg10,
                if self.slowed {
                    "the server slowed"
                } else {
                    "too little stall to be felt yet"
                }
            ),
            None => format!("cgroup {} has no memory.pressure reading", self.path),
        });
        if self.max_bytes > 0 {
            ev.push(format!(
                "memory.max {} is the hard limit: past it the kernel OOM-kills; memory.high throttling is the warning before it",
                bytes_short(self.max_bytes)
            ));
        }
        ev
    }
}

/// memory.high throttling over the counters' window; None when no level
/// with memory.high set counted a `high` event.
pub fn high_throttle(f: &Findings) -> Option<HighThrottle> {
    let c = f.counters.as_ref()?;
    let window_ns = c.after.time_ns - c.before.time_ns;
    let l = c
        .levels()
        .find(|l| l.after.high_bytes > 0 && rose(l, |x| x.events_high))?;
    let (events_before, events_after) = l.pair(|x| x.events_high);
    let stall_us = match (l.before.and_then(|b| b.pressure), l.after.pressure) {
        (Some(b), Some(a)) => Some(a.some_total_us.saturating_sub(b.some_total_us)),
        _ => None,
    };
    let some_avg10 = l.after.pressure.map_or(0.0, |p| p.some_avg10);
    let mut t = HighThrottle {
        path: l.after.path.clone(),
        high_bytes: l.after.high_bytes,
        max_bytes: l.after.limit_bytes,
        usage_bytes: l.after.usage_bytes,
        peak_bytes: l.after.peak_bytes,
        events_before,
        events_after,
        window_ns,
        stall_us,
        some_avg10,
        slowed: false,
    };
    t.slowed = t.stall_share() >= THRASH_MIN_STALL_SHARE || some_avg10 >= THRASH_MIN_SOME_AVG10;
    Some(t)
}

fn rose(l: &LevelChange, f: fn(&crate::pb::CgroupLevel) -> u64) -> bool {
    let (b, a) = l.pair(f);
    a > b
}

/// memory.oom.group: where the kernel's record names tasks killed with the
/// victim's group, or a level with it set counted a group kill, the kernel
/// killed every task of that group (those at oom_score_adj -1000 excepted),
/// not only the victim. None where neither shows it and no level has it set.
pub fn oom_group_line(f: &Findings) -> Option<String> {
    let taken: Vec<&crate::pb::KernelOomKill> = f
        .evidence
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(crate::pb::event::Kind::KernelOomKill(k)) if !k.oom_group.is_empty() => Some(k),
            _ => None,
        })
        .collect();
    if let Some(first) = taken.first() {
        let tasks: Vec<String> = taken
            .iter()
            .map(|k| format!("{} ({})", k.pid, k.task))
            .collect();
        return Some(format!(
            "memory.oom.group on {}: the kernel's record shows the whole group killed with the victim: {}",
            first.oom_group,
            tasks.join(", ")
        ));
    }
    let c = f.counters.as_ref()?;
    let l = c.levels().find(|l| l.after.oom_group)?;
    let (b, a) = l.pair(|x| x.events_oom_group_kill);
    Some(if a > b {
        format!(
            "memory.oom.group = 1 on {}: memory.events oom_group_kill {b} -> {a}, the kernel killed the whole group (every task not at oom_score_adj -1000), not only the victim",
            l.after.path
        )
    } else {
        format!(
            "memory.oom.group = 1 on {}: an OOM kill there takes every task of the group (oom_group_kill {a}, unchanged)",
            l.after.path
        )
    })
}

/// memory.swap.max of the own level (v2; memsw on v1), against the host's
/// swap: the group may swap no more than it, whatever SwapTotal says. None
/// where it binds nothing: unlimited or unread, no swap on the host, or a
/// bound above the host's SwapTotal.
pub fn swap_bound_line(f: &Findings) -> Option<String> {
    let c = f.counters.as_ref()?;
    let own = c.after.cgroup.first()?;
    let limit = own.swap_limit_bytes?;
    let host_swap = c.after.system.as_ref()?.swap_total_bytes;
    if host_swap == 0 || limit >= host_swap {
        return None;
    }
    let host = format!("; the host's SwapTotal {}", bytes_short(host_swap));
    let file = if own.version == "v1" {
        "memory.memsw.limit_in_bytes less the memory limit"
    } else {
        "memory.swap.max"
    };
    Some(if limit == 0 {
        format!(
            "cgroup {} may not swap ({file} 0){host} does not help it",
            own.path
        )
    } else {
        format!(
            "cgroup {} swap {} of its {file} {}{host}",
            own.path,
            bytes_short(own.swap_bytes),
            bytes_short(limit)
        )
    })
}
