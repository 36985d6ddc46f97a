//! Telling a forked child from its parent.
//!
//! After `fork()` only the forking thread exists in the child: the
//! reporter's worker thread and its tokio runtime are gone, and a lock the
//! worker held at that moment stays held for good. So a handle the child
//! inherited must neither queue (nothing drains the queue) nor take the
//! parent's locks; the child needs a new reporter, with its own thread,
//! runtime and agent id.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);
static AT_FORK: Once = Once::new();

extern "C" fn bump_fork_generation() {
    // Async-signal-safe: one atomic add in the child right after fork().
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// How many forks lie between the first reporter's process and this one.
fn fork_generation() -> u64 {
    AT_FORK.call_once(|| {
        // SAFETY: registers a plain function that only touches an atomic.
        unsafe {
            libc::pthread_atfork(None, None, Some(bump_fork_generation));
        }
    });
    FORK_GENERATION.load(Ordering::Relaxed)
}

/// The process a reporter was started in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Birth {
    pid: u32,
    generation: u64,
}

impl Birth {
    /// This process, now. Registers the fork hook on first use, so every
    /// fork after a reporter starts is seen.
    pub(super) fn here() -> Birth {
        Birth {
            pid: std::process::id(),
            generation: fork_generation(),
        }
    }

    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// True in a forked child. Cheap enough for every send: a counter
    /// bumped in each child, where getpid() would be a real syscall (glibc
    /// stopped caching it in 2.25).
    pub(super) fn forked(&self) -> bool {
        fork_generation() != self.generation
    }

    /// True in any other process, however it was made (a raw `clone` runs
    /// no fork hooks). A syscall: for stopping, not for sending.
    pub(super) fn elsewhere(&self) -> bool {
        std::process::id() != self.pid
    }
}
