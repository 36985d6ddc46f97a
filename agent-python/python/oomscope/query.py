"""Reading a collector back over gRPC (its QueryService), for tools and
tests: every field of every sample and event, by its proto name."""

from . import _native


def timeline(collector, agent, timeout_s=10.0):
    """``{"hello": {...}, "samples": [...], "events": [{"kind": "heap_census",
    "heap_census": {...}, "seq", "time_ns"}, ...]}`` for an agent id or name."""
    return _native.query_timeline(collector, agent, timeout_s)


def agents(collector, timeout_s=10.0):
    """``[{"hello": {...}, "state": "connected"|"disconnected"|"lost", ...}]``."""
    return _native.query_agents(collector, timeout_s)
