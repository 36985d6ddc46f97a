//! The GIL's time held in slices, under a budget.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// The longest a census holds the GIL at a time (plus one step of at most
/// 256 objects or one `gc.get_referents` chunk): a request
/// thread waiting for it waits no longer. A quarter of the 20 ms a hold may
/// last: on a loaded machine the thread holding the GIL is descheduled
/// within its slice (a 10 ms slice measured 29 ms of wall time for 7 ms of
/// CPU at load 11 on 2 cores).
pub const SLICE: Duration = Duration::from_millis(5);
/// How often a census waiting between slices for the requests in flight to
/// end looks again (the GIL released).
const IDLE_POLL: Duration = Duration::from_millis(1);

/// Whether the server has no request in flight, asked between slices by a
/// census that began between requests ([`Slices::between_requests`]).
pub type Idle<'a> = &'a (dyn Fn() -> bool + Sync);
/// The GIL's time held in slices: [`Slices::step`] lets the GIL go
/// whenever the current slice reaches [`SLICE`], and says when the budget
/// (of held time, over every slice) is spent.
pub struct Slices<'py> {
    pub(super) py: Python<'py>,
    pub(super) budget: Duration,
    held_before: Duration,
    slice_start: Instant,
    slice_cpu_start: Duration,
    /// The longest single hold so far.
    pub longest: Duration,
    /// This thread's CPU time in that hold: less than `longest` when the
    /// thread was descheduled while it held the GIL (a busy machine).
    pub longest_cpu: Duration,
    /// A census begun between requests resumes between requests: a request
    /// that began while the GIL was let go runs to its end first, up to
    /// `idle_wait` in all, so the counts never hold a request's temporaries
    /// (CI once saw three logits tensors of a request mid-step).
    idle: Option<Idle<'py>>,
    idle_wait: Duration,
}

impl<'py> Slices<'py> {
    pub fn new(py: Python<'py>, budget: Duration) -> Self {
        Slices {
            py,
            budget,
            held_before: Duration::ZERO,
            slice_start: Instant::now(),
            slice_cpu_start: thread_cpu(),
            longest: Duration::ZERO,
            longest_cpu: Duration::ZERO,
            idle: None,
            idle_wait: Duration::ZERO,
        }
    }

    /// Between slices, waits (GIL let go) for no request in flight, up to
    /// `wait` in all; then goes on whatever is in flight (a server that is
    /// never idle still gets its census).
    pub fn between_requests(mut self, idle: Idle<'py>, wait: Duration) -> Self {
        self.idle = Some(idle);
        self.idle_wait = wait;
        self
    }

    /// GIL time held so far, this slice included.
    pub fn held(&self) -> Duration {
        self.held_before + self.slice_start.elapsed()
    }

    /// False once the budget is spent; otherwise ends the slice (letting
    /// waiting threads run) when it has lasted [`SLICE`].
    pub fn step(&mut self) -> bool {
        let slice = self.slice_start.elapsed();
        if self.held_before + slice > self.budget {
            return false;
        }
        if slice >= SLICE {
            self.end_slice();
        }
        true
    }

    /// Ends the slice now, whatever its length.
    pub(super) fn end_slice(&mut self) {
        let slice = self.close_slice();
        self.held_before += slice;
        // Another thread waiting for the GIL takes it here.
        let (idle, wait) = (self.idle, &mut self.idle_wait);
        self.py.detach(|| {
            std::thread::yield_now();
            let Some(idle) = idle else { return };
            let start = Instant::now();
            while !idle() && start.elapsed() < *wait {
                std::thread::sleep(IDLE_POLL);
            }
            *wait = wait.saturating_sub(start.elapsed());
        });
        self.slice_start = Instant::now();
        self.slice_cpu_start = thread_cpu();
    }

    pub(super) fn finish(&mut self) -> Duration {
        self.close_slice();
        self.held()
    }

    /// The current slice's length, kept with its CPU time when it is the
    /// longest yet.
    fn close_slice(&mut self) -> Duration {
        let slice = self.slice_start.elapsed();
        if slice > self.longest {
            self.longest = slice;
            self.longest_cpu = thread_cpu().saturating_sub(self.slice_cpu_start);
        }
        slice
    }
}

/// The calling thread's CPU time (zero where it cannot be read). One
/// syscall, at slice boundaries only.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}
