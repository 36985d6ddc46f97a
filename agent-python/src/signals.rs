//! SIGTERM, handled natively, so the agent never changes how a process dies.
//!
//! A Python-level handler runs only when the main thread next executes
//! bytecode: a main thread stuck in C (a libgomp barrier after `fork`, a
//! lock that is never released) never runs it, and a process that would
//! have died by SIGTERM ignored it. So the handler is a C one (`sigaction`)
//! and does only async-signal-safe work: it records the signal and posts a
//! semaphore. The agent's "oomscope-signal" thread, waiting on it, sends
//! the Goodbye (reason "SIGTERM", status 128 + 15) without the GIL, waits at
//! most [`SIGNAL_GOODBYE_WAIT`] for its ack, then restores the disposition
//! the process had and raises the signal again: the process dies by SIGTERM,
//! as it would have without the agent, a moment later.
//!
//! What the process had before decides the rest:
//! - SIG_IGN: nothing is installed, the signal stays ignored;
//! - SIG_DFL: as above (Goodbye, then death by the signal);
//! - a handler (one the app installed with `signal.signal`, which is
//!   Python's C trampoline, or one installed from C): called from ours, as
//!   if ours were not there; the Goodbye comes from the exit it leads to.
//!
//! A handler installed after the agent's (uvicorn's, vLLM's `signal.signal`)
//! replaces it: the app's runs, and its exit says Goodbye as any exit does.
//!
//! Fork: a child inherits the handler but not the thread. Until its own
//! agent starts a thread of its own ([`watch`]), the handler sees it is in
//! another process and dies at once the way the process would have (no
//! Goodbye: nothing there could send it).

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use oomscope_agent_core::pb;

use crate::agent::Agent;

/// The longest the signal thread waits for the Goodbye's ack before it
/// lets the signal kill the process: the collector acks in milliseconds on
/// a LAN, and a process told to stop must stop even when the collector is
/// away (a supervisor escalates to SIGKILL after seconds).
pub const SIGNAL_GOODBYE_WAIT: Duration = Duration::from_millis(500);

/// The signals handled: SIGTERM, the usual way a server is stopped, whose
/// default action skips every exit callback. (SIGINT is Python's own:
/// KeyboardInterrupt, then a normal exit that says Goodbye.)
pub const HANDLED: libc::c_int = libc::SIGTERM;

/// The signal thread's stack: it only sends a Goodbye.
const WATCHER_STACK: usize = 256 * 1024;

/// The disposition the process had before ours; written once, before ours
/// is installed, and only read after (`INSTALLED`).
struct Previous(UnsafeCell<MaybeUninit<libc::sigaction>>);
// SAFETY: written once before INSTALLED is set (Release), read only after
// it is seen set (Acquire).
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(UnsafeCell::new(MaybeUninit::uninit()));
static INSTALLED: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

/// The signal on its way to the signal thread (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);
/// The process whose signal thread waits on `WAKE` (0: none yet).
static WATCHER_PID: AtomicU32 = AtomicU32::new(0);

/// Posted by the handler (`sem_post` is async-signal-safe), waited on by
/// the signal thread. No file descriptor: a forked child shares none with
/// its parent through it.
struct Wake(UnsafeCell<MaybeUninit<libc::sem_t>>);
// SAFETY: a POSIX semaphore is made to be shared between threads; it is
// initialised before any thread waits on it (`start_watcher`).
unsafe impl Sync for Wake {}
static WAKE: Wake = Wake(UnsafeCell::new(MaybeUninit::uninit()));

/// The agent the signal thread says Goodbye for: a leaked `Arc` (never
/// freed, so the thread may read it at any time without a lock: a lock it
/// held could be inherited held by a child forked at that moment). One
/// `Agent` a `start()` leaks, a few KB, which a process does once or a few
/// times.
static AGENT: AtomicPtr<Agent> = AtomicPtr::new(std::ptr::null_mut());

/// How `install` left SIGTERM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// Our handler is in place.
    Native,
    /// SIGTERM was ignored: left so.
    Ignored,
    /// Not installed (no thread, or `sigaction` refused).
    Unavailable,
}

impl Installed {
    pub fn as_str(self) -> &'static str {
        match self {
            Installed::Native => "native",
            Installed::Ignored => "ignored",
            Installed::Unavailable => "unavailable",
        }
    }
}

static OUTCOME: AtomicI32 = AtomicI32::new(-1);

/// Installs the handler, once per process (a forked child inherits it).
/// Call it after Python's `signal` module is imported: that module reads
/// each signal's disposition once, when first imported, and would read ours
/// as "not Python's" (`signal.getsignal` then says None).
pub fn install() -> Installed {
    INSTALL.call_once(|| {
        let outcome = install_once();
        OUTCOME.store(outcome as i32, Ordering::Relaxed);
    });
    match OUTCOME.load(Ordering::Relaxed) {
        0 => Installed::Native,
        1 => Installed::Ignored,
        _ => Installed::Unavailable,
    }
}

fn install_once() -> Installed {
    let mut old = MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: reads the current disposition into `old`.
    if unsafe { libc::sigaction(HANDLED, std::ptr::null(), old.as_mut_ptr()) } != 0 {
        return Installed::Unavailable;
    }
    // SAFETY: sigaction succeeded and wrote it.
    let old = unsafe { old.assume_init() };
    if old.sa_sigaction == libc::SIG_IGN {
        return Installed::Ignored;
    }
    // SAFETY: the only write, before INSTALLED is set and the handler is in.
    unsafe { (*PREVIOUS.0.get()).write(old) };
    if !start_watcher() {
        return Installed::Unavailable;
    }
    INSTALLED.store(true, Ordering::Release);
    let mut ours = MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a zeroed sigaction with our handler, SA_SIGINFO (it takes the
    // siginfo to chain with), SA_RESTART (a read interrupted by it goes on,
    // as it would have with the default), SA_ONSTACK (as Python's own).
    let rc = unsafe {
        let a = ours.as_mut_ptr();
        (*a).sa_sigaction = on_signal as *const () as usize;
        (*a).sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
        libc::sigemptyset(&mut (*a).sa_mask);
        libc::sigaction(HANDLED, ours.as_ptr(), std::ptr::null_mut())
    };
    if rc == 0 {
        Installed::Native
    } else {
        Installed::Unavailable
    }
}

/// Makes `agent` the one the signal thread says Goodbye for, and starts
/// the thread in this process if it has none (a forked child).
pub fn watch(agent: &Arc<Agent>) {
    let raw = Arc::into_raw(agent.clone()).cast_mut();
    // The previous one is leaked: the signal thread may be reading it.
    AGENT.store(raw, Ordering::Release);
    if INSTALLED.load(Ordering::Acquire)
        && WATCHER_PID.load(Ordering::Acquire) != std::process::id()
    {
        start_watcher();
    }
}

/// Starts the signal thread for this process. In a forked child the
/// semaphore is initialised again: no thread waits on it there.
fn start_watcher() -> bool {
    // SAFETY: no thread of this process waits on WAKE yet (the parent's
    // thread, if any, does not exist in a child).
    if unsafe { libc::sem_init((*WAKE.0.get()).as_mut_ptr(), 0, 0) } != 0 {
        return false;
    }
    PENDING.store(0, Ordering::Relaxed);
    // Before the thread exists: a signal in between posts the semaphore,
    // which the thread finds at once.
    WATCHER_PID.store(std::process::id(), Ordering::Release);
    let spawned = std::thread::Builder::new()
        .name("oomscope-signal".into())
        .stack_size(WATCHER_STACK)
        .spawn(watcher);
    match spawned {
        Ok(_) => true,
        Err(e) => {
            WATCHER_PID.store(0, Ordering::Release);
            tracing::warn!(error = %e, "oomscope: no signal thread; SIGTERM is left as it was");
            false
        }
    }
}

/// The handler. Async-signal-safe: atomics, `getpid`, `sem_post`,
/// `sigaction`, `kill`, and the previous handler (the app's, as safe as it is).
extern "C" fn on_signal(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is this thread's; the interrupted code must find it unchanged.
    let errno = unsafe { *libc::__errno_location() };
    if !INSTALLED.load(Ordering::Acquire) {
        return;
    }
    // SAFETY: written before INSTALLED was set.
    let previous = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
    let handler = previous.sa_sigaction;
    if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
        // SAFETY: the process's own handler, called as the kernel would
        // have called it (with the siginfo when it asked for one).
        unsafe {
            if previous.sa_flags & libc::SA_SIGINFO != 0 {
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(handler);
                f(sig, info, ctx);
            } else {
                let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
                f(sig);
            }
        }
    } else if PENDING
        .compare_exchange(0, sig, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
    {
        // SAFETY: getpid and sem_post are async-signal-safe.
        let here = unsafe { libc::getpid() } as u32;
        if WATCHER_PID.load(Ordering::Acquire) == here {
            unsafe { libc::sem_post((*WAKE.0.get()).as_mut_ptr()) };
        } else {
            // A forked child whose agent has no thread yet: die now, as
            // without the agent.
            die_as_before(sig, previous);
        }
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Restores `previous` and sends `sig` to the process again: with the
/// default disposition, it dies by it. Async-signal-safe.
fn die_as_before(sig: libc::c_int, previous: &libc::sigaction) {
    // SAFETY: sigaction and kill are async-signal-safe.
    unsafe {
        libc::sigaction(sig, previous, std::ptr::null_mut());
        libc::kill(libc::getpid(), sig);
    }
}

/// The signal thread: waits for the handler, says Goodbye (bounded), and
/// lets the signal do what it would have done.
fn watcher() {
    loop {
        // SAFETY: WAKE was initialised before this thread started.
        let r = unsafe { libc::sem_wait((*WAKE.0.get()).as_mut_ptr()) };
        if r != 0 {
            continue; // EINTR
        }
        let sig = PENDING.load(Ordering::Acquire);
        if sig == 0 {
            continue;
        }
        let _ = std::panic::catch_unwind(|| goodbye(sig));
        // SAFETY: set before the handler was installed, which woke us.
        let previous = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
        die_as_before(sig, previous);
        return;
    }
}

/// The Goodbye for `sig`, acked within [`SIGNAL_GOODBYE_WAIT`] or not at
/// all. Touches no Python and not the process's agent slot (see `AGENT`);
/// a held agent says nothing.
fn goodbye(sig: libc::c_int) {
    let raw = AGENT.load(Ordering::Acquire);
    if raw.is_null() {
        return;
    }
    // SAFETY: every pointer stored in AGENT is a leaked Arc, never freed.
    let agent = unsafe { &*raw };
    let goodbye = pb::Goodbye {
        reason: signal_name(sig),
        exit_code: 128 + sig,
    };
    // The requests' events the sampler has not taken yet go first (the
    // hand-off's lock is held only for a push, never across a wait).
    agent.forward_events();
    let wait = agent.config.exit_flush.min(SIGNAL_GOODBYE_WAIT);
    agent.reporter.clone().shutdown(goodbye, wait);
}

/// The Goodbye's reason for a handled signal.
pub fn signal_name(sig: libc::c_int) -> String {
    match sig {
        libc::SIGTERM => "SIGTERM".to_string(),
        _ => format!("signal {sig}"),
    }
}
