//! Swap thrash: the process slows rather than dies, so it is read from the
//! sample window, not from a death.
//!
//! Every measure is relative, so that one rule holds on any host and for any
//! runtime: refaults against the working set they belong to, stall time
//! against the window. A page count alone says nothing (a large server
//! refaults more pages in a healthy minute than a small one thrashing), and a
//! host without swap can only thrash on page cache, which must have slowed
//! the process (PSI) to count.

use crate::pb;
use crate::units::bytes_short;

/// A floor against noise: fewer refaulted pages than this over the window
/// (16 MiB of 4 KiB pages) is never thrash, whatever the shares say.
pub const THRASH_MIN_REFAULT_PAGES: u64 = 4096;

/// Refaulted bytes over the window, as a share of the working set of their
/// scope (the cgroup's usage, or the host's used RAM), at or above which the
/// working set no longer fits: a twentieth of it evicted and read back.
pub const THRASH_MIN_REFAULT_SHARE: f64 = 0.05;

/// PSI "some" stall time over the window, as a share of wall time, that
/// shows tasks waited on memory: refaults alone can come from a one-off cache
/// eviction that nobody waited for, refaults plus stall cannot.
pub const THRASH_MIN_STALL_SHARE: f64 = 0.05;

/// Refaults and swap-in are counted in pages of this size.
const PAGE_BYTES: u64 = 4096;

/// The process's own major faults (or its cgroup's `pgmajfault`) over the
/// window at or above which its own pages were being read back: 4 MiB of
/// 4 KiB pages, above the few faults of a process that merely runs.
pub const OWN_MIN_MAJOR_FAULTS: u64 = 1024;

/// PSI some avg10 (percent) that counts as stalling when the totals are not
/// available: a tenth of wall time waiting on memory is felt as a slowdown.
pub const THRASH_MIN_SOME_AVG10: f64 = 10.0;

/// What the sample window shows about refaults, swapping and memory pressure.
#[derive(Clone, Debug, PartialEq)]
pub struct ThrashReading {
    pub window_s: f64,
    /// "cgroup /x" or "system".
    pub refault_scope: String,
    pub refault_file: u64,
    pub refault_anon: u64,
    pub pswpin: u64,
    pub pswpout: u64,
    /// The memory the refaults are measured against: the cgroup's usage,
    /// or the host's used RAM (MemTotal − MemAvailable); the most seen.
    pub working_set_bytes: u64,
    /// The host has swap (SwapTotal > 0): anonymous memory can thrash too.
    pub swap: bool,
    /// "cgroup /x", "system", or "" when no PSI was read.
    pub psi_scope: String,
    pub some_avg10: f64,
    pub full_avg10: f64,
    pub some_stall_us: u64,
    pub full_stall_us: u64,
    /// The process's own major faults over the window (its `process` readings).
    pub own_major_faults: u64,
    /// Its own (non-root) cgroup's refaults and `pgmajfault` over the window;
    /// 0 when it lives in the root cgroup, whose counters are the host's.
    pub cgroup_refaults: u64,
    pub cgroup_major_faults: u64,
    /// Its own cgroup's PSI showed it waiting on memory.
    pub cgroup_stalled: bool,
    /// The pressure was the process's own: its major faults, or its
    /// cgroup's refaults, major faults or PSI moved.
    pub own_pressure: bool,
    /// The thresholds above were met, and the pressure was its own.
    pub thrashing: bool,
    /// The thresholds were met host-wide but nothing of the process's own
    /// moved: other jobs' pressure, a context fact, never its domain or cause.
    pub neighbour_pressure: bool,
}

impl ThrashReading {
    pub fn refaults(&self) -> u64 {
        self.refault_file + self.refault_anon
    }

    pub fn refaults_per_s(&self) -> f64 {
        self.refaults() as f64 / self.window_s
    }

    /// Refaulted bytes over the window against the working set; 0 when the
    /// working set is unknown (then no share can be claimed).
    pub fn refault_share(&self) -> f64 {
        share(self.refaults() * PAGE_BYTES, self.working_set_bytes)
    }

    /// Swapped-in bytes over the window against the working set.
    pub fn swapin_share(&self) -> f64 {
        share(self.pswpin * PAGE_BYTES, self.working_set_bytes)
    }

    /// PSI "some" stall time as a share of the window.
    pub fn stall_share(&self) -> f64 {
        self.some_stall_us as f64 / (self.window_s * 1e6)
    }

    pub fn evidence(&self) -> Vec<String> {
        let of_working_set = if self.working_set_bytes > 0 {
            format!(
                "{:.1}% of the working set ({} in use)",
                self.refault_share() * 100.0,
                bytes_short(self.working_set_bytes)
            )
        } else {
            "the working set was not read".to_string()
        };
        let mut lines = vec![format!(
            "{} workingset refaults +{} pages (file {}, anon {}) over {:.1} s = {:.1}/s: {of_working_set}; threshold {:.0}%",
            self.refault_scope,
            self.refaults(),
            self.refault_file,
            self.refault_anon,
            self.window_s,
            self.refaults_per_s(),
            THRASH_MIN_REFAULT_SHARE * 100.0
        )];
        lines.push(format!(
            "swap pswpin +{} pages ({:.1}/s), pswpout +{} pages ({:.1}/s)",
            self.pswpin,
            self.pswpin as f64 / self.window_s,
            self.pswpout,
            self.pswpout as f64 / self.window_s
        ));
        if self.psi_scope.is_empty() {
            lines.push("no memory PSI readings".to_string());
        } else {
            lines.push(format!(
                "{} PSI memory some avg10 {:.2}%, full avg10 {:.2}%; stall total +{:.3} s (some), +{:.3} s (full) = {:.1}% of the window",
                self.psi_scope,
                self.some_avg10,
                self.full_avg10,
                self.some_stall_us as f64 / 1e6,
                self.full_stall_us as f64 / 1e6,
                self.stall_share() * 100.0
            ));
        }
        if !self.swap {
            lines.push(
                "no swap on this host: only page-cache refaults that slowed the process (PSI) count as thrash".to_string(),
            );
        }
        lines.push(self.own_line());
        lines
    }

    /// What moved of the process's own: its major faults, its cgroup's.
    pub fn own_line(&self) -> String {
        format!(
            "its own pressure: major faults +{} (threshold {OWN_MIN_MAJOR_FAULTS}), its cgroup's refaults +{} (threshold {THRASH_MIN_REFAULT_PAGES}) and pgmajfault +{}, its cgroup's PSI {}",
            self.own_major_faults,
            self.cgroup_refaults,
            self.cgroup_major_faults,
            if self.cgroup_stalled { "stalled" } else { "quiet or not read" }
        )
    }

    /// The context line of pressure that was not the process's own.
    pub fn neighbour_line(&self) -> Option<String> {
        self.neighbour_pressure.then(|| {
            format!(
                "neighbour_pressure: the host thrashed ({} refaults +{} pages over {:.1} s, {:.1}% of the working set; {} PSI some avg10 {:.2}%, stall {:.1}% of the window), but not this process: {}; other jobs' pressure, context only",
                self.refault_scope,
                self.refaults(),
                self.window_s,
                self.refault_share() * 100.0,
                if self.psi_scope.is_empty() { "no" } else { self.psi_scope.as_str() },
                self.some_avg10,
                self.stall_share() * 100.0,
                self.own_line()
            )
        })
    }
}

/// Reads the window from the first to the last sample; None with fewer than
/// two samples or no time between them.
pub fn read_thrash(samples: &[pb::Sample]) -> Option<ThrashReading> {
    let (first, last) = (samples.first()?, samples.last()?);
    let window_s = (last.time_ns - first.time_ns) as f64 / 1e9;
    if window_s <= 0.0 {
        return None;
    }
    let grow = |f: &dyn Fn(&pb::Sample) -> Option<u64>| match (f(first), f(last)) {
        (Some(b), Some(a)) => a.saturating_sub(b),
        _ => 0,
    };
    // The figures are read at the larger scope (the own cgroup's, else the
    // system's, which includes the neighbours); whose pressure it was is
    // decided apart, from the process's own counters (`own_pressure`).
    let own = |s: &pb::Sample| s.cgroup.first().cloned();
    let cg_file = grow(&|s| own(s).map(|l| l.workingset_refault_file));
    let cg_anon = grow(&|s| own(s).map(|l| l.workingset_refault_anon));
    let sys_file = grow(&|s| s.system.map(|m| m.vmstat_workingset_refault_file));
    let sys_anon = grow(&|s| s.system.map(|m| m.vmstat_workingset_refault_anon));
    let own_path = last
        .cgroup
        .first()
        .map(|l| l.path.clone())
        .unwrap_or_default();
    let cgroup_scope = cg_file + cg_anon >= sys_file + sys_anon && cg_file + cg_anon > 0;
    let (refault_scope, refault_file, refault_anon) = if cgroup_scope {
        (format!("cgroup {own_path}"), cg_file, cg_anon)
    } else {
        ("system".to_string(), sys_file, sys_anon)
    };
    let working_set_bytes = samples
        .iter()
        .filter_map(|s| {
            if cgroup_scope {
                own(s).map(|l| l.usage_bytes)
            } else {
                s.system
                    .map(|m| m.mem_total_bytes.saturating_sub(m.mem_available_bytes))
            }
        })
        .max()
        .unwrap_or(0);
    // The host's swap, unless the own cgroup may not swap (memory.swap.max 0).
    let swap = last.system.is_some_and(|m| m.swap_total_bytes > 0)
        && own(last).and_then(|l| l.swap_limit_bytes) != Some(0);

    let pressure_of = |s: &pb::Sample, cgroup: bool| -> Option<pb::Pressure> {
        if cgroup {
            own(s).and_then(|l| l.pressure)
        } else {
            s.system.and_then(|m| m.pressure)
        }
    };
    // Prefer the cgroup's PSI when it has any, else the system's.
    let cgroup_psi = samples
        .iter()
        .any(|s| pressure_of(s, true).is_some_and(|p| p.some_total_us > 0));
    let system_psi = samples
        .iter()
        .any(|s| pressure_of(s, false).is_some_and(|p| p.some_total_us > 0 || p.some_avg10 > 0.0));
    let (psi_scope, use_cgroup) = if cgroup_psi {
        (format!("cgroup {own_path}"), true)
    } else if system_psi {
        ("system".to_string(), false)
    } else {
        (String::new(), false)
    };
    let (mut some_avg10, mut full_avg10, mut some_stall_us, mut full_stall_us) =
        (0.0f64, 0.0f64, 0, 0);
    if !psi_scope.is_empty() {
        for p in samples.iter().filter_map(|s| pressure_of(s, use_cgroup)) {
            some_avg10 = some_avg10.max(p.some_avg10);
            full_avg10 = full_avg10.max(p.full_avg10);
        }
        some_stall_us = grow(&|s| pressure_of(s, use_cgroup).map(|p| p.some_total_us));
        full_stall_us = grow(&|s| pressure_of(s, use_cgroup).map(|p| p.full_total_us));
    }
    // The root cgroup's counters are the host's: nothing of them is the process's own.
    let own_cgroup = |s: &pb::Sample| own(s).filter(|l| l.path != "/");
    let cgroup_refaults =
        grow(&|s| own_cgroup(s).map(|l| l.workingset_refault_file + l.workingset_refault_anon));
    let cgroup_major_faults = grow(&|s| own_cgroup(s).map(|l| l.pgmajfault));
    let own_major_faults = grow(&|s| s.process.map(|p| p.major_faults));
    let cgroup_stalled = {
        let stall = grow(&|s| {
            own_cgroup(s)
                .and_then(|l| l.pressure)
                .map(|p| p.some_total_us)
        });
        let avg10 = samples
            .iter()
            .filter_map(|s| own_cgroup(s).and_then(|l| l.pressure))
            .fold(0.0f64, |m, p| m.max(p.some_avg10));
        stall as f64 / (window_s * 1e6) >= THRASH_MIN_STALL_SHARE || avg10 >= THRASH_MIN_SOME_AVG10
    };
    let own_pressure = own_major_faults >= OWN_MIN_MAJOR_FAULTS
        || cgroup_major_faults >= OWN_MIN_MAJOR_FAULTS
        || cgroup_refaults >= THRASH_MIN_REFAULT_PAGES
        || cgroup_stalled;
    let pswpin = grow(&|s| s.system.map(|m| m.vmstat_pswpin));
    let pswpout = grow(&|s| s.system.map(|m| m.vmstat_pswpout));

    let mut reading = ThrashReading {
        window_s,
        refault_scope,
        refault_file,
        refault_anon,
        pswpin,
        pswpout,
        working_set_bytes,
        swap,
        psi_scope,
        some_avg10,
        full_avg10,
        some_stall_us,
        full_stall_us,
        own_major_faults,
        cgroup_refaults,
        cgroup_major_faults,
        cgroup_stalled,
        own_pressure,
        thrashing: false,
        neighbour_pressure: false,
    };
    let pressure = thrashing(&reading);
    reading.thrashing = pressure && own_pressure;
    reading.neighbour_pressure = pressure && !own_pressure;
    Some(reading)
}

/// The rule: enough of the working set refaulted, and tasks waited on it
/// (whose pressure it was is `own_pressure`'s question). Without swap only page cache can refault, and only PSI can show the
/// wait (there is no swap-in to stand for it).
fn thrashing(r: &ThrashReading) -> bool {
    let pages = if r.swap { r.refaults() } else { r.refault_file };
    let refaulted = pages >= THRASH_MIN_REFAULT_PAGES
        && share(pages * PAGE_BYTES, r.working_set_bytes) >= THRASH_MIN_REFAULT_SHARE;
    let slowed = if !r.psi_scope.is_empty() {
        r.stall_share() >= THRASH_MIN_STALL_SHARE || r.some_avg10 >= THRASH_MIN_SOME_AVG10
    } else {
        // No PSI on this kernel: swap-in of a share of the working set is the
        // next best sign of waiting; without swap there is none.
        r.swap && r.swapin_share() >= THRASH_MIN_REFAULT_SHARE
    };
    refaulted && slowed
}

/// `part / whole`, 0 when the whole is unknown.
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}
