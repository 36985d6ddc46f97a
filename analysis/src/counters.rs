//! Kernel counters before and after a failure, and what their movement says:
//! which cgroup level's limit was hit (v1 and v2), or a global OOM.

use crate::evidence::{is_finite_limit, Evidence};
use crate::pb;
use crate::units::bytes;

/// v1 `max_usage_in_bytes` can stop a page or so short of `limit_in_bytes`
/// (charges are batched per CPU), so "reached the limit" allows 64 KiB of slack.
pub const LIMIT_SLACK_BYTES: u64 = 64 * 1024;

/// Two readings of the same counters, and where they came from.
#[derive(Clone, Debug)]
pub struct CounterChange {
    pub before: pb::HostCounters,
    pub after: pb::HostCounters,
    /// "child start/exit", "samples", ... for evidence lines.
    pub source: &'static str,
}

impl CounterChange {
    /// The best before/after pair: the child's own exit readings, else its
    /// start readings or the first sample as "before", else the first and
    /// last samples (an in-process agent, or a lost one).
    pub fn from_evidence(e: &Evidence) -> Option<CounterChange> {
        let first_sample = e.samples.first().map(sample_counters);
        if let Some((_, exit)) = e.incident_exit() {
            if let Some(after) = &exit.after {
                let before = exit
                    .before
                    .clone()
                    .map(|b| (b, "child start/exit"))
                    .or_else(|| {
                        e.child_start(exit.pid)?
                            .counters
                            .clone()
                            .map(|b| (b, "child start/exit"))
                    })
                    .or_else(|| first_sample.clone().map(|b| (b, "first sample/child exit")));
                if let Some((before, source)) = before {
                    return Some(CounterChange {
                        before,
                        after: after.clone(),
                        source,
                    });
                }
            }
        }
        if e.samples.len() >= 2 {
            let last = e.samples.last().map(sample_counters)?;
            return Some(CounterChange {
                before: first_sample?,
                after: last,
                source: "first/last sample",
            });
        }
        None
    }

    /// Each level of the "after" reading (own first) with its "before" twin.
    pub fn levels(&self) -> impl Iterator<Item = LevelChange<'_>> {
        self.after
            .cgroup
            .iter()
            .enumerate()
            .map(|(depth, after)| LevelChange {
                before: self.before.cgroup.iter().find(|b| b.path == after.path),
                after,
                depth,
            })
    }

    /// /proc/vmstat oom_kill growth; None when either reading lacks it.
    pub fn vmstat_oom_kill(&self) -> Option<(u64, u64)> {
        let b = self.before.system.as_ref()?;
        let a = self.after.system.as_ref()?;
        Some((b.vmstat_oom_kill, a.vmstat_oom_kill))
    }

    /// True when any OOM-related kernel counter rose: a cgroup's oom_kill,
    /// oom or local oom, failcnt or `max` events, or /proc/vmstat oom_kill.
    pub fn any_oom_counter_moved(&self) -> bool {
        let vm = self.vmstat_oom_kill().is_some_and(|(b, a)| a > b);
        vm || self.levels().any(|l| l.any_moved())
    }

    pub fn moved_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self.levels().flat_map(|l| l.moved_lines()).collect();
        if let Some((b, a)) = self.vmstat_oom_kill().filter(|(b, a)| a > b) {
            lines.push(format!("/proc/vmstat oom_kill {b} -> {a}"));
        }
        lines
    }
}

fn sample_counters(s: &pb::Sample) -> pb::HostCounters {
    pb::HostCounters {
        time_ns: s.time_ns,
        cgroup: s.cgroup.clone(),
        system: s.system,
    }
}

/// One cgroup level's two readings.
#[derive(Clone, Copy, Debug)]
pub struct LevelChange<'a> {
    /// None when the level was not read before (its counters then read as not moved).
    pub before: Option<&'a pb::CgroupLevel>,
    pub after: &'a pb::CgroupLevel,
    /// 0 = the victim's own cgroup, 1 = its parent, ...
    pub depth: usize,
}

/// Reads one counter of a level.
type Counter = fn(&pb::CgroupLevel) -> u64;

/// The counters that say something about an OOM, with their file names.
const COUNTERS: [(&str, Counter); 8] = [
    ("memory.oom_control oom_kill", |l| l.oom_control_oom_kill),
    ("memory.events.local oom", |l| l.local_oom),
    ("memory.events.local oom_kill", |l| l.local_oom_kill),
    ("memory.events oom", |l| l.events_oom),
    ("memory.events oom_kill", |l| l.events_oom_kill),
    ("memory.events oom_group_kill", |l| l.events_oom_group_kill),
    ("memory.failcnt", |l| l.failcnt),
    ("memory.events max", |l| l.events_max),
];

impl LevelChange<'_> {
    /// (before, after) of a counter; a level without a before reading never "rises".
    pub fn pair(&self, f: Counter) -> (u64, u64) {
        let a = f(self.after);
        (self.before.map_or(a, f), a)
    }

    pub fn rose(&self, f: Counter) -> bool {
        let (b, a) = self.pair(f);
        a > b
    }

    pub fn any_moved(&self) -> bool {
        COUNTERS.iter().any(|(_, f)| self.rose(*f))
    }

    pub fn oom_kill_rose(&self) -> bool {
        self.rose(|l| l.oom_control_oom_kill)
            || self.rose(|l| l.local_oom_kill)
            || self.rose(|l| l.events_oom_kill)
    }

    pub fn limit(&self) -> Option<u64> {
        Some(self.after.limit_bytes).filter(|&l| is_finite_limit(l))
    }

    /// The level's peak (max_usage_in_bytes / memory.peak) reached its limit.
    pub fn peak_at_limit(&self) -> bool {
        self.limit().is_some_and(|l| {
            self.after.peak_bytes > 0
                && self.after.peak_bytes >= l.saturating_sub(LIMIT_SLACK_BYTES)
        })
    }

    /// "memory.failcnt 3 -> 250"-style lines for each counter that rose.
    pub fn moved_lines(&self) -> Vec<String> {
        COUNTERS
            .iter()
            .filter(|(_, f)| self.rose(*f))
            .map(|(name, f)| {
                let (b, a) = self.pair(*f);
                format!("cgroup {} {name} {b} -> {a}", self.after.path)
            })
            .collect()
    }

    /// "limit 64.0 MiB (67108864 bytes); peak 64.0 MiB (67108864 bytes)".
    pub fn limit_and_peak(&self) -> String {
        let limit = self
            .limit()
            .map_or_else(|| "no limit".to_string(), |l| format!("limit {}", bytes(l)));
        let peak = if self.after.peak_bytes > 0 {
            format!("peak {}", bytes(self.after.peak_bytes))
        } else {
            format!("usage {}", bytes(self.after.usage_bytes))
        };
        format!("{limit}; {peak}")
    }

    fn relation(&self) -> String {
        match self.depth {
            0 => "own cgroup".to_string(),
            1 => "parent".to_string(),
            n => format!("ancestor, {n} levels up"),
        }
    }
}

/// A cgroup memory limit that was hit, and the level that owns it.
#[derive(Clone, Debug, PartialEq)]
pub struct MemcgOom {
    /// The victim's own cgroup (the first level).
    pub own_path: String,
    pub owner_path: String,
    pub owner_depth: usize,
    pub limit_bytes: u64,
    pub peak_bytes: u64,
    pub usage_bytes: u64,
    pub version: String,
    /// How sure: an OOM counter at the owner, or an owner inferred from a kill.
    pub confidence: f64,
    pub evidence: Vec<String>,
}

/// Which level's limit was hit, if any; `sigkill` says the victim died of
/// SIGKILL (then a `failcnt` rise at a level at its limit is enough).
///
/// - v2: `memory.events.local oom` rises at the owning level only; the
///   hierarchical `memory.events oom` rises at the owner and its ancestors, so
///   the deepest level where it rose is the owner.
/// - v1: `oom_control oom_kill` rises on the victim's own cgroup even when the
///   limit is a parent's; the owner is the nearest level whose peak reached its
///   limit and whose `failcnt` rose.
pub fn find_memcg_oom(change: &CounterChange, sigkill: bool) -> Option<MemcgOom> {
    let levels: Vec<LevelChange> = change.levels().collect();
    let own_path = levels.first()?.after.path.clone();
    let killed = levels
        .iter()
        .any(|l| l.oom_kill_rose() || l.after.under_oom)
        || sigkill;
    let victim = levels.iter().find(|l| l.oom_kill_rose());

    let (owner, confidence, reason) = if let Some(l) =
        levels.iter().find(|l| l.rose(|c| c.local_oom))
    {
        let (b, a) = l.pair(|c| c.local_oom);
        (
            *l,
            0.95,
            format!("memory.events.local oom {b} -> {a} (the limit was hit at this level)"),
        )
    } else if let Some(l) = levels.iter().find(|l| l.rose(|c| c.events_oom)) {
        let (b, a) = l.pair(|c| c.events_oom);
        (
            *l,
            0.9,
            format!("memory.events oom {b} -> {a} (the deepest level where it rose)"),
        )
    } else if let Some(l) = levels.iter().find(|l| {
        killed && l.peak_at_limit() && (l.rose(|c| c.failcnt) || l.rose(|c| c.events_max))
    }) {
        let line = if l.rose(|c| c.failcnt) {
            let (b, a) = l.pair(|c| c.failcnt);
            format!("memory.failcnt {b} -> {a} (the nearest level at its limit)")
        } else {
            let (b, a) = l.pair(|c| c.events_max);
            format!("memory.events max {b} -> {a} (the nearest level at its limit)")
        };
        (*l, 0.9, line)
    } else if let Some(l) = levels
        .iter()
        .find(|l| victim.is_some() && l.peak_at_limit())
    {
        // Seen on kernel 6.18 (v1): with memory.memsw.limit_in_bytes equal to
        // the limit, the memsw counter fails the charge first and
        // memory.failcnt stays 0; an OOM kill plus a peak at the limit decides.
        (
            *l,
            0.85,
            "an OOM kill with this level's peak at its limit (the nearest such level)".to_string(),
        )
    } else if let (Some(v), false) = (victim, change.vmstat_oom_kill().is_some_and(|(b, a)| a > b))
    {
        // A cgroup kill without a global one and no level visibly at its limit
        // (a missing peak file, say): the nearest limit is the likely owner.
        let l = levels.iter().find(|l| l.limit().is_some())?;
        let (b, a) = v.pair(|c| c.oom_control_oom_kill.max(c.events_oom_kill));
        (*l, 0.6, format!("owner inferred: the nearest level with a limit; oom_kill {b} -> {a} at {} without a global OOM", v.after.path))
    } else {
        return None;
    };

    let limit_bytes = owner.limit().unwrap_or(0);
    let mut evidence = vec![format!(
        "cgroup {} ({}) {}; {reason}",
        owner.after.path,
        owner.relation(),
        owner.limit_and_peak()
    )];
    for l in &levels {
        let prefix = format!("cgroup {} ", l.after.path);
        for line in l.moved_lines() {
            // The owner's deciding counter is already in the first line.
            let counter = line.trim_start_matches(prefix.as_str());
            if !(l.depth == owner.depth && evidence[0].contains(counter)) {
                evidence.push(line);
            }
        }
    }
    evidence.extend(oom_group_lines(&levels, false));
    // v1's telling detail: the owner's own oom_kill stays put while the victim's rises.
    let v1_victim = levels.iter().find(|l| l.rose(|c| c.oom_control_oom_kill));
    if let Some(v) = v1_victim.filter(|v| v.depth != owner.depth) {
        let (b, a) = owner.pair(|c| c.oom_control_oom_kill);
        let owner_kills = if a == b {
            format!("stays at {a}")
        } else {
            format!("{b} -> {a}")
        };
        evidence.push(format!(
            "the victim lives in {} below the owner; the owner's own memory.oom_control oom_kill {owner_kills}",
            v.after.path
        ));
    }
    Some(MemcgOom {
        own_path,
        owner_path: owner.after.path.clone(),
        owner_depth: owner.depth,
        limit_bytes,
        peak_bytes: owner.after.peak_bytes,
        usage_bytes: owner.after.usage_bytes,
        version: owner.after.version.clone(),
        confidence,
        evidence,
    })
}

/// How sure a lost agent's cgroup OOM is: its last readings show the limit
/// hit and reclaim failing, but no kill counter read after the kill confirms it.
pub const LOST_MEMCG_CONFIDENCE: f64 = 0.7;

/// A usage at or above this share of the limit in the last reading counts as
/// "at the limit" where the level has no peak file.
const NEAR_LIMIT_FRACTION: f64 = 0.95;

/// For an agent lost without a goodbye (SIGKILL takes the supervisor with
/// its child, e.g. when it shares the cgroup it watches): the nearest level
/// at its limit whose `failcnt` (v1) or `max` events (v2) rose over its last
/// readings is the likely owner of a cgroup OOM. No kill counter could be
/// read after the kill, so the confidence says "likely".
pub fn find_lost_memcg_oom(change: &CounterChange) -> Option<MemcgOom> {
    let levels: Vec<LevelChange> = change.levels().collect();
    let own_path = levels.first()?.after.path.clone();
    let owner = levels.iter().find(|l| {
        let near = l.peak_at_limit()
            || l.limit()
                .is_some_and(|lim| l.after.usage_bytes as f64 >= lim as f64 * NEAR_LIMIT_FRACTION);
        near && (l.rose(|c| c.failcnt) || l.rose(|c| c.events_max))
    })?;
    let (name, (b, a)) = if owner.rose(|c| c.failcnt) {
        ("memory.failcnt", owner.pair(|c| c.failcnt))
    } else {
        ("memory.events max", owner.pair(|c| c.events_max))
    };
    let limit_bytes = owner.limit().unwrap_or(0);
    let mut evidence = vec![
        format!(
            "cgroup {} ({}) {}; usage {} of it in the last reading; {name} {b} -> {a} (the nearest level at its limit)",
            owner.after.path,
            owner.relation(),
            owner.limit_and_peak(),
            bytes(owner.after.usage_bytes)
        ),
        format!(
            "the agent was lost without a goodbye while this limit was being hit: likely killed by a cgroup OOM (confidence {LOST_MEMCG_CONFIDENCE:.2}; no kill counter could be read after it)"
        ),
    ];
    evidence.extend(oom_group_lines(&levels, true));
    Some(MemcgOom {
        own_path,
        owner_path: owner.after.path.clone(),
        owner_depth: owner.depth,
        limit_bytes,
        peak_bytes: owner.after.peak_bytes,
        usage_bytes: owner.after.usage_bytes,
        version: owner.after.version.clone(),
        confidence: LOST_MEMCG_CONFIDENCE,
        evidence,
    })
}

/// v2 `memory.oom.group` levels: a kill there takes every task of the group
/// (the supervisor too, unless at oom_score_adj -1000). Named when its
/// `oom_group_kill` rose, or, for a lost agent (whose readings end before
/// the kill), whenever it is set.
fn oom_group_lines(levels: &[LevelChange], lost: bool) -> Vec<String> {
    levels
        .iter()
        .filter(|l| l.after.oom_group)
        .filter_map(|l| {
            let (b, a) = l.pair(|c| c.events_oom_group_kill);
            if a > b {
                Some(format!(
                    "cgroup {} memory.oom.group = 1 and memory.events oom_group_kill {b} -> {a}: the kernel killed the whole group, not only the chosen victim",
                    l.after.path
                ))
            } else if lost {
                Some(format!(
                    "cgroup {} memory.oom.group = 1: an OOM kill there takes every task of the group, the supervisor included unless at oom_score_adj -1000",
                    l.after.path
                ))
            } else {
                None
            }
        })
        .collect()
}

/// A global (system RAM) OOM kill: /proc/vmstat oom_kill rose.
pub fn global_oom_kill(change: &CounterChange) -> Option<(u64, u64)> {
    change.vmstat_oom_kill().filter(|(b, a)| a > b)
}
