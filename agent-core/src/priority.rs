//! How an agent's own threads (sampler, reporter) share the CPU with the
//! server they live in: their work can wait a few milliseconds, a request
//! cannot. On a server whose cores are busy (torch's intra-op threads take
//! every core), an agent thread that wakes at normal priority preempts one
//! of them, and the whole parallel region waits for it.
//!
//! The in-process agents therefore run their threads as `SCHED_BATCH`
//! ([`ThreadPriority::IN_PROCESS`]): the kernel never lets a waking batch
//! thread preempt a running one (it waits for an idle core or the end of
//! the running thread's slice), yet it keeps its fair share of the CPU, so
//! the agent's evidence is never starved on a saturated host. A nice value
//! is an option on top ([`LOW_THREAD_NICE`]). Measured on a 2-core VM, 3,000
//! short torch requests each marked, 10 alternating pairs each (BENCHMARKS.md,
//! #17): wall time 1.24x plain as before, 1.13x as `SCHED_BATCH`, 1.11x at
//! nice 19; p99 about 1 ms, 0.48 ms and 0.39 ms (plain 0.25 ms).

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

/// How an agent's thread is scheduled. The default leaves it as the
/// process's threads are (the supervisor and the command line use it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadPriority {
    /// `SCHED_BATCH`: never preempts a running thread when it wakes.
    pub batch: bool,
    /// A nice value from 1 to 19 lowers the thread; 0 or less leaves it (a
    /// higher priority needs privileges the agent should not use).
    pub nice: i32,
}

impl ThreadPriority {
    /// What the agents inside a server use: batch, at the process's nice.
    pub const IN_PROCESS: ThreadPriority = ThreadPriority {
        batch: true,
        nice: 0,
    };

    /// Applies to the calling thread only (Linux schedules threads one by
    /// one). Where it fails, or off Linux, the thread runs as it is: a debug
    /// line, no error.
    pub fn apply_to_this_thread(self) {
        #[cfg(target_os = "linux")]
        {
            let fail = |what: &str| {
                tracing::debug!(
                    error = %std::io::Error::last_os_error(),
                    "oomscope: could not {what} for an agent thread"
                )
            };
            if self.batch {
                let param = libc::sched_param { sched_priority: 0 };
                // SAFETY: pid 0 is the calling thread; param outlives the call.
                if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } != 0 {
                    fail("set SCHED_BATCH");
                }
            }
            if self.nice > 0 {
                // SAFETY: plain syscalls on the calling thread's own id.
                let rc = unsafe {
                    let tid = libc::gettid();
                    libc::setpriority(
                        libc::PRIO_PROCESS,
                        tid as libc::id_t,
                        self.nice.min(LOW_THREAD_NICE),
                    )
                };
                if rc != 0 {
                    fail("lower the priority");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's scheduling policy is `SCHED_BATCH` (Linux).
    fn this_thread_is_batch() -> bool {
        #[cfg(target_os = "linux")]
        // SAFETY: reads the calling thread's own policy.
        unsafe {
            return libc::sched_getscheduler(0) == libc::SCHED_BATCH;
        }
        #[allow(unreachable_code)]
        false
    }

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

    fn on_a_new_thread(p: ThreadPriority) -> (bool, i32) {
        std::thread::spawn(move || {
            p.apply_to_this_thread();
            (this_thread_is_batch(), this_thread_nice())
        })
        .join()
        .unwrap()
    }

    #[test]
    fn only_the_calling_thread_changes_and_the_default_changes_nothing() {
        let before = (this_thread_is_batch(), this_thread_nice());
        let low = ThreadPriority {
            batch: true,
            nice: LOW_THREAD_NICE,
        };
        if cfg!(target_os = "linux") {
            assert_eq!(on_a_new_thread(low), (true, LOW_THREAD_NICE));
            assert_eq!(
                on_a_new_thread(ThreadPriority::IN_PROCESS),
                (true, before.1)
            );
        }
        assert_eq!(on_a_new_thread(ThreadPriority::default()), before);
        assert_eq!(
            (this_thread_is_batch(), this_thread_nice()),
            before,
            "the caller's own scheduling moved"
        );
    }
}
