//! Telling a forked child from its parent, and keeping the parent's
//! connections out of the child.
//!
//! After `fork()` only the forking thread exists in the child: the
//! reporter's worker thread and its tokio runtime are gone, and a lock the
//! worker held at that moment stays held for good. So a handle the child
//! inherited must neither queue (nothing drains the queue) nor take the
//! parent's locks; the child needs a new reporter, with its own thread,
//! runtime and agent id.
//!
//! The child also inherits the parent's socket to the collector. Nothing in
//! the child uses it, but while its copy is open the parent's stream
//! outlives the parent: a main process killed with SIGKILL stayed
//! "connected" at the collector for as long as a forked worker lived, and
//! its `agent_lost` came a minute late. Linux has no close-on-fork flag,
//! so the reporter's connector ([`super::connector`]) records each socket
//! it opens in [`TRACKED`], and the child closes them in a `pthread_atfork`
//! handler, before any other code runs there. Recording the sockets beats
//! scanning `/proc/self/fd` for ones whose peer is the collector: the
//! handler must be async-signal-safe (no directory listing, no allocation),
//! and the app may have sockets of its own to the same address.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);
static AT_FORK: Once = Once::new();

/// Room for the reporters' open sockets: one per reporter at a time (two
/// for a moment across a reconnect), and a process has one reporter plus
/// one per dead agent whose spool it delivers.
const TRACKED_SLOTS: usize = 64;
/// Each slot: 0 (free), or the fd + 1 in the high half and the low 32 bits
/// of the socket's inode in the low half, one atomic word so that the child
/// never reads half an entry. The inode makes a stale entry harmless: the
/// child closes an fd only while it is still that socket, never an fd
/// number the app reused after the reporter closed its socket.
static TRACKED: [AtomicU64; TRACKED_SLOTS] = [const { AtomicU64::new(0) }; TRACKED_SLOTS];

/// In the child right after fork(). Async-signal-safe: atomics, fstat()
/// and close() only.
extern "C" fn in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
    for slot in &TRACKED {
        let entry = slot.swap(0, Ordering::Relaxed);
        if entry == 0 {
            continue;
        }
        let fd = ((entry >> 32) as RawFd).wrapping_sub(1);
        if inode_of(fd).is_some_and(|ino| ino as u32 == entry as u32) {
            // SAFETY: closes this process's copy of the reporter's socket;
            // nothing in the child uses it (see the module's doc).
            unsafe {
                libc::close(fd);
            }
        }
    }
}

/// The inode of the file `fd` refers to; None if it is not open.
fn inode_of(fd: RawFd) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a whole `stat` on success, which is all we read.
    match unsafe { libc::fstat(fd, st.as_mut_ptr()) } {
        0 => Some(unsafe { st.assume_init() }.st_ino),
        _ => None,
    }
}

/// Registers the fork hook, once per process.
fn hook_fork() {
    AT_FORK.call_once(|| {
        // SAFETY: registers a plain function that is async-signal-safe.
        unsafe {
            libc::pthread_atfork(None, None, Some(in_child));
        }
    });
}

/// How many forks lie between the first reporter's process and this one.
fn fork_generation() -> u64 {
    hook_fork();
    FORK_GENERATION.load(Ordering::Relaxed)
}

/// A socket a forked child closes at once; dropping it ends that (drop it
/// with the socket, or before: after, the entry is stale, which the inode
/// check makes harmless).
pub(super) struct ClosedInChild {
    slot: Option<(usize, u64)>,
}

impl ClosedInChild {
    /// Records `fd` (a socket this process just opened) for every fork from
    /// now on. With every slot taken, the socket goes unrecorded (logged):
    /// a child then keeps it open, as before this existed.
    pub(super) fn track(fd: RawFd) -> ClosedInChild {
        hook_fork();
        let Some(ino) = inode_of(fd) else {
            return ClosedInChild { slot: None };
        };
        let entry = (u64::from((fd as u32).wrapping_add(1)) << 32) | (ino & 0xffff_ffff);
        let slot = TRACKED.iter().position(|s| {
            s.compare_exchange(0, entry, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        });
        if slot.is_none() {
            tracing::warn!(
                fd,
                "oomscope reporter: too many open sockets to track; a forked child keeps this one"
            );
        }
        ClosedInChild {
            slot: slot.map(|i| (i, entry)),
        }
    }
}

impl Drop for ClosedInChild {
    fn drop(&mut self) {
        if let Some((i, entry)) = self.slot {
            // Only if still ours: a child clears every slot after fork.
            let _ = TRACKED[i].compare_exchange(entry, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    fn tracked(fd: RawFd) -> bool {
        TRACKED.iter().any(|s| {
            let e = s.load(Ordering::Relaxed);
            e != 0 && ((e >> 32) as RawFd) - 1 == fd
        })
    }

    #[test]
    fn a_forked_child_closes_the_tracked_socket_and_nothing_else() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let ours = TcpStream::connect(addr).unwrap();
        let apps = TcpStream::connect(addr).unwrap();
        let guard = ClosedInChild::track(ours.as_raw_fd());
        assert!(tracked(ours.as_raw_fd()));
        let (ours_fd, apps_fd) = (ours.as_raw_fd(), apps.as_raw_fd());
        // SAFETY: the child only makes raw system calls, then _exit()s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = match (inode_of(ours_fd).is_none(), inode_of(apps_fd).is_some()) {
                (true, true) => 0,
                (false, _) => 1, // the reporter's socket is still open
                (_, false) => 2, // the app's socket was closed
            };
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status));
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "1: kept ours, 2: closed the app's"
        );
        assert!(
            inode_of(ours_fd).is_some(),
            "the parent's socket stays open"
        );
        drop(guard);
        assert!(!tracked(ours_fd));
    }

    #[test]
    fn a_stale_entry_never_closes_a_reused_fd_in_the_child() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let ours = TcpStream::connect(addr).unwrap();
        let fd = ours.as_raw_fd();
        let guard = ClosedInChild::track(fd);
        // The socket closes before its entry is dropped, and the app gets
        // the same fd number for a file of its own.
        drop(ours);
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let reused = file.as_raw_fd() == fd;
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = if inode_of(fd).is_some() || !reused {
                0
            } else {
                1
            };
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child closed the app's file"
        );
        drop(guard);
        drop(file);
    }
}
