"""A census's cost in a process that froze its start-up heap, as vLLM's API
server does (`gc.freeze()` after start-up): import a server's modules, freeze,
then census a few times while a module-level list keeps 256 KiB a request.
Prints each census's objects, its CPU time and the referrer chain.

    .venv-vllm/bin/python agent-python/bench/frozen_census.py \\
        [--module vllm.entrypoints.openai.api_server] [--censuses 5]
"""

import argparse
import gc
import importlib
import sys
import time

KEPT = []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", default="vllm.entrypoints.openai.api_server",
                    help="the server module whose import makes the start-up heap")
    ap.add_argument("--censuses", type=int, default=5)
    ap.add_argument("--requests-between", type=int, default=10,
                    help="requests (each keeping 256 KiB) between censuses")
    a = ap.parse_args()
    t = time.perf_counter()
    importlib.import_module(a.module)
    import oomscope
    print("imported %s in %.1f s; %d modules" % (a.module, time.perf_counter() - t, len(sys.modules)))
    oomscope.start(collector=None, name="bench-frozen-census", census_auto=False, census_every=0)
    gc.collect()
    gc.freeze()
    modules = len(sys.modules)
    print("frozen objects: %d" % gc.get_freeze_count())
    done = 0
    for i in range(a.censuses):
        for _ in range(a.requests_between):
            with oomscope.request(id=str(done)):
                KEPT.append((object(), bytes(256 * 1024)))
            done += 1
        cpu = time.thread_time()
        c = oomscope.census(budget_s=10)
        cpu = time.thread_time() - cpu
        print("census %d: %d objects, %.1f ms CPU, %.1f ms held (longest slice %.1f ms); chain %s" % (
            i + 1, c["objects_scanned"], cpu * 1e3, c["duration_ns"] / 1e6,
            c["longest_hold_ns"] / 1e6, " -> ".join(c["referrer_chain"]) or "-"))
    if len(sys.modules) != modules:
        print("the censuses imported %d modules" % (len(sys.modules) - modules))
        sys.exit(1)


if __name__ == "__main__":
    main()
