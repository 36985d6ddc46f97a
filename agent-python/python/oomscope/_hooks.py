"""The Python-side hooks: gc callbacks, fork handlers, exception hooks,
interpreter exit, SIGTERM, and (once CUDA is up) torch's OOM observer and an
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
    the agent lost. Chains what was there: the default (say Goodbye, then
    die by SIGTERM as before), a Python handler (call it; the exit it leads
    to runs the atexit Goodbye), SIG_IGN or a handler set from C (left
    alone). An app that installs its own handler later simply replaces this
    one. Python runs handlers on the main thread between bytecodes, so a
    main thread inside a long C call sees the signal when that call returns."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal() works only there
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except Exception:  # noqa: BLE001
        return
    if previous is signal.SIG_IGN or previous is None:
        return

    def on_sigterm(signum, frame):
        if previous is not signal.SIG_DFL:
            return previous(signum, frame)  # the app's own: what it raises is its choice
        try:
            _native.stop("SIGTERM", 128 + signum)
        except BaseException:  # noqa: BLE001 - the process is dying anyway
            pass
        try:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # dies here, by SIGTERM, as without us
        except BaseException:  # noqa: BLE001
            pass
        os._exit(128 + signum)  # SIGTERM blocked or refused: end as it would have

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except Exception:  # noqa: BLE001 - e.g. an embedded interpreter without signals
        pass


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
