//! Stop signals the supervisor receives: recorded by an async-signal-safe
//! handler, passed on to the child by the sampling loop.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// A stop signal (SIGTERM, SIGINT, SIGHUP) the supervisor received and has
/// yet to pass on to its child; 0 = none.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Set once any stop signal arrived: the supervisor then restarts nothing.
static STOP_REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    // Async-signal-safe: two atomic stores; the sampling loop does the rest.
    PENDING_SIGNAL.store(sig, Ordering::Relaxed);
    STOP_REQUESTED.store(true, Ordering::Relaxed);
}

pub(crate) fn stop_requested() -> bool {
    STOP_REQUESTED.load(Ordering::Relaxed)
}

/// `oomscope run` stands in for its child: a stop signal meant for the
/// service is passed on, the child's end is recorded as usual, and then the
/// supervisor exits with the child's status instead of restarting it.
pub(crate) fn install_forwarding() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: installs a handler that only stores to atomics.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// The stop signal received and not yet passed on, taken (0 = none).
pub(crate) fn take_pending_signal() -> i32 {
    PENDING_SIGNAL.swap(0, Ordering::Relaxed)
}
