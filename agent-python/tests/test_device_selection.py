"""The devices the agent reads (issue #29): those the process uses, never
the sampler thread's default device 0, and none where the process has no
context. Each case runs tests/programs/device_selection.py in its own
process over the scripted torch of programs/fake_torch_cuda.py, which
mirrors CUDA's per-thread current device and records every call with the
device it touched, against a real collector."""

import json
import os
import subprocess
import sys

import pytest

from conftest import events

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "device_selection.py")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "programs"))
import fake_torch_cuda  # noqa: E402

GIB = fake_torch_cuda.GIB
# Calls that only ask: they create no context, switch no thread's device and
# read nothing a device holds (the agent asks the current device of the
# server's threads, never of its own: see the sampler's check).
ASKS = {"has_primary_context", "current_device"}


def run(collector, name, case, *flags):
    r = subprocess.run([sys.executable, PROGRAM, "--collector", collector.url, "--name", name, "--case", case,
                        *flags], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OOMSCOPE_AUTOSTART="0"))
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["flushed"], report["stats"]
    return report


def agent_calls(report):
    """The calls made by the agent's own threads (the program's run on MainThread)."""
    return [c for c in report["calls"] if c[2] != "MainThread"]


def readings(timeline):
    return [a for s in timeline["samples"] for a in s["allocator"]]


def uuid(device):
    return "GPU-" + fake_torch_cuda.uuid_text(device)


@pytest.mark.parametrize("flags", [(), ("--no-primary-context",)], ids=["context-query", "old-torch"])
def test_the_agent_reads_the_device_the_server_set_and_never_touches_device_0(collector, flags):
    report = run(collector, "dev-one", "one-device", *flags)
    # No context anywhere the program did not make one: the agent made none.
    assert report["contexts"] == [2], report["calls"]
    on_0 = [c for c in report["calls"] if c[1] == 0 and c[0] not in ASKS]
    if flags:  # without the context query the allocator's counters of each device are looked at
        on_0 = [c for c in on_0 if c[0] != "memory_stats"]
    assert on_0 == [], on_0
    # The sampler never asks its own thread's device (it would be 0).
    assert not [c for c in agent_calls(report) if c[0] == "current_device"]
    assert [c for c in agent_calls(report) if c[0] == "mem_get_info"], "free/total were read on device 2"

    t = collector.timeline("dev-one")
    got = readings(t)
    assert len(got) >= 3, "periodic and boundary samples read the allocator"
    assert {a["device"] for a in got} == {2}
    assert {a["device_uuid"] for a in got} == {uuid(2)}
    assert {a["pci_bus_id"] for a in got} == {"00000000:12:00.0"}
    last = got[-1]
    assert (last["reserved_bytes"], last["allocated_bytes"]) == (GIB, GIB)
    assert (last["driver_free_bytes"], last["driver_total_bytes"]) == (7 * GIB, 8 * GIB)
    # The Hello places the device by ordinal and uuid (no NVML here: index unknown).
    placed = [(g["ordinal"], g["uuid"], g["total_bytes"]) for g in t["hello"]["gpus"] if g["ordinal"] is not None]
    assert placed == [(2, uuid(2), 8 * GIB)]


def test_a_model_spread_over_two_devices_reads_both_and_the_oom_names_its_device(collector):
    report = run(collector, "dev-map", "device-map")
    assert report["oom_caught"]
    assert report["contexts"] == [1, 3], report["calls"]
    # The main thread's current device is 0 but has no context: nothing on it is read.
    assert [c for c in report["calls"] if c[1] == 0 and c[0] not in ASKS] == []
    assert not [c for c in agent_calls(report) if c[0] == "current_device"]

    t = collector.timeline("dev-map")
    by_device = {}
    for a in readings(t):
        by_device.setdefault(a["device"], a)
    assert sorted(by_device) == [1, 3]
    assert (by_device[1]["device_uuid"], by_device[1]["allocated_bytes"]) == (uuid(1), 2 * GIB)
    assert (by_device[3]["device_uuid"], by_device[3]["allocated_bytes"]) == (uuid(3), 3 * GIB)
    ooms = events(t, "oom")
    assert len(ooms) == 1
    oom = ooms[0]
    assert (oom["device"], oom["device_uuid"]) == (3, uuid(3))
    assert oom["observer"]["device"] == 3 and oom["observer"]["alloc"] == 6 * GIB
    assert (oom["stats"]["device"], oom["stats"]["device_uuid"]) == (3, uuid(3))
    assert oom["stats"]["allocated_bytes"] == 3 * GIB
    placed = sorted((g["ordinal"], g["uuid"]) for g in t["hello"]["gpus"] if g["ordinal"] is not None)
    assert placed == [(1, uuid(1)), (3, uuid(3))]


def test_under_cuda_malloc_async_the_other_hooks_install_and_the_oom_still_arrives(collector):
    report = run(collector, "dev-async", "async")
    missing = report["stats"]["torch_hooks_missing"]
    assert sorted(missing) == ["memory_history", "oom_observer"], missing
    assert "cudaMallocAsync does not yet support" in missing["oom_observer"]
    assert report["empty_cache_wrapped"]
    assert report["oom_caught"]
    assert report["contexts"] == [1]

    t = collector.timeline("dev-async")
    assert t["hello"]["allocator_settings"]["backend"] == "cudaMallocAsync"
    releases = events(t, "cache_release")
    assert [(r["device"], r["reserved_before_bytes"]) for r in releases] == [(1, GIB)]
    ooms = events(t, "oom")
    assert len(ooms) == 1
    oom = ooms[0]
    # No observer: the device comes from the text, its stats are read there.
    assert oom["observer"] is None
    assert "Allocation on device 1 would exceed allowed memory" in oom["error_text"]
    assert (oom["device"], oom["device_uuid"]) == (1, uuid(1))
    assert (oom["stats"]["device"], oom["stats"]["reserved_bytes"]) == (1, GIB)
    # The counters this backend does not keep are not sent as zeros.
    raw = [a["raw"] for a in readings(t) if a["raw"]]
    assert raw and all(set(r) <= {"allocated_bytes.all.current", "allocated_bytes.all.peak",
                                  "active_bytes.all.current", "active_bytes.all.peak",
                                  "reserved_bytes.all.current", "reserved_bytes.all.peak"} for r in raw), raw[:1]
    assert any(r.get("reserved_bytes.all.current") == GIB for r in raw)


def test_a_held_helper_reads_no_device_until_it_uses_one(collector):
    """A held agent (the autostart's, in a process that may be a passing
    helper) only asks whether the process uses a device; once it does, the
    agent is released and reads it."""
    report = run(collector, "dev-held", "held")
    assert report["held"] is True
    held_calls = [c for c in report["held_calls"] if c[2] != "MainThread"]
    assert held_calls, "the sampler looked"
    assert {c[0] for c in held_calls} == {"has_primary_context"}, held_calls
    assert report["contexts"] == [2]
    assert report["stats"]["held"] is False

    got = readings(collector.timeline("dev-held"))
    assert got and {(a["device"], a["device_uuid"]) for a in got} == {(2, uuid(2))}
