//! The interpreter-exit Goodbye, with the status the process ends with.
//!
//! Python's atexit callbacks run inside the interpreter's finalization,
//! before that status is known: a `sys.exit(1)` or an uncaught exception
//! ends the process with 1 only after them. A Goodbye said there can only
//! guess 0, and a collector then reads a server that exited 1 (a worker
//! died, the server gave up) as an instance's clean stop. glibc's `on_exit`
//! hands its callback the status given to `exit()`, after the interpreter
//! is gone; so Python's atexit stops the sampler (which needs the GIL) and
//! defers the agent here, and the callback says the Goodbye, touching no
//! Python. Where there is no `on_exit` (not glibc), `register` says so and the
//! Goodbye goes from atexit, its status unknown and said as 0, as before.

use std::sync::{Arc, Mutex, OnceLock};

use crate::agent::Agent;

/// The agent Python's atexit handed over, for the exit callback.
static DEFERRED: Mutex<Option<Arc<Agent>>> = Mutex::new(None);
/// Whether the exit callback is registered (tried once per process).
static REGISTERED: OnceLock<bool> = OnceLock::new();

/// Registers the exit callback, once per process (a forked child inherits
/// it). Returns whether it is registered.
pub fn register() -> bool {
    *REGISTERED.get_or_init(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            extern "C" {
                fn on_exit(
                    function: extern "C" fn(libc::c_int, *mut libc::c_void),
                    arg: *mut libc::c_void,
                ) -> libc::c_int;
            }
            // SAFETY: glibc's on_exit(3) with a callback of the signature it
            // calls; the argument is unused.
            unsafe { on_exit(at_exit, std::ptr::null_mut()) == 0 }
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        false
    })
}

/// Hands `agent` (its sampler stopped) to the exit callback; the caller
/// has checked that it is registered.
pub fn defer(agent: Arc<Agent>) {
    *oomscope_agent_core::lock(&DEFERRED) = Some(agent);
}

/// Called by the C library's `exit()` with its status, after Python's
/// finalization. No panic may unwind into the C library; a lock held
/// elsewhere is skipped rather than waited on, so the exit never hangs here.
#[cfg_attr(not(all(target_os = "linux", target_env = "gnu")), allow(dead_code))]
extern "C" fn at_exit(status: libc::c_int, _arg: *mut libc::c_void) {
    let _ = std::panic::catch_unwind(|| {
        let Some(agent) = DEFERRED.try_lock().ok().and_then(|mut d| d.take()) else {
            return;
        };
        agent.goodbye("interpreter exit", status);
        // The interpreter is gone: nothing the agent refers to is released now.
        std::mem::forget(agent);
    });
}
