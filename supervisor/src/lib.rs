//! `oomscope run`: supervise one child process, the process to be diagnosed.
//!
//! The supervisor watches from outside: it samples the child's memory domains,
//! keeps the tail of its stderr, and reads its status and limits at the end
//! *before reaping it* (`waitid` with `WNOWAIT`), because a `prlimit`/`ulimit`
//! inside the command is only visible late, and a fast failure is gone before
//! the first periodic sample.
//!
//! Each sample carries the whole supervised tree (the child and its
//! descendants), and the kernel's log is polled for OOM kills of any process
//! of that tree: the kernel's record is the authoritative figure at the kill.
//! The supervisor leaves the capped memory cgroup it watches (see `place`)
//! and shields itself from the OOM killer (oom_score_adj -1000, giving the
//! child its own value back), so that it is never the victim that takes the
//! evidence with it. It signals nothing but its own child,
//! and that only to pass on a stop signal it received.
//!
//! One role per file: what it is told (`config`), its life of starts,
//! restarts and the goodbye (`restarts`), its Hello (`hello`), one run of
//! the child on the sampling loop and how it ended (`child`), the tree's
//! other processes (`members`), the cgroup `--memory-limit` makes (`limit`),
//! its cgroup (`place`), its OOM-killer bias
//! (`shield`) and the stop signals it passes on (`signals`). The
//! `oomscope run` verb is a thin shell over [`run`].

mod child;
mod config;
mod hello;
mod limit;
mod members;
pub mod node;
mod place;
mod restarts;
mod shield;
mod signals;

use oomscope_agent_core::{now_ns, pb};

pub use child::{describe, Ending};
pub use config::{
    RunConfig, DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX, DEFAULT_FLUSH_TIMEOUT,
    DEFAULT_INTERVAL, DEFAULT_STDERR_TAIL_BYTES,
};
pub use hello::KERNEL_LOG_LABEL;
pub use place::STAY_IN_CGROUP_ENV;
pub use restarts::{backoff, run};

/// An event of the supervised run, stamped now.
pub(crate) fn event(kind: pb::event::Kind) -> pb::Event {
    pb::Event {
        time_ns: now_ns(),
        kind: Some(kind),
    }
}

/// A kernel OOM kill's event, placed when the kernel logged it (its
/// /dev/kmsg stamp on the wall clock), not when it was read: a reader on a
/// loaded machine reads a kill a second or more late. One without a
/// kernel stamp (counted from a cgroup alone) is placed now.
pub(crate) fn kill_event(kill: pb::KernelOomKill) -> pb::Event {
    pb::Event {
        time_ns: match kill.kernel_time_us {
            0 => now_ns(),
            us => oomscope_agent_core::readers::kmsg::logged_at_now(us),
        },
        kind: Some(pb::event::Kind::KernelOomKill(kill)),
    }
}
