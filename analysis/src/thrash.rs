//! Swap thrash: the process slows rather than dies, so it is read from the
//! sample window, not from a death.

use crate::pb;

/// Refaults (pages read back soon after eviction) over the window at or above
/// which the working set no longer fits: 4096 pages is 16 MiB of 4 KiB pages
/// evicted and needed again. A healthy steady state refaults rarely.
pub const THRASH_MIN_REFAULT_PAGES: u64 = 4096;

/// PSI stall growth (µs) that, together with the refaults, shows tasks waited
/// on memory. Any growth counts: refaults alone can come from a one-off cache
/// eviction that nobody waited for, refaults plus stall cannot.
pub const THRASH_MIN_STALL_US: u64 = 1;

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
    /// "cgroup /x", "system", or "" when no PSI was read.
    pub psi_scope: String,
    pub some_avg10: f64,
    pub full_avg10: f64,
    pub some_stall_us: u64,
    pub full_stall_us: u64,
    /// The thresholds above were met.
    pub thrashing: bool,
}

impl ThrashReading {
    pub fn refaults(&self) -> u64 {
        self.refault_file + self.refault_anon
    }

    pub fn refaults_per_s(&self) -> f64 {
        self.refaults() as f64 / self.window_s
    }

    pub fn evidence(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "{} workingset refaults +{} pages (file {}, anon {}) over {:.1} s = {:.1}/s; threshold {} pages",
            self.refault_scope,
            self.refaults(),
            self.refault_file,
            self.refault_anon,
            self.window_s,
            self.refaults_per_s(),
            THRASH_MIN_REFAULT_PAGES
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
                "{} PSI memory some avg10 {:.2}%, full avg10 {:.2}%; stall total +{:.3} s (some), +{:.3} s (full)",
                self.psi_scope,
                self.some_avg10,
                self.full_avg10,
                self.some_stall_us as f64 / 1e6,
                self.full_stall_us as f64 / 1e6
            ));
        }
        lines
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
    // The own cgroup's refaults are the process's; the system's include its
    // neighbours, which slow it just the same. Take the larger.
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
    let (refault_scope, refault_file, refault_anon) =
        if cg_file + cg_anon >= sys_file + sys_anon && cg_file + cg_anon > 0 {
            (format!("cgroup {own_path}"), cg_file, cg_anon)
        } else {
            ("system".to_string(), sys_file, sys_anon)
        };

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
    let pswpin = grow(&|s| s.system.map(|m| m.vmstat_pswpin));
    let pswpout = grow(&|s| s.system.map(|m| m.vmstat_pswpout));

    let stalled = if psi_scope.is_empty() {
        // No PSI on this kernel: heavy swap-in is the next best sign of waiting.
        pswpin >= THRASH_MIN_REFAULT_PAGES
    } else {
        some_stall_us >= THRASH_MIN_STALL_US || some_avg10 >= THRASH_MIN_SOME_AVG10
    };
    let thrashing = refault_file + refault_anon >= THRASH_MIN_REFAULT_PAGES && stalled;
    Some(ThrashReading {
        window_s,
        refault_scope,
        refault_file,
        refault_anon,
        pswpin,
        pswpout,
        psi_scope,
        some_avg10,
        full_avg10,
        some_stall_us,
        full_stall_us,
        thrashing,
    })
}
