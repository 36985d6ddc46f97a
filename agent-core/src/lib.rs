//! What every oomscope agent shares: readers of each host memory domain, the
//! reporter that streams to the collector (spooling to disk while it is
//! away), and the recovery of dead agents' spools.
//!
//! Nothing here panics on a missing file, a missing GPU or a missing
//! collector: each reader reports what it could read and marks the rest absent.

pub mod agent;
pub mod own_heap;
pub mod priority;
pub mod readers;
pub mod recovery;
pub mod reporter;
pub mod spool;
pub mod sync;
pub mod torch;

pub use oomscope_proto::v1 as pb;
pub use sync::lock;

/// This host's name (`/proc/sys/kernel/hostname`), for every agent's Hello;
/// None where it cannot be read (a non-Linux host).
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
}

pub use oomscope_proto::now_ns;
