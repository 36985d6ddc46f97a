"""Boundary messages per second and the agent's CPU per request (#33), at a
paced rate (5 ms think time, ~180 requests/s) and in a tight loop: short
torch requests marked with `oomscope.request`, the messages counted from the
collector's acks (`stats()["acked"]`), the CPU from the agent's own threads
(oomscope-*, /proc/self/task/*/stat; see overhead.py).

    oomscope collector --listen 127.0.0.1:50551 --db /tmp/bench.db &
    .venv/bin/python agent-python/bench/boundary_rate.py --collector http://127.0.0.1:50551 \\
        [--requests 3000] [--think-ms 5,0] [--no-census]
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from overhead import agent_cpu_s  # noqa: E402


def one(collector, requests, think_s, census_auto):
    import torch
    import oomscope
    oomscope.start(collector=collector, name="bench-boundary-rate", census_auto=census_auto)
    w = torch.randn(64, 64)
    # Warm-up (the agent's first samples, baselines) is not the steady state.
    for i in range(200):
        with oomscope.request(id="w%d" % i):
            torch.randn(8, 64) @ w
    oomscope.flush(10)
    acked0, cpu0, t0 = oomscope.stats()["acked"], agent_cpu_s(), time.perf_counter()
    for i in range(requests):
        with oomscope.request(id="r%d" % i, prompt_tokens=4, max_tokens=2) as r:
            torch.randn(8, 64) @ w
            r.output_tokens = 2
        if think_s:
            time.sleep(think_s)
    oomscope.flush(10)
    wall = time.perf_counter() - t0
    st = oomscope.stats()
    out = {"think_ms": 1e3 * think_s, "requests": requests, "wall_s": round(wall, 2),
           "requests_per_s": round(requests / wall), "messages": st["acked"] - acked0,
           "messages_per_s": round((st["acked"] - acked0) / wall, 1),
           "agent_cpu_ms_per_request": round(1e3 * (agent_cpu_s() - cpu0) / requests, 4),
           "boundary_dropped": st["boundary_dropped"], "censuses": st.get("censuses"),
           "census_reasons": st.get("census_reasons"),
           "census_longest_hold_ms": st.get("census_longest_hold_ms")}
    oomscope.stop()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collector", required=True, help="a running collector's URL")
    p.add_argument("--requests", type=int, default=3000, help="requests per run")
    p.add_argument("--think-ms", default="5,0", help="think times to run, comma-separated")
    p.add_argument("--no-census", action="store_true",
                   help="census_auto=False: the boundary path's cost alone, without censuses")
    p.add_argument("--one", type=float, help="run one think time in this process (internal)")
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.collector, a.requests, a.one / 1e3, not a.no_census)))
        return
    for think in a.think_ms.split(","):
        r = subprocess.run([sys.executable, __file__, "--collector", a.collector, "--requests",
                            str(a.requests), "--one", think] + ["--no-census"] * a.no_census,
                           capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "OOMSCOPE_COLLECTOR"})
        print(r.stdout.strip() or r.stderr[-2000:])


if __name__ == "__main__":
    main()
