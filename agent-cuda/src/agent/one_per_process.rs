//! One agent per process: it serves every pool and device, so a second
//! `Agent::start` while one runs is refused with the first one's name (two
//! would double the sampler threads, NVML handles and the process's
//! readings, and split its requests between two streams).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use oomscope_agent_core::lock;

/// The running agent: its registration's number and what names it.
static RUNNING: Mutex<Option<(u64, String)>> = Mutex::new(None);
static NEXT: AtomicU64 = AtomicU64::new(1);

/// This process's one agent, held from start to shutdown (or to the drop
/// of its last part, where it never shut down).
#[derive(Debug)]
pub(crate) struct Registration(u64);

impl Registration {
    /// Registers the agent `name`; `Err(the first's name)` while another runs.
    pub(crate) fn take(name: &str) -> Result<Registration, String> {
        let mut running = lock(&RUNNING);
        if let Some((_, first)) = running.as_ref() {
            return Err(first.clone());
        }
        let id = NEXT.fetch_add(1, Relaxed);
        *running = Some((id, name.to_string()));
        Ok(Registration(id))
    }

    /// Lets the next `Agent::start` succeed (idempotent).
    pub(crate) fn release(&self) {
        let mut running = lock(&RUNNING);
        if running.as_ref().is_some_and(|(id, _)| *id == self.0) {
            *running = None;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_registration_names_the_first_until_it_is_released() {
        let first = Registration::take("first-server").unwrap();
        assert_eq!(Registration::take("second").unwrap_err(), "first-server");
        first.release();
        let again = Registration::take("second").unwrap();
        // A stale release (the first's drop) frees nothing of the second's.
        drop(first);
        assert_eq!(Registration::take("third").unwrap_err(), "second");
        drop(again);
        drop(Registration::take("third").unwrap());
    }
}
