"""Imported by ``oomscope-autostart.pth`` at interpreter start-up when
``OOMSCOPE_COLLECTOR`` is set (e.g. by ``oomscope run``): starts the agent with
its settings from the environment, held (see ``oomscope.start``) so that
short-lived helpers never reach the collector. A failure is printed, never
raised: a broken agent must not stop the server from starting."""

import sys as _sys


def _helper():
    """multiprocessing's resource tracker: started with every spawn-context
    worker and living as long as its parent, it runs no user code, so its
    agent would only add a name to every multi-process server."""
    argv = getattr(_sys, "orig_argv", None) or []  # Python 3.10+; before, no way to tell
    return any("from multiprocessing.resource_tracker import main" in a for a in argv)


try:
    if not _helper():
        import oomscope as _oomscope
        _oomscope._start(True)
except Exception as _e:  # noqa: BLE001 - start-up must go on
    print("oomscope: autostart failed: %s" % _e, file=_sys.stderr)
