"""What a heap census costs with every object sized against counting alone
(issue #33): torch imported, ~150k objects, the three leak shapes of
tests/programs/leak_shapes.py (one, --shape) kept in module globals. Censuses alternate
between the two kinds the agent runs: a baseline's (every type sized) and a
suspicion's (every type counted, only the growers and tensors, arrays,
buffers sized), each after a few leaking requests.

    .venv/bin/python agent-python/bench/census_sizing.py [--rounds 7] [--shape bytes]

Prints each census's held GIL time, its thread's CPU time and that CPU by
phase (`stats()["census_last_cpu_ms"]`: the walk, which counts and sizes
what is sized as counted; the growers sized after it; the growth and the
referrer chain), then the medians.
"""

import argparse
import gc
import statistics
import sys
import time

import torch

import oomscope

keep = []
payloads = {}


def leak(shape, i):
    """What a request keeps: tests/programs/leak_shapes.py's shapes."""
    if shape == "tensors":
        keep.append([torch.randn(64, 1100), torch.randn(64, 1100)])
    elif shape == "bytes":
        payloads["request-%d" % i] = bytes(200 * 1024)
    elif shape == "objects":
        keep.append([{"id": "r%d-%d" % (i, j), "text": "token %d of request %d" % (j, i)} for j in range(300)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests-between", type=int, default=10)
    ap.add_argument("--shape", choices=("tensors", "bytes", "objects"), default="bytes",
                    help="what each request keeps (leak_shapes.py's shapes)")
    a = ap.parse_args()
    oomscope.start(collector=None, name="bench-census-sizing", census_auto=False, census_every=0)
    done = 0
    held = {"all": [], "growers": []}
    cpu = {"all": [], "growers": []}
    phases = {"all": [], "growers": []}
    for r in range(a.rounds):
        for sizing in ("all", "growers"):
            for _ in range(a.requests_between):
                with oomscope.request(id=str(done)):
                    leak(a.shape, done)
                done += 1
            gc.collect()
            t = time.thread_time()
            c = oomscope.census(budget_s=10, sizing=sizing)
            t = time.thread_time() - t
            held[sizing].append(c["duration_ns"] / 1e6)
            cpu[sizing].append(t * 1e3)
            p = oomscope.stats()["census_last_cpu_ms"]
            phases[sizing].append((p["walk"], p["size_growers"], p["chain"]))
            print("round %d %-7s: %6d objects, %6.1f ms held, %6.1f ms CPU (walk %.1f, growers sized after %.1f,"
                  " chain %.1f); %d types, %d estimated" % (
                      r, sizing, c["objects_scanned"], held[sizing][-1], cpu[sizing][-1], *phases[sizing][-1],
                      len(c["types"]), sum(1 for x in c["types"] if x.get("bytes_estimated"))))
    print("shape %s; gc objects: %d, torch %s, python %s" % (
        a.shape, len(gc.get_objects()), torch.__version__, sys.version.split()[0]))
    for sizing in ("all", "growers"):
        walk, after, chain = (statistics.median(x) for x in zip(*phases[sizing]))
        print("median %-7s: %.1f ms held, %.1f ms CPU (walk %.1f, growers sized after %.1f, chain %.1f)" % (
            sizing, statistics.median(held[sizing]), statistics.median(cpu[sizing]), walk, after, chain))


if __name__ == "__main__":
    main()
