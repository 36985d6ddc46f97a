//! The GIL's time held in slices, under a budget.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// The longest a census holds the GIL at a time (plus one step of at most
/// 256 objects or one `gc.get_referents` chunk): a request
/// thread waiting for it waits no longer.
pub const SLICE: Duration = Duration::from_millis(10);
/// The GIL's time held in slices: [`Slices::step`] lets the GIL go
/// whenever the current slice reaches [`SLICE`], and says when the budget
/// (of held time, over every slice) is spent.
pub struct Slices<'py> {
    pub(super) py: Python<'py>,
    pub(super) budget: Duration,
    held_before: Duration,
    slice_start: Instant,
    /// The longest single hold so far.
    pub longest: Duration,
}

impl<'py> Slices<'py> {
    pub fn new(py: Python<'py>, budget: Duration) -> Self {
        Slices {
            py,
            budget,
            held_before: Duration::ZERO,
            slice_start: Instant::now(),
            longest: Duration::ZERO,
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
        let slice = self.slice_start.elapsed();
        self.longest = self.longest.max(slice);
        self.held_before += slice;
        // Another thread waiting for the GIL takes it here.
        self.py.detach(std::thread::yield_now);
        self.slice_start = Instant::now();
    }

    pub(super) fn finish(&mut self) -> Duration {
        self.longest = self.longest.max(self.slice_start.elapsed());
        self.held()
    }
}
