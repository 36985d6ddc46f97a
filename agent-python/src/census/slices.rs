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
        }
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
        self.py.detach(std::thread::yield_now);
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
