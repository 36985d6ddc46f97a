"""`oomscope.query` returns every field of the protos, with the values the
agents read: a supervised command's host domains (system memory, its cgroup
levels, its exit) and a replayed GPU capture's driver facts, checked against
/proc and the capture file, not just by key."""

import json
import os
import resource
import subprocess
import sys

from conftest import FIXTURES, events, oomscope_bin

CHILD = "import time; time.sleep(0.5); raise SystemExit(3)"


def meminfo_bytes(key):
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            if name == key:
                return int(value.split()[0]) * 1024
    raise KeyError(key)


def own_memory_cgroup():
    """(version, path) of this process's memory controller, as the agent
    picks it: a v1 hierarchy with `memory` if there is one, else the v2 line."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for hierarchy, controllers, path in lines:
        if hierarchy != "0" and "memory" in controllers.split(","):
            return "v1", path
    return "v2", next(path for hierarchy, _, path in lines if hierarchy == "0")


def test_timeline_returns_system_and_cgroup_readings_and_the_exit(collector):
    r = subprocess.run([oomscope_bin(), "run", "--collector", collector.url, "--name", "q-run",
                        "--interval", "50ms", "--", sys.executable, "-c", CHILD],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OOMSCOPE_AUTOSTART="0"))  # the supervisor's agent alone
    assert r.returncode == 3, r.stderr
    t = collector.timeline("q-run")

    hello = t["hello"]
    assert hello["command"] == [sys.executable, "-c", CHILD]
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    assert hello["rlimits"]["stack_bytes"] == (0 if stack == resource.RLIM_INFINITY else stack)
    [start] = events(t, "child_start")
    [exit_] = events(t, "child_exit")
    assert (exit_["pid"], exit_["exit_code"], exit_["signal"]) == (start["pid"], 3, None)
    assert exit_["core_dumped"] is False and exit_["crash_loop"] is False

    samples = t["samples"]
    assert len(samples) >= 2, samples
    mem_total, swap_total = meminfo_bytes("MemTotal"), meminfo_bytes("SwapTotal")
    with open("/proc/sys/vm/overcommit_memory") as f:
        overcommit = int(f.read())
    for counters in [start["counters"], exit_["after"]] + samples:
        system = counters["system"]
        assert (system["mem_total_bytes"], system["swap_total_bytes"]) == (mem_total, swap_total)
        assert 0 < system["mem_available_bytes"] <= mem_total
        assert system["overcommit_mode"] == overcommit
    child = [s for s in samples if s["process"] and s["process"]["pid"] == start["pid"]]
    assert child and all(s["process"]["vm_rss_bytes"] > 0 for s in child), samples

    version, path = own_memory_cgroup()
    assert (hello["cgroup"]["version"], hello["cgroup"]["path"]) == (version, path)
    for counters in [start["counters"], exit_["after"]] + samples:
        levels = counters["cgroup"]
        assert levels and levels[0]["path"] == path and {l["version"] for l in levels} == {version}
        # Own level first, then each ancestor.
        for inner, outer in zip(levels, levels[1:]):
            assert (os.path.dirname(inner["path"].rstrip("/")) or "/") == outer["path"], levels
        assert levels[0]["partial"] or levels[0]["usage_bytes"] > 0, levels[0]
        assert "swap_limit_bytes" in levels[0] and "pressure" in levels[0]

    [summary] = [a for a in collector.agents() if a["hello"]["name"] == "q-run"]
    assert summary["state"] == "disconnected"
    assert summary["samples"] == len(samples) and summary["events"] == len(t["events"])
    assert summary["last_seq"] >= max(x["seq"] for x in samples + t["events"])
    assert 0 < summary["first_seen_ns"] <= summary["last_seen_ns"]


def test_timeline_returns_the_gpu_facts_of_a_replayed_capture(collector):
    name = "other_process_shared.json"
    with open(os.path.join(FIXTURES, name)) as f:
        cap = json.load(f)
    notes = cap["notes"]
    collector.cli("replay", os.path.join(FIXTURES, name), "--name", "q-gpu")
    t = collector.timeline("q-gpu")

    [gpu] = t["hello"]["gpus"]
    assert gpu == {"index": 0, "uuid": "", "name": notes["device_name"],
                   "total_bytes": notes["total_memory"], "cap_bytes": 0,
                   "pci_bus_id": "", "ordinal": gpu["ordinal"], "parent_uuid": ""}
    assert gpu["ordinal"] in (None, 0)
    [procs] = events(t, "process_list")
    assert procs["host_top_rss"] == []
    # A capture's pids are compared by number (view "unspecified") and its
    # list names no device uuid.
    assert procs["gpu"] == [{"device": 0, "pid": p["pid"], "user": "", "command": "", "cgroup": "",
                             "used_bytes": p["usedGpuMemory"], "view": "unspecified", "device_uuid": ""}
                            for p in notes["nvml_procs_at_failure"]]
    readings = [e["mem_get_info"] for e in cap["timeline"]] + [cap["final"]["mem_get_info"]]
    assert [(s["allocator"][0]["driver_free_bytes"], s["allocator"][0]["driver_total_bytes"])
            for s in t["samples"]] == [(m["free"], m["total"]) for m in readings]
    assert all(s["gpus"] == [] for s in t["samples"])  # NVML's per-sample readings: none in a capture
