"""A slow leak found within 100 requests, and a clean loop left alone: the
leaking service of issue #17 (tests/programs/leaky_service.py: a CPU torch
model, a global list keeping each request's input and output tensors, 256
KiB a request) under the Python agent with its default census settings
(censuses on suspicion), against a real collector, read back through
`oomscope diagnose --agent NAME --json`."""

import json
import os
import subprocess
import sys
import time

from conftest import events, wait_for

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "leaky_service.py")
#: x and y, 64 × 512 float32 each.
TENSOR_BYTES_PER_REQUEST = 2 * 64 * 512 * 4
GROWTH_CAUSES = ("leak", "host_growth", "slow_growth")


def run_service(collector, tmp_path, name, requests, *flags):
    """Starts the service, waits for its last request; the caller ends it.
    A generous census budget: a loaded CI machine scans the heap several
    times slower, and a census cut short is left out of the verdict."""
    env = dict(os.environ, OOMSCOPE_AUTOSTART="0", OOMSCOPE_CENSUS_BUDGET_S="10")
    env.pop("OOMSCOPE_COLLECTOR", None)
    log = open(str(tmp_path / ("%s.log" % name)), "w")
    proc = subprocess.Popen(
        [sys.executable, PROGRAM, "--collector", collector.url, "--name", name, "--requests", str(requests), *flags],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "done", "the service failed: %s" % open(log.name).read()
    return proc


def end(proc):
    proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cause(d, kind):
    return next((c for c in d["causes"] if c["kind"] == kind), None)


def host_limit():
    """MemTotal, the limit the runway runs to outside a limited cgroup."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def test_a_leak_of_256_kib_a_request_is_named_within_100_requests(collector, tmp_path):
    # Censuses on suspicion take at most 10 % of wall time: at 150 ms a
    # request, 100 requests leave room for a few even where a census takes
    # most of a second.
    proc = run_service(collector, tmp_path, "leaky", 100, "--pace-ms", "150")
    try:
        def leak():
            d = collector.cli("diagnose", "--agent", "leaky", "--json", check=False)
            return d if cause(d, "leak") else None
        d = wait_for(leak, timeout=60, every=1.0)
        tl = collector.timeline("leaky")
    finally:
        end(proc)
    censuses = events(tl, "heap_census")
    assert d, "no leak after 100 requests with %d censuses: %s" % (
        len(censuses), collector.cli("diagnose", "--agent", "leaky", "--json", check=False))
    assert d["domain"] is None, "nothing failed"
    leak = cause(d, "leak")
    m = leak["metrics"]
    text = "\n".join(leak["evidence"])
    # The retaining type and its exact bytes: two 128 KiB tensors a request.
    assert "torch.Tensor[cpu]" in text, text
    assert abs(m["retained_type_bytes_per_request"] - TENSOR_BYTES_PER_REQUEST) <= 0.05 * TENSOR_BYTES_PER_REQUEST, m
    assert 0.9 <= m["retained_objects_per_request"] <= 2.1, m
    # Who holds them: the global list, down to the tensor.
    assert "module __main__ global history" in text and "torch.Tensor[cpu] torch.Size([64, 512])" in text, text
    # Within 100 requests, from censuses taken on suspicion.
    assert m["requests_seen"] <= 100, m
    assert 3 <= len(censuses), len(censuses)
    # The runway, first, in human terms, and its numbers.
    assert leak["evidence"][0].startswith("runway: at "), leak["evidence"]
    assert "requests/s while serving" in leak["evidence"][0], leak["evidence"]
    assert d["evidence"][0] == leak["evidence"][0], d["evidence"]
    limit = m["limit_bytes"]
    assert limit == host_limit() or "the cgroup limit" in leak["evidence"][0], (limit, leak["evidence"][0])
    rss = [s["process"]["vm_rss_bytes"] for s in tl["samples"] if (s.get("process") or {}).get("vm_rss_bytes")]
    left = m["requests_to_limit"]
    # (limit - RSS) / growth: RSS moved a few MiB between the reading used and these.
    assert abs(left - (limit - rss[-1]) / m["bytes_per_request"]) <= 0.01 * left, (left, rss[-1], m)
    assert abs(m["seconds_to_limit"] - left / m["requests_per_s"]) <= 1e-6 * m["seconds_to_limit"], m


def test_the_same_loop_clearing_its_list_reports_nothing(collector, tmp_path):
    # 10 of 10 runs, as the issue asks: noise must never read as growth.
    for run in range(10):
        name = "clean-%d" % run
        proc = run_service(collector, tmp_path, name, 400, "--clear", "--pace-ms", "2")
        try:
            # Give owed censuses their time, then read the verdict.
            time.sleep(3)
            d = collector.cli("diagnose", "--agent", name, "--json", check=False)
        finally:
            end(proc)
        # No growth at all: the RSS a clean loop gains while it warms up
        # (and keeps from its first census) settles; what it still creeps
        # later is many times slower, which the analysis calls settling.
        found = [c["kind"] for c in d.get("causes", []) if c["kind"] in GROWTH_CAUSES]
        assert not found, "run %d: %s" % (run, d)


FOOTPRINT = os.path.join(os.path.dirname(__file__), "programs", "census_footprint.py")
MIB = 1 << 20


def footprint(collector, name, **env):
    """Runs programs/census_footprint.py (six censuses, 20 requests apart)."""
    env = dict(os.environ, OOMSCOPE_AUTOSTART="0", **env)
    env.pop("OOMSCOPE_COLLECTOR", None)
    out = subprocess.run(
        [sys.executable, FOOTPRINT, "--collector", collector.url, "--name", name],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_census_leaves_nothing_resident_that_reads_as_the_servers(collector):
    # The control: without the trim, what censuses free stays resident
    # (glibc keeps it) and the server's RSS steps up after the censuses. It
    # swings from census to census (+1.5 to +8.9 MiB in one run), so the
    # control reads its highest step, not wherever the last census left it.
    kept = footprint(collector, "untrimmed", OOMSCOPE_CENSUS_TRIM="0")
    rise = max(rss for rss, _ in kept["server_after_each"]) - kept["server_before"]
    assert rise >= 2 * MIB, "no step to remove without the trim: %s" % json.dumps(kept)
    f = footprint(collector, "trimmed")
    # What the censuses freed is given back: the server's own RSS does not
    # step up, after the last census nor after any before it. It may step
    # down: the first trim also gives back what the server's warm-up freed
    # and glibc kept (CI saw -1.07 MiB). (Messages as strings: pytest cuts a
    # long dict's repr.)
    rise = max([f["server_after"]] + [rss for rss, _ in f["server_after_each"]]) - f["server_before"]
    assert rise < 1 * MIB, json.dumps(f)
    # What they keep (the table of the last census's addresses, 8 bytes an
    # object or more) is counted as the agent's heap...
    scanned = f["objects_scanned"][-1]
    assert scanned > 10000, f
    assert f["heap_after"] - f["heap_before"] >= 8 * scanned, f
    # ...and reaches the collector with every sample of this process.
    heaps = [s["process"]["agent_heap_bytes"] for s in collector.timeline("trimmed")["samples"]
             if (s.get("process") or {}).get("agent_heap_bytes")]
    assert heaps and max(heaps) >= 8 * min(f["objects_scanned"]), (heaps[-5:], f)
