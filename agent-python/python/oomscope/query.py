"""Reading a collector back over gRPC (its QueryService), for tools and
tests: every field of every message, by its proto name (the protos' own serde
form; see agent-python/src/query.rs for the shape)."""

from . import _native


def timeline(collector, agent, timeout_s=10.0):
    """``{"hello": {...}, "samples": [{"seq", "time_ns", "process", "cgroup",
    "system", "gpus", "allocator", "context", ...}], "events": [{"seq",
    "time_ns", "kind": "heap_census", "heap_census": {...}}, ...]}`` for an
    agent id or name."""
    return _native.query_timeline(collector, agent, timeout_s)


def agents(collector, timeout_s=10.0):
    """``[{"hello": {...}, "state": "connected"|"disconnected"|"lost",
    "first_seen_ns", "last_seen_ns", "samples", "events", "last_seq"}]``."""
    return _native.query_agents(collector, timeout_s)
