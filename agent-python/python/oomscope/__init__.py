"""oomscope: an in-process memory agent for PyTorch servers.

    import oomscope
    oomscope.start(collector="http://127.0.0.1:7433", name="my-server")

    with oomscope.phase("load", model="llama-3-8b", dtype="bfloat16"):
        model = load()
    with oomscope.request(id=req_id, prompt_tokens=n, max_tokens=m) as r:
        out = generate(...)
        r.output_tokens = len(out)

Under ``oomscope run -- python server.py`` no code change is needed: the
wheel installs ``oomscope-autostart.pth``, which starts the agent at
interpreter start-up whenever ``OOMSCOPE_COLLECTOR`` is set (set
``OOMSCOPE_AUTOSTART=0`` to opt out). Every ``start()`` argument can also come
from ``OOMSCOPE_<NAME>`` (``OOMSCOPE_NAME``, ``OOMSCOPE_INTERVAL_S``, ...).
An autostarted agent stays silent (samples kept in memory, a bounded queue)
until its process makes a request, hits an OOM or uses CUDA, or, under
``oomscope run`` only (``OOMSCOPE_SUPERVISOR_AGENT`` or ``OOMSCOPE_INSTANCE``
set), has lived ``OOMSCOPE_HOLD_S`` (2 s): the helpers a server starts, and
unrelated programs that share its environment (a load generator), come and
go without appearing at the collector. An explicit ``start()`` or
``flush()`` ends the wait.

On SIGTERM the agent says Goodbye (within 0.5 s, from its own thread: a
native handler, so a main thread stuck in C still dies by it), then the
process dies by SIGTERM as it would have; a handler the app installed
before it is called instead, and one installed after it takes over (either
way a normal exit still says Goodbye). A multiprocessing child says Goodbye
before its ``os._exit``, after delivering what it recorded.

The work happens in Rust (``oomscope._native``), on the agent's own threads;
nothing here raises into the server because the collector is away.
"""

from __future__ import annotations

import sys as _sys
from typing import TYPE_CHECKING

from . import _native
from ._native import (__version__, agent_id, flush, is_running, record_request, request,
                      set_context, set_identity, set_labels, snapshot, stats)

if TYPE_CHECKING:  # annotations only (never evaluated: see the __future__ import)
    import os
    from types import TracebackType
    from typing import Any

__all__ = [
    "start", "stop", "request", "phase", "set_context", "set_labels", "set_identity",
    "record_request", "snapshot", "census", "is_running", "agent_id", "stats", "flush",
    "__version__",
]


def start(*, collector: str | None = None, name: str | None = None,
          model: str | None = None, revision: str | None = None,
          quantization: str | None = None, dtype: str | None = None,
          interval_s: float | None = None, role: str | None = None,
          rank: int | None = None, spool_dir: str | os.PathLike[str] | None = None,
          oom_wait_s: float | None = None, census_every: int | None = None,
          census_interval_s: float | None = None, census_budget_s: float | None = None,
          history_max_entries: int | None = None, exit_flush_s: float | None = None,
          boundary_min_interval_s: float | None = None, census_auto: bool | None = None,
          thread_nice: int | None = None, census_trim: bool | None = None,
          buffer_max_bytes: int | None = None, spool_max_bytes: int | None = None) -> bool:
    """Starts the agent; returns whether this call started or changed one.
    Every argument is a keyword (an unknown one is a TypeError).

    Arguments left as None come from ``OOMSCOPE_<NAME>`` variables, then the
    defaults: collector ``http://127.0.0.1:7433``, name the script's, role
    "server", rank ``$RANK`` or 0, no model (``revision``, ``quantization``
    and ``dtype`` describe it), interval_s 1.0, oom_wait_s 0.2 (how long an
    OOM waits for the collector's ack), census_auto True (heap censuses
    after requests 10 and 50, and whenever allocated blocks or RSS grow for
    certain across requests, all within 10 % of wall time, so a short run
    may have none), census_every 0 (none by count),
    census_interval_s 3600, census_budget_s 2.0 (GIL time over all of a
    census's slices, each at most 10 ms), census_trim True (after a census,
    malloc_trim hands what it freed back to the system), no spool_dir
    (unacked evidence waits in memory, at most buffer_max_bytes, 16 MiB: past
    it, while the collector is down, the older samples and request events
    are thinned and the newest kept whole; with a spool_dir it waits on disk
    too, at most spool_max_bytes, 64 MiB, past which the oldest go), no
    memory history (history_max_entries 0), exit_flush_s for the Goodbye's acks,
    boundary_min_interval_s 0.05 (the spacing of boundary messages, each
    carrying the readings of every request begun or ended since the last;
    also its floor: at most 20 such messages a second at any request rate,
    a smaller value is raised to it), thread_nice 0
    (the agent's own threads run as SCHED_BATCH, so a waking one never
    preempts the server's threads; 19 lowers them further, but on a server
    that keeps every core busy its evidence then comes late).
    A bad value raises ValueError here, never later, and changes nothing.

    Called while the autostart's agent runs (``OOMSCOPE_COLLECTOR`` set), it
    re-configures that agent with these settings (the environment fills the
    rest, as for a first start) and ends its hold: the app's own call wins.
    A still-held agent, which has said nothing yet, is replaced without a
    trace by one started with these settings; a heard one takes a new name,
    role, rank or model in a new Hello (same agent id), and for any other
    setting says Goodbye ("reconfigured") and is followed by a new agent.
    The same settings as the running agent's change nothing (False). Called
    while an agent started by ``start()`` runs, it does nothing (False).
    """
    # Here locals() is exactly the settings above, passed on by name.
    return _start(False, **locals())


def _start(autostart: bool, **settings: object) -> bool:
    started = _native.start(autostart=autostart, **settings)
    if started:
        from . import _hooks
        _hooks.install()
    return started


def stop(reason: str = "stop") -> bool:
    """Sends Goodbye and waits briefly for the collector's acks. Harmless twice."""
    return _native.stop(reason)


def census(budget_s: float | None = None, sizing: str = "all") -> dict[str, Any]:
    """Runs a Python heap census now (holds the GIL up to ``budget_s``) and
    returns it: ``{"types": [{"type_name", "count", "bytes"}], ...}``.
    ``sizing="growers"`` counts every object but sizes only tensors, arrays,
    buffers and the types grown most in count since the previous census, as
    a census on suspicion does; the others' bytes are estimated from their
    last measured mean size (``"bytes_estimated": True``)."""
    return _native.census(budget_s, sizing)


class phase:
    """Marks a phase such as a model load: device and host memory before and
    after, the model listed as active once loaded, the error if it fails."""

    __slots__ = ("name", "model", "revision", "quantization", "dtype", "_before")

    def __init__(self, name: str = "load", model: str | None = None,
                 revision: str | None = None, quantization: str | None = None,
                 dtype: object = None) -> None:
        self.name, self.model, self.revision = name, model, revision
        self.quantization = quantization
        self.dtype = str(dtype) if dtype is not None else None  # a torch.dtype too
        self._before = 0

    def __enter__(self) -> phase:
        _native.ensure_torch_hooks()
        self._before = _native.phase_edge(self.name, True, self.model, self.revision,
                                          self.quantization, self.dtype)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        # Reports an out-of-memory error; the text as a request's end has it.
        error = _native.exit_error(exc_type, exc) if exc is not None else ""
        _native.ensure_torch_hooks()
        _native.phase_edge(self.name, False, self.model, self.revision, self.quantization,
                           self.dtype, error, self._before)
        return False
