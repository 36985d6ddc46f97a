//! An in-process agent's own threads (sampler, reporter) may run at a low
//! CPU priority: their work can wait a few milliseconds, a request cannot.
//! On a server whose cores are busy (torch's intra-op threads take every
//! core), an agent thread that wakes at normal priority preempts one of
//! them, and the whole parallel region waits for it. Measured on a 2-core
//! VM, 3,000 short torch requests, each marked (BENCHMARKS.md, #17): once
//! the request path stopped waking the agent at every boundary, nice 19
//! moved the median wall time 0.96x -> 0.99x of plain (noise) and the best
//! run 1.17x -> 1.03x. Too little to pay for the risk below, so it is an
//! option, not the default.

/// The nice value an operator may give an in-process agent's threads (the
/// Python extension's `thread_nice`): the lowest priority there is short of
/// `SCHED_IDLE`. Linux's nice is per thread, so the server's own threads
/// keep theirs. Not the default: on a server that keeps every core busy a
/// thread at 19 gets ~1.5 % of a core, so the agent's queue backs up while
/// it waits (its own memory grows, which it would read as the server's
/// slow growth) and a census comes late. One run of the clean-loop test
/// (`test_slow_leak.py`) at 19 reported slow growth of 5 KiB a request;
/// at 0 it passed.
pub const LOW_THREAD_NICE: i32 = 19;

/// Sets the calling thread's nice value; 0 or less leaves it alone (a
/// lower value needs privileges the agent should not use). On a host
/// where it fails, or off Linux, the thread runs as it is: a debug line, no
/// error.
pub fn lower_this_thread(nice: i32) {
    if nice <= 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain syscalls on the calling thread's own id.
        let rc = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice.min(19))
        };
        if rc != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "oomscope: could not lower an agent thread's priority"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's nice value (Linux; 0 elsewhere or on error).
    fn this_thread_nice() -> i32 {
        #[cfg(target_os = "linux")]
        // SAFETY: reads the calling thread's own priority.
        unsafe {
            *libc::__errno_location() = 0;
            let n = libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t);
            if *libc::__errno_location() == 0 {
                return n;
            }
        }
        0
    }

    #[test]
    fn only_the_calling_thread_is_lowered_and_0_leaves_it() {
        let before = this_thread_nice();
        let lowered = std::thread::spawn(|| {
            lower_this_thread(LOW_THREAD_NICE);
            this_thread_nice()
        })
        .join()
        .unwrap();
        if cfg!(target_os = "linux") {
            assert_eq!(lowered, LOW_THREAD_NICE);
        }
        assert_eq!(
            this_thread_nice(),
            before,
            "the caller's own priority moved"
        );
        // 0 leaves a thread as it is.
        let kept = std::thread::spawn(|| {
            lower_this_thread(0);
            this_thread_nice()
        })
        .join()
        .unwrap();
        assert_eq!(kept, before);
    }
}
