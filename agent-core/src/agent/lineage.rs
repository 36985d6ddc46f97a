//! Fork rules. A forked child has none of its parent's threads, and its
//! parent's locks may be held forever by a thread that no longer exists: it
//! never touches the parent's agent, and starts its own, which reports as a
//! child (its own rank, its parent's pid) so that the collector keeps the two
//! processes' evidence apart.

use std::sync::atomic::{AtomicU32, Ordering};

/// The Hello label that names a forked child's parent.
pub const PARENT_PID_LABEL: &str = "parent_pid";

/// How many children this process has forked, for the next child's rank.
#[derive(Debug, Default)]
pub struct Lineage {
    forks: AtomicU32,
}

impl Lineage {
    /// In the parent, after a fork.
    pub fn forked(&self) {
        self.forks.fetch_add(1, Ordering::Relaxed);
    }

    /// In the child: its rank (the parent's forks so far, plus one) and the
    /// label naming its parent.
    pub fn child(&self) -> (i32, (String, String)) {
        let rank = self.forks.load(Ordering::Relaxed).saturating_add(1);
        (
            i32::try_from(rank).unwrap_or(i32::MAX),
            (
                PARENT_PID_LABEL.to_string(),
                std::os::unix::process::parent_id().to_string(),
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_child_ranks_after_the_forks_before_it() {
        let l = Lineage::default();
        assert_eq!(l.child().0, 1);
        l.forked();
        l.forked();
        let (rank, (key, parent)) = l.child();
        assert_eq!(rank, 3);
        assert_eq!(key, PARENT_PID_LABEL);
        assert_eq!(parent, std::os::unix::process::parent_id().to_string());
    }
}
