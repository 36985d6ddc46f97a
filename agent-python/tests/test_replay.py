"""Every capture in tests/fixtures/torch-h200, replayed into a real
collector: the timeline, OOM event, error text and snapshot summary are
held intact (numbers compared with the file, computed here independently),
and the live agent's conversions give the same shapes as replay's."""

import gzip
import json
import os
import sys

import pytest

import oomscope._native as native
from conftest import DRIVE_DIR, FIXTURES, events

FILES = sorted(f for f in os.listdir(FIXTURES) if f.endswith((".json", ".json.gz")))


def load(name):
    path = os.path.join(FIXTURES, name)
    with (gzip.open(path, "rt") if name.endswith(".gz") else open(path)) as f:
        return json.load(f)


def snapshot_facts(snap, device=0):
    """Segments, reserved, allocated and the largest free block, by hand."""
    segs = [s for s in snap["segments"] if s.get("device", device) == device]
    blocks = [b for s in segs for b in s.get("blocks", [])]
    return {
        "segments": len(segs),
        "reserved_bytes": sum(s["total_size"] for s in segs),
        "allocated_bytes": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "largest_free_block_bytes": max([b["size"] for b in blocks if b["state"] == "inactive"] or [0]),
    }


def test_every_fixture_is_here():
    assert len(FILES) >= 14, FILES


@pytest.mark.parametrize("name", FILES)
def test_replay_holds_the_capture_intact(collector, name):
    cap = load(name)
    agent = "rp-" + name.split(".")[0]
    collector.cli("replay", os.path.join(FIXTURES, name), "--name", agent)
    t = collector.timeline(agent)
    assert t["hello"]["name"] == agent
    timeline = cap.get("timeline")
    if timeline is None:  # raw facts: a Hello with labels
        assert t["samples"] == [] and t["hello"]["labels"], t["hello"]
        return
    # Every timeline entry, then the final reading, as samples in order.
    samples = t["samples"]
    expected = [e["memory_stats"] for e in timeline] + ([cap["final"]["memory_stats"]] if cap.get("final") else [])
    assert len(samples) == len(expected)
    for got, ms in zip(samples, expected):
        a = got["allocator"][0]
        assert a["allocated_bytes"] == ms.get("allocated_bytes.all.current", 0)
        assert a["reserved_bytes"] == ms.get("reserved_bytes.all.current", 0)
        assert a["inactive_split_bytes"] == ms.get("inactive_split_bytes.all.current", 0)
        assert a["num_ooms"] == ms.get("num_ooms", 0)
    for got, e in zip(samples, timeline):
        ctx = e.get("context") or {}
        if "requests_done" in ctx:
            assert got["context"]["requests_done"] == ctx["requests_done"]
        if "phase" in ctx:
            assert got["context"]["phase"] == ctx["phase"]
    ooms = events(t, "oom")
    if cap.get("oom") or cap.get("error"):
        assert len(ooms) == 1
        o = ooms[0]
        if cap.get("oom"):
            assert o["observer"] == {k: cap["oom"]["observer"][k] for k in
                                     ("device", "alloc", "device_allocated", "device_free")}
            assert o["requested_bytes"] == cap["oom"]["observer"]["alloc"]
            if cap["oom"].get("snapshot_at_oom"):
                facts = snapshot_facts(cap["oom"]["snapshot_at_oom"])
                assert {k: o["snapshot"][k] for k in facts} == facts
        if cap.get("error"):
            assert o["error_text"] == cap["error"]["message"]
            assert o["error_type"] == cap["error"]["type"]
    else:
        assert ooms == []
    if cap.get("final_snapshot"):
        snaps = events(t, "snapshot")
        facts = snapshot_facts(cap["final_snapshot"])
        assert {k: snaps[-1][k] for k in facts} == facts
        # Same facts, same message: the live agent's conversion of the very
        # dicts torch hands it equals what the replay stored.
        live = native.summarize_snapshot(cap["final_snapshot"], 0)
        assert live == snaps[-1]
        ms = timeline[-1]["memory_stats"] if timeline else None
        if ms is not None:
            info = timeline[-1].get("mem_get_info")
            live_stats = native.convert_memory_stats(ms, 0, (info["free"], info["total"]) if info else None)
            stored = samples[len(timeline) - 1]["allocator"][0]
            assert live_stats == stored


def test_the_nested_read_gives_what_memory_stats_gives(monkeypatch):
    """The live agent flattens torch's nested dict itself (cheaper than
    `memory_stats()` doing it in Python): the result must be what torch's
    own `memory_stats()` flattening yields, for every fixture's stats."""
    import torch.cuda.memory as tcm
    sys.path.insert(0, DRIVE_DIR)
    from bench_overhead import nest

    seen = 0
    for name in FILES:
        for step in load(name).get("timeline", []):
            flat = step.get("memory_stats")
            if not flat:
                continue
            nested = nest(flat)
            monkeypatch.setattr(tcm, "memory_stats_as_nested_dict", lambda device=None, n=nested: n)
            torch_flat = tcm.memory_stats(0)
            assert dict(torch_flat) == flat, name
            ours = native.convert_memory_stats(nested, 0, (1, 2))
            assert ours == native.convert_memory_stats(torch_flat, 0, (1, 2)), name
            assert ours["allocated_bytes"] == flat["allocated_bytes.all.current"]
            seen += 1
    assert seen >= 20, seen
