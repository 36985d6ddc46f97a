//! Locking that never panics: an agent lives inside someone's server, and a
//! panic on a poisoned mutex (a thread that panicked while holding it) would
//! take the server down for a counter. The data behind these locks stays
//! usable after such a panic.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data over from a thread that panicked holding it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
