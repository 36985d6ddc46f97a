"""Censuses under real request pacing (issue #33): a leak at over 30
requests/s is named with its type, its bytes per request and its holder
within 100 requests, for three shapes (tensors in a list, a dict of `bytes`,
lists of small dicts); a clean loop with think time runs the two baselines
and nothing else, and stats() says why each census ran. A real collector,
a real torch service (tests/programs/leak_shapes.py), read back through
`oomscope diagnose --agent NAME --json`."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import wait_for
from test_slow_leak import end

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "leak_shapes.py")
GROWTH_CAUSES = ("leak", "host_growth", "slow_growth")
#: Two float32 tensors of 64 x 1100 a request (leak_shapes.TENSOR_BYTES).
TENSOR_BYTES = 2 * 64 * 1100 * 4
#: One 200 KiB payload a request (leak_shapes.PAYLOAD_BYTES).
PAYLOAD_BYTES = 200 * 1024
#: The census's bytes per request against what the program kept: its
#: censuses are exact, but a census may catch a request's temporaries.
TOLERANCE = 0.10


def run(collector, tmp_path, name, shape, requests, *pacing):
    """Starts the service and waits for its last request; returns the
    process (the caller ends it) and its "done" report."""
    env = dict(os.environ, OOMSCOPE_AUTOSTART="0")
    env.pop("OOMSCOPE_COLLECTOR", None)
    log = open(str(tmp_path / ("%s.log" % name)), "w")
    proc = subprocess.Popen(
        [sys.executable, PROGRAM, "--collector", collector.url, "--name", name, "--shape", shape,
         "--requests", str(requests), *pacing],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    line = proc.stdout.readline()
    assert line.startswith("done "), "the service failed: %s" % open(log.name).read()
    return proc, json.loads(line[len("done "):])


# (shape, the type named, the global that holds it)
SHAPES = [
    ("tensors", "torch.Tensor[cpu]", "module __main__ global keep"),
    ("bytes", "bytes", "module __main__ global payloads"),
    ("objects", "dict", "module __main__ global keep"),
]


@pytest.mark.parametrize("shape,type_name,holder", SHAPES, ids=[s[0] for s in SHAPES])
def test_the_leaking_type_is_named_within_100_requests(collector, tmp_path, shape, type_name, holder):
    name = "leak-" + shape
    # Over 30 requests/s, each request starting at its slot (33/s: a loaded
    # 2-core machine keeps to it; the service ran at 36/s).
    proc, done = run(collector, tmp_path, name, shape, 100, "--rate", "33")
    try:
        def named():
            d = collector.cli("diagnose", "--agent", name, "--json", check=False)
            for c in d.get("causes", []):
                if c["kind"] in ("leak", "host_growth") and "retained_type_bytes_per_request" in c["metrics"]:
                    return c
            return None
        found = wait_for(named, timeout=60, every=1.0)
    finally:
        end(proc)
    assert found, "no verdict named a type after 100 requests (%.1f requests/s): %s" % (
        done["rate"], collector.cli("diagnose", "--agent", name, "--json", check=False))
    assert done["rate"] >= 30, "the service ran at %.1f requests/s, under the 30 this test is for" % done["rate"]
    text = "\n".join(found["evidence"])
    planted = {"tensors": TENSOR_BYTES, "bytes": PAYLOAD_BYTES, "objects": done["dict_bytes"]}[shape]
    got = found["metrics"]["retained_type_bytes_per_request"]
    assert type_name + " " in text or type_name + "\n" in text, text
    assert abs(got - planted) <= TOLERANCE * planted, (got, planted, text)
    # The holder: the module global, never a frame or a traceback.
    held = next(l for l in found["evidence"] if "held by " in l)
    assert "held by " + holder in held, held
    assert "frame" not in held and "traceback" not in held, held


def test_a_clean_loop_with_think_time_runs_the_baselines_only(collector, tmp_path):
    # The issue asks for 10 of 10 runs; three here (each ~10 s on a loaded
    # 2-core machine): BENCHMARKS.md has 10 runs of 3,000 requests. In 1,500
    # requests the baselines come within the first seconds (the second waits
    # the first's CPU over the 10 % duty cycle), then suspicion has seconds
    # to show.
    for run_no in range(3):
        name = "clean-%d" % run_no
        proc, done = run(collector, tmp_path, name, "clean", 1500, "--pace-ms", "5")
        try:
            d = collector.cli("diagnose", "--agent", name, "--json", check=False)
        finally:
            end(proc)
        st = done["stats"]
        # The baselines and nothing else: no suspicion, no interval census.
        # At ~160 requests/s the first census is due (0.9 s after the start)
        # past request 50, and stands for both baselines (suspicion.rs).
        reasons = [r["reason"] for r in st["census_recent"]]
        assert reasons in (["baseline"], ["baseline", "baseline"]), st
        assert st["census_reasons"] == {"baseline": len(reasons)} and st["censuses"] == len(reasons), st
        # Suspicion had its chance: most of the loop came after the baselines.
        assert st["census_recent"][-1]["requests_done"] < 1000, st
        assert 0 < st["census_longest_hold_ms"], st
        found = [c["kind"] for c in d.get("causes", []) if c["kind"] in GROWTH_CAUSES]
        assert not found, "run %d: %s" % (run_no, d)


SPAWNED = '''
import multiprocessing as mp
import sys

keep = []


def work(q):
    import oomscope
    oomscope.start(collector=sys.argv[1], name="spawned", census_every=0, census_auto=False)
    oomscope.census(budget_s=30)
    for i in range(20):
        with oomscope.request(id=str(i)):
            keep.append(bytes(100_000))
    q.put(oomscope.census(budget_s=30)["referrer_chain"])


if __name__ == "__main__":
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=work, args=(q,))
    p.start()
    print("CHAIN", " -> ".join(q.get(timeout=120)))
    p.join()
'''


def test_a_spawned_workers_script_is_named_by_its_file(collector, tmp_path):
    # multiprocessing's spawn runs the script in the worker as __mp_main__.
    script = tmp_path / "leaky_worker.py"
    script.write_text(SPAWNED)
    env = dict(os.environ, OOMSCOPE_AUTOSTART="0")
    env.pop("OOMSCOPE_COLLECTOR", None)
    r = subprocess.run([sys.executable, str(script), collector.url], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    chain = r.stdout.split("CHAIN ")[1].splitlines()[0]
    assert re.fullmatch(r"module leaky_worker\.py global keep -> list\[\d+\] \(20 items\) -> bytes", chain), chain
