"""Reading a collector back over gRPC (its QueryService), for tools and
tests: every field of every message, by its proto name (the protos' own serde
form; see agent-python/src/query.rs for the shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _native

if TYPE_CHECKING:
    from typing import Any


def timeline(collector: str, agent: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """``{"hello": {...}, "samples": [{"seq", "time_ns", "process", "cgroup",
    "system", "gpus", "allocator", "context", ...}], "events": [{"seq",
    "time_ns", "agent_id", "kind": "heap_census", "heap_census": {...}}, ...],
    "members": [...]}`` for an agent id or name. An instance's timeline (its
    name, or its first agent's id) has every member's events, each naming
    its sender in ``agent_id`` ("" for the timeline's own agent)."""
    return _native.query_timeline(collector, agent, timeout_s)


def agents(collector: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """``[{"hello": {...}, "state": "connected"|"disconnected"|"lost",
    "first_seen_ns", "last_seen_ns", "samples", "events", "last_seq"}]``."""
    return _native.query_agents(collector, timeout_s)
