"""The Python-side hooks: gc callbacks, fork handlers, exception hooks,
interpreter exit, SIGTERM (natively), multiprocessing children's exit, and (once CUDA is up) torch's OOM observer and an
``empty_cache`` wrapper. Each hook is a few lines that hand facts to the
native agent; none of them raises into the server."""

import atexit
import gc
import os
import signal
import sys
import threading
import time

from . import _native

#: gen-0/1 collections happen thousands of times a minute; report at most
#: this many a second (gen-2 collections, the ones that free cycles held for
#: long, are always reported).
GC_EVENTS_PER_S = 10

_installed = False
_observer_attached = False
_gc_start_ns = [0]
_gc_window = [0.0, 0]


def install():
    """Once per process: these survive stop()/start() and do nothing while
    the agent is stopped."""
    global _installed
    if _installed:
        return
    _installed = True
    gc.callbacks.append(_on_gc)
    atexit.register(_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_native.after_fork_child,
                            after_in_parent=_native.after_fork_parent)
        os.register_at_fork(after_in_child=_watch_multiprocessing)
    prev_sys = sys.excepthook

    def excepthook(exc_type, exc, tb):
        report_if_oom(exc)
        prev_sys(exc_type, exc, tb)

    sys.excepthook = excepthook
    prev_thread = threading.excepthook

    def thread_excepthook(args):
        report_if_oom(args.exc_value)
        prev_thread(args)

    threading.excepthook = thread_excepthook
    _install_sigterm()
    _native.ensure_torch_hooks()


def _install_sigterm():
    """Goodbye on SIGTERM, the usual way a server is stopped, which skips
    atexit when nobody handles it: without it the collector can only call
    the agent lost. The handler is a native one (``sigaction``), so a main
    thread stuck in C dies by SIGTERM as it would without the agent; the
    agent's own thread says the Goodbye (at most 0.5 s) and then lets the
    signal do what it did before: kill the process (the default), call
    the app's handler (installed before the agent's), or nothing (SIG_IGN,
    left alone). A handler the app installs later replaces it, and the exit
    it leads to says Goodbye. ``signal`` is imported above first: it reads
    each signal's disposition once, when first imported."""
    global sigterm
    try:
        sigterm = _native.install_signal_handlers()
    except Exception:  # noqa: BLE001 - the process keeps its own disposition
        sigterm = "unavailable"


#: How SIGTERM was left by the agent: "native", "ignored" or "unavailable".
sigterm = None

#: Runs after every other multiprocessing finalizer of the child (those
#: with an exit priority run highest first).
MP_EXIT_PRIORITY = -(2 ** 31)


class _ForkedChildren:
    """multiprocessing keeps a weak reference to what it calls after a fork."""


_forked_children = _ForkedChildren()


def _watch_multiprocessing():
    """A multiprocessing child ends through ``os._exit``, past atexit: what
    its agent recorded would die with it, and the collector would call it
    lost. Each child started by fork (or forkserver) says Goodbye once its
    ``run()`` is over, from a finalizer that ``multiprocessing.util``
    runs before that exit, after the app's own; the Goodbye waits for the
    acks of everything sent before it (up to the agent's exit_flush_s).
    The finalizer is registered in the child, by the hook multiprocessing
    runs there once it has cleared the parent's finalizers; that hook is
    registered in each forked child (multiprocessing, already imported by
    the parent that starts a Process, is not imported here for nothing),
    once: a grandchild inherits it."""
    global _mp_registered
    util = sys.modules.get("multiprocessing.util")
    if util is None or _mp_registered:
        return
    try:
        util.register_after_fork(_forked_children, _mp_child_started)
        _mp_registered = True
    except Exception:  # noqa: BLE001 - the child goes on without it
        pass


_mp_registered = False


def _mp_child_started(_):
    try:
        from multiprocessing import util
        util.Finalize(None, _mp_child_exit, exitpriority=MP_EXIT_PRIORITY)
    except Exception:  # noqa: BLE001
        pass


def _mp_child_exit():
    """Called in the ``finally`` around the child's ``run()``: the exception
    on its way out, if any, decides the status multiprocessing exits with."""
    try:
        _native.stop("multiprocessing exit", mp_exit_status(sys.exc_info()[1]))
    except Exception:  # noqa: BLE001 - the child must still exit
        pass


def mp_exit_status(exc):
    """The status ``BaseProcess._bootstrap`` gives a child whose ``run()``
    ended with `exc` (None: it returned)."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    return 1


def _at_exit():
    """The Goodbye carries the status the process ends with, which is
    decided only after atexit: the native side says it from the C library's
    exit (stop_at_exit), or here when it cannot. An uncaught
    KeyboardInterrupt ends the interpreter by SIGINT, past any exit
    callback: said now, as 128 + SIGINT."""
    try:
        if isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
            _native.stop("KeyboardInterrupt", 128 + signal.SIGINT)
        elif not _native.stop_at_exit():
            _native.stop("interpreter exit")
    except Exception:  # noqa: BLE001 - exit must go on
        pass


def _on_gc(phase, info):
    if phase == "start":
        _gc_start_ns[0] = time.perf_counter_ns()
        return
    gen = info.get("generation", 0)
    if gen < 2:
        now = time.monotonic()
        if now - _gc_window[0] >= 1.0:
            _gc_window[0], _gc_window[1] = now, 0
        if _gc_window[1] >= GC_EVENTS_PER_S or not info.get("collected"):
            return
        _gc_window[1] += 1
    try:
        _native.on_gc(gen, info.get("collected", 0), info.get("uncollectable", 0),
                      max(0, time.perf_counter_ns() - _gc_start_ns[0]))
    except Exception:  # noqa: BLE001
        pass


def is_oom(exc):
    """torch's OutOfMemoryError, MemoryError, or an error whose text says
    the device ran out of memory."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return "out of memory" in text or "CUDA_ERROR_OUT_OF_MEMORY" in text
    return False


def report_if_oom(exc):
    """Reports an out-of-memory exception once (the request context and the
    excepthook may both see it)."""
    try:
        if exc is None or getattr(exc, "_oomscope_reported", False) or not is_oom(exc):
            return
        try:
            exc._oomscope_reported = True
        except Exception:  # noqa: BLE001 - some exceptions take no attributes
            pass
        _native.on_oom_exception(type(exc).__name__, str(exc))
    except Exception:  # noqa: BLE001
        pass


def install_torch(history_max_entries=0):
    """Called by each agent once torch has initialised CUDA (a second one
    after start() replaced the first attaches no second observer). Each hook
    is installed on its own, so one torch refuses leaves the others in place:
    under ``backend:cudaMallocAsync`` torch takes no OOM observer and keeps
    no memory history (an OOM is then caught as its exception passes a
    request, a phase or the excepthook). Returns ``{hook: why}`` for each
    hook not installed."""
    import torch
    hooks = [("oom_observer", _attach_observer), ("empty_cache", _wrap_empty_cache)]
    if history_max_entries:
        hooks.append(("memory_history", lambda t: t.cuda.memory._record_memory_history(
            max_entries=int(history_max_entries))))
    missing = {}
    for name, install_hook in hooks:
        try:
            install_hook(torch)
        except Exception as e:  # noqa: BLE001 - the next hook is still worth having
            missing[name] = ("%s: %s" % (type(e).__name__, e))[:300]
    return missing


def _attach_observer(torch):
    global _observer_attached
    if _observer_attached:
        return
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        raise RuntimeError("this torch has no OOM observer")
    attach(_on_oom_observer)
    _observer_attached = True


def _wrap_empty_cache(torch):
    cuda = torch.cuda
    original = cuda.empty_cache
    if getattr(original, "_oomscope_wrapped", False):
        return

    def empty_cache():
        try:
            before = cuda.memory_reserved()
        except Exception:  # noqa: BLE001 - the caller's empty_cache still runs
            before = None
        original()
        if before is None:
            return
        try:
            frame = sys._getframe(1)
            caller = "%s:%d %s" % (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
            _native.on_cache_release(cuda.current_device(), before, cuda.memory_reserved(), caller)
        except Exception:  # noqa: BLE001
            pass

    empty_cache._oomscope_wrapped = True
    empty_cache.__doc__ = original.__doc__
    cuda.empty_cache = empty_cache
    if getattr(cuda.memory, "empty_cache", None) is original:
        cuda.memory.empty_cache = empty_cache


def _on_oom_observer(device, alloc, device_allocated, device_free):
    try:
        _native.on_oom_observer(int(device), int(alloc), int(device_allocated), int(device_free))
    except Exception:  # noqa: BLE001 - inside the allocator: never raise
        pass
