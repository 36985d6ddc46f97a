"""The census's one uncut step against what the interpreter itself does with
the GIL held: one `gc.get_objects(generation=2)` pass and one full collection
(`gc.collect(2)`, which CPython runs whenever long-lived objects have grown by
a quarter), alternating, in a torch process. Prints medians of wall and
thread CPU time.

    .venv/bin/python agent-python/bench/collect_vs_list.py [ROUNDS]
"""

import gc
import sys
import time

import torch  # noqa: F401 (its ~160k objects are the heap measured)


def timed(fn):
    cpu, wall = time.thread_time(), time.perf_counter()
    result = fn()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3, result


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    collect, listing = [], []
    for _ in range(rounds):
        wall, cpu, _ = timed(lambda: gc.collect(2))
        collect.append((wall, cpu))
        wall, cpu, objects = timed(lambda: gc.get_objects(generation=2))
        listing.append((wall, cpu))
        count = len(objects)
        del objects
        time.sleep(0.05)

    def median(rows, i):
        return sorted(r[i] for r in rows)[len(rows) // 2]

    for name, rows in (("gc.collect(2)", collect), ("gc.get_objects(generation=2)", listing)):
        print("%s: wall %.1f ms, CPU %.1f ms (medians of %d; wall %.1f-%.1f)" % (
            name, median(rows, 0), median(rows, 1), rounds,
            min(r[0] for r in rows), max(r[0] for r in rows)))
    print("%d objects in generation 2; listing / collection (CPU medians): %.2f" % (
        count, median(listing, 1) / median(collect, 1)))


if __name__ == "__main__":
    main()
