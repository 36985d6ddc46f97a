"""Imported by ``oomscope-autostart.pth`` at interpreter start-up when
``OOMSCOPE_COLLECTOR`` is set (e.g. by ``oomscope run``): starts the agent with
its settings from the environment. A failure is printed, never raised: a
broken agent must not stop the server from starting."""

try:
    import oomscope as _oomscope
    _oomscope.start()
except Exception as _e:  # noqa: BLE001 - start-up must go on
    import sys as _sys
    print("oomscope: autostart failed: %s" % _e, file=_sys.stderr)
