"""Why a census lists gc's oldest generation in one call (issue #17): that
call is the longest GIL hold left, and the one alternative with public APIs,
a walk of what is reachable from the modules and the threads' frames in
bounded slices, was measured here and rejected. It misses what only C code
holds (static types' descriptors, weak references, torch's registrations)
and every cycle awaiting the collector, which the gc_retained verdict reads,
and it costs several times the listing's GIL time.

    .venv/bin/python agent-python/bench/listing_vs_walk.py [--rounds 3]

Prints, per round: the listing's time and count, the walk's total and
longest slice, what it reached and what it missed by type. The walk runs
first in each round, so no listing is alive to make everything reachable.
"""

import argparse
import collections
import gc
import sys
import time

import torch

SLICE_S = 0.010
BATCH = 256


class Node:
    pass


def plant_garbage(pairs):
    """Reference cycles that reach the oldest generation alive, then die."""
    keep = []
    for _ in range(pairs):
        a, b = Node(), Node()
        a.b, b.a = b, a
        keep.append(a)
    gc.collect()
    keep.clear()


def walk():
    """Ids of the old objects reachable from the roots, and the timings."""
    start = time.perf_counter()
    young = gc.get_objects(generation=0) + gc.get_objects(generation=1)
    seen = {id(o) for o in young}
    roots = [sys.modules]
    for frame in sys._current_frames().values():
        while frame is not None:
            roots.append(frame)
            frame = frame.f_back
    stack = young + roots
    old = {id(r) for r in roots if gc.is_tracked(r)}
    seen |= old
    longest, slice_start = 0.0, time.perf_counter()
    while stack:
        batch = stack[-BATCH:]
        del stack[-BATCH:]
        for r in gc.get_referents(*batch):
            if gc.is_tracked(r) and id(r) not in seen:
                seen.add(id(r))
                old.add(id(r))
                stack.append(r)
        now = time.perf_counter()
        if now - slice_start >= SLICE_S:
            longest = max(longest, now - slice_start)
            time.sleep(0)
            slice_start = time.perf_counter()
    del young, stack
    return old, time.perf_counter() - start, longest


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each a walk then a listing")
    ap.add_argument("--garbage", type=int, default=2000, help="cycles (pairs of objects) left in generation 2")
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    for n in range(args.rounds):
        plant_garbage(args.garbage)
        reached, walk_s, longest = walk()
        start = time.perf_counter()
        listed = gc.get_objects(generation=2)
        list_s = time.perf_counter() - start
        missed = collections.Counter(type(o).__name__ for o in listed if id(o) not in reached)
        print(
            f"round {n + 1}: listing {len(listed)} objects in {list_s * 1e3:.1f} ms "
            f"({list_s / len(listed) * 1e9:.0f} ns an object); walk {walk_s * 1e3:.1f} ms "
            f"({walk_s / list_s:.0f}x), longest slice {longest * 1e3:.1f} ms, "
            f"reached {len(reached) / len(listed):.1%} of the listing"
        )
        print(f"  missed: {sum(missed.values())}, of which {missed['Node']} planted garbage; "
              + ", ".join(f"{t} {c}" for t, c in missed.most_common(8)))
        del listed, reached, missed
        gc.collect()


if __name__ == "__main__":
    main()
