//! The supervisor out of the OOM killer's reach (oom_score_adj -1000), and
//! the child given its own value back between fork and exec.

use std::io::Write;

/// The supervisor's own oom_score_adj: the OOM killer never chooses it.
const SUPERVISOR_OOM_SCORE_ADJ: i32 = -1000;
/// Where a process sets its own OOM-killer bias.
const OOM_SCORE_ADJ_PATH: &str = "/proc/self/oom_score_adj";

/// The supervisor out of the OOM killer's reach: it holds the evidence, and
/// a victim chosen among the instance's processes must never be it.
pub(crate) struct OomShield {
    /// The value it had before, where it lowered its own: the child's.
    previous: Option<i32>,
}

impl OomShield {
    /// Sets the supervisor's own oom_score_adj to -1000. Lowering it needs
    /// CAP_SYS_RESOURCE (below the floor the last privileged writer left);
    /// without it, it goes as low as permitted, which still ranks it below
    /// its child, and says once what that risks.
    pub(crate) fn engage() -> Self {
        Self::engage_as("the supervisor", " (still below its child)")
    }

    /// As [`engage`](Self::engage), for `who` (the node watcher, which has
    /// no child); `partly` ends the warning where it got only part way.
    pub(crate) fn engage_as(who: &str, partly: &str) -> Self {
        let previous = match std::fs::read_to_string(OOM_SCORE_ADJ_PATH) {
            Ok(t) => match parse_oom_score_adj(&t) {
                Some(v) => v,
                None => {
                    warn_unshielded(
                        who,
                        &format!("{OOM_SCORE_ADJ_PATH} reads {:?}", t.trim()),
                        None,
                        partly,
                    );
                    return OomShield { previous: None };
                }
            },
            Err(e) => {
                warn_unshielded(who, &e.to_string(), None, partly);
                return OomShield { previous: None };
            }
        };
        let mut refused = None;
        let now = lowest_permitted(previous, |v| match set_own_oom_score_adj(v) {
            Ok(()) => true,
            Err(e) => {
                refused.get_or_insert(e);
                false
            }
        });
        if now != SUPERVISOR_OOM_SCORE_ADJ {
            let why = refused.map_or_else(|| "refused".to_string(), |e| e.to_string());
            warn_unshielded(who, &why, (now < previous).then_some(now), partly);
        }
        OomShield {
            previous: (now < previous).then_some(previous),
        }
    }

    /// Test only ([`STAY_IN_CGROUP_ENV`](crate::STAY_IN_CGROUP_ENV)): the
    /// supervisor the OOM killer's first choice (raising needs no
    /// privilege), the child at the value the supervisor had.
    pub(crate) fn expose() -> Self {
        let previous = std::fs::read_to_string(OOM_SCORE_ADJ_PATH)
            .ok()
            .and_then(|t| parse_oom_score_adj(&t));
        match (previous, set_own_oom_score_adj(1000)) {
            (Some(p), Ok(())) => OomShield { previous: Some(p) },
            (_, Err(e)) => {
                eprintln!("oomscope: cannot raise the supervisor's oom_score_adj to 1000: {e}");
                OomShield { previous: None }
            }
            (None, Ok(())) => OomShield { previous: Some(0) },
        }
    }

    /// The value the child must get back, where the supervisor changed its own.
    pub(crate) fn child_value(&self) -> Option<i32> {
        self.previous
    }
}

/// The lowest value in [-1000, `current`] that `try_set` accepts, trying
/// -1000 first and then searching (the kernel accepts every value from a
/// floor up, and a refused write changes nothing). The value set last is the
/// one returned, so the process ends at it.
fn lowest_permitted(current: i32, mut try_set: impl FnMut(i32) -> bool) -> i32 {
    if current <= SUPERVISOR_OOM_SCORE_ADJ || try_set(SUPERVISOR_OOM_SCORE_ADJ) {
        return SUPERVISOR_OOM_SCORE_ADJ;
    }
    // Invariant: `lo` refused, `hi` accepted (or the current value).
    let (mut lo, mut hi) = (SUPERVISOR_OOM_SCORE_ADJ, current);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if try_set(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

fn set_own_oom_score_adj(v: i32) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(OOM_SCORE_ADJ_PATH)?
        .write_all(v.to_string().as_bytes())
}

fn warn_unshielded(who: &str, why: &str, lowered_to: Option<i32>, partly_note: &str) {
    let partly = match lowered_to {
        Some(v) => format!(", only to {v}{partly_note}"),
        None => String::new(),
    };
    eprintln!(
        "oomscope: cannot set {who}'s oom_score_adj to {SUPERVISOR_OOM_SCORE_ADJ} \
         ({why}){partly}: under memory pressure the kernel may choose {who} as the \
         OOM victim and take the evidence with it"
    );
}

/// The value of an oom_score_adj file ("-1000\n").
fn parse_oom_score_adj(text: &str) -> Option<i32> {
    text.trim().parse().ok()
}

/// Between fork and exec: writes `value` to the child's own oom_score_adj.
/// Only raw system calls (async-signal-safe); a failure leaves the child
/// with the supervisor's value, which only makes it harder to kill.
pub(crate) fn write_own_oom_score_adj(value: &[u8]) {
    // SAFETY: a NUL-terminated path literal and a buffer we own.
    unsafe {
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::write(fd, value.as_ptr().cast(), value.len());
            libc::close(fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_permitted_oom_score_adj_is_found_and_left_set() {
        for floor in [-1000, -999, -1, 0, 37, 100] {
            let mut value = 100;
            let got = lowest_permitted(100, |v| {
                let ok = v >= floor;
                if ok {
                    value = v;
                }
                ok
            });
            assert_eq!((got, value), (floor, floor), "floor {floor}");
        }
        // Already at the bottom: nothing to write.
        assert_eq!(lowest_permitted(-1000, |_| panic!("no write")), -1000);
    }

    #[test]
    fn oom_score_adj_values() {
        assert_eq!(parse_oom_score_adj("-1000\n"), Some(-1000));
        assert_eq!(parse_oom_score_adj(" 100 "), Some(100));
        assert_eq!(parse_oom_score_adj("x"), None);
        assert_eq!(
            OOM_SCORE_ADJ_PATH.as_bytes(),
            c"/proc/self/oom_score_adj".to_bytes(),
            "the pre-exec path is the same file"
        );
    }
}
