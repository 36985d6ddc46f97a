//! The watcher's open-file budget: each watched cgroup holds descriptors
//! for as long as it is watched, so the cap on watched cgroups is also what
//! the open-file limit (RLIMIT_NOFILE) holds. The soft limit is raised to
//! the hard one at the start, as servers do; where that is still short, the
//! watcher watches fewer cgroups and says so.

use oomscope_agent_core::readers::cgroup::LEVEL_DIR_DESCRIPTORS;

/// A reporter's descriptors: its thread's tokio runtime (an epoll and two
/// eventfds) and its connection to the collector (two sockets), as counted
/// in `/proc/<pid>/fd` of a watcher of ten and of two hundred cgroups.
const REPORTER_DESCRIPTORS: usize = 5;
/// The descriptors one watched cgroup holds: its directory and counter
/// files (agent-core `LevelDir`) and its stream's reporter.
pub const DESCRIPTORS_PER_CGROUP: usize = LEVEL_DIR_DESCRIPTORS + REPORTER_DESCRIPTORS;
/// Descriptors kept for all else: stdio, the kernel's log, NVML's device
/// files (a few per GPU), the directory a discovery lists, the files a
/// whole reading opens, /proc/<pid>/cgroup of each GPU process, and the
/// logging.
pub const RESERVED_DESCRIPTORS: usize = 64;

/// The open-file limit as the watcher runs under it, and the cgroups it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The soft limit after the raise (what the watcher runs under).
    pub soft: u64,
    /// The soft limit before, where the raise changed it.
    pub raised_from: Option<u64>,
    /// The cgroups these descriptors hold at once.
    pub cgroups: usize,
}

/// The cgroups that `limit` open files hold: what the reserve leaves, a
/// cgroup's descriptors each. Pure.
pub fn cgroups_within(limit: u64) -> usize {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    limit.saturating_sub(RESERVED_DESCRIPTORS) / DESCRIPTORS_PER_CGROUP
}

/// Raises the soft open-file limit to the hard one and says how many
/// cgroups the result holds. Where the limit cannot be read, the budget is
/// unbounded (the cap on watched cgroups alone applies).
pub fn raise_to_hard() -> Budget {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit of this process.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Budget {
            soft: u64::MAX,
            raised_from: None,
            cgroups: usize::MAX,
        };
    }
    let before = lim.rlim_cur;
    let mut raised_from = None;
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above; raising the soft limit up to the hard one needs
        // no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            lim.rlim_cur = lim.rlim_max;
            raised_from = Some(before);
        }
    }
    Budget {
        soft: lim.rlim_cur,
        raised_from,
        cgroups: cgroups_within(lim.rlim_cur),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_comes_first_then_whole_cgroups() {
        assert_eq!(cgroups_within(0), 0);
        assert_eq!(cgroups_within(RESERVED_DESCRIPTORS as u64), 0);
        let one = (RESERVED_DESCRIPTORS + DESCRIPTORS_PER_CGROUP) as u64;
        assert_eq!(cgroups_within(one - 1), 0);
        assert_eq!(cgroups_within(one), 1);
        // The common default soft limit holds well under the 512 cap; the
        // usual hard one holds it.
        assert!(cgroups_within(1024) < 512);
        assert!(cgroups_within(1 << 20) > 512);
    }
}
