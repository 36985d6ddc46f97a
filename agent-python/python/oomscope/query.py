"""Reading a collector back over gRPC (its QueryService), for tools and
tests. Each query returns its reply message's serde form, the very shape
``oomscope <verb> --json`` prints: dicts keyed by the proto field names
(proto/proto/oomscope/v1/query.proto documents them), enum fields as their
lowercase names, an unset message or optional field as None, a oneof's
member under its own field name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _native

if TYPE_CHECKING:
    from typing import Any


def timeline(collector: str, agent: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """A ``TimelineResponse`` for an agent id or name: ``{"hello": {...},
    "samples": [{"seq", "sample": {"time_ns", "process", "cgroup", "system",
    "gpus", "allocator", "context", ...}, "low", "high"}], "events": [{"seq",
    "event": {"time_ns", "heap_census": {...}}, "agent_id"}], "members":
    [...], "events_cut_ns"}``. An instance's timeline (its name, or its first
    agent's id) has every member's events, each naming its sender in
    ``agent_id`` ("" for the timeline's own agent)."""
    return _native.query_timeline(collector, agent, timeout_s)


def agents(collector: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """A list of ``AgentSummary``: ``[{"hello": {...}, "state":
    "connected"|"disconnected"|"lost", "first_seen_ns", "last_seen_ns",
    "samples", "events", "last_seq", "instance", "goodbye", "context"}]``,
    ``context`` being the agent's latest load (its newest sample's)."""
    return _native.query_agents(collector, timeout_s)


def incidents(
    collector: str, agent: str = "", timeout_s: float = 10.0
) -> list[dict[str, Any]]:
    """A list of ``Incident``: ``[{"id", "agent_id", "agent_name", "kind",
    "time_ns", "domain", "summary", "seq", "parts": [...]}]``, of one agent
    (id or name) where given."""
    return _native.query_incidents(collector, agent, timeout_s)


def diagnose(
    collector: str, incident: str = "", agent: str = "", timeout_s: float = 10.0
) -> dict[str, Any]:
    """The ``Diagnosis`` of an incident id, else of the agent's latest
    incident (or its whole history without one), else of the latest
    incident: ``{"incident", "agent", "domain", "trigger", "causes": [{"kind",
    "confidence", "evidence", "metrics", "processes"}], "fixes", "capacity",
    "evidence", "exit", "cgroup", "failure", "victim", "kernel_report",
    "device"}``."""
    return _native.query_diagnose(collector, incident, agent, timeout_s)
