"""The side-by-side loop of issue #17: one process per mode (plain, memray if
installed, tracemalloc, the oomscope agent), the same short requests in a
loop (a 32x256 matmul and a dict of 50 small lists each, torch imported).

For each mode: wall time, p50 and p99 of a request, and the longest wait a
second Python thread saw for the GIL (a ticker sleeping 1 ms; in plain mode
that is the interpreter's own switch interval). In oomscope mode also the
agent's own CPU per request, from /proc/self/task/*/stat of its threads
(named oomscope-*), and the censuses it ran.

    .venv/bin/python agent-python/bench/overhead.py [--requests 3000] [--collector URL]
        [--modes plain,oomscope] [--rounds 15] [--think-ms 5]

--think-ms sleeps that long between requests (every mode alike): a paced
service, whose requests' boundaries do not coalesce as a tight loop's do.

With --rounds the modes run in turn that many times and the table gives
each mode's median and minimum wall time against plain's.

Without --collector the agent reports to a port nothing listens on (it keeps
its samples in memory): the cost measured is the agent's, not a collector's.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from statistics import median

MODES = ("plain", "memray", "tracemalloc", "oomscope")


def agent_cpu_s():
    """CPU seconds (user + system) of this process's oomscope-* threads."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/stat" % tid) as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if name.startswith("oomscope-"):
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


class Ticker(threading.Thread):
    """The longest gap between wake-ups of a thread sleeping 1 ms: how long
    it waited for the GIL at worst."""

    def __init__(self):
        super().__init__(daemon=True)
        self.longest = 0.0
        self.running = True

    def run(self):
        last = time.perf_counter()
        while self.running:
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last - 0.001)
            last = now


def one_mode(mode, requests, collector, think_s=0.0):
    import torch
    w = torch.randn(256, 256)
    ctx = None
    if mode == "memray":
        import memray
        path = "/tmp/oomscope-bench-%d.memray" % os.getpid()
        ctx = memray.Tracker(path)
        ctx.__enter__()
    elif mode == "tracemalloc":
        import tracemalloc
        tracemalloc.start(1)
    elif mode == "oomscope":
        import oomscope
        oomscope.start(collector=collector, name="bench-overhead")
    request = None
    if mode == "oomscope":
        import oomscope
        request = oomscope.request
    ticker = Ticker()
    ticker.start()
    cpu0 = agent_cpu_s()
    # Preallocated: a list growing by a float a request is itself a leak,
    # which the agent would rightly census.
    times = [0.0] * requests
    t0 = time.perf_counter()
    for i in range(requests):
        s = time.perf_counter()
        if request is not None:
            with request(id="r%d" % i):
                torch.randn(32, 256) @ w
                {k: [k, k + 1, k + 2] for k in range(50)}
        else:
            torch.randn(32, 256) @ w
            {k: [k, k + 1, k + 2] for k in range(50)}
        times[i] = time.perf_counter() - s
        if think_s:
            time.sleep(think_s)
    wall = time.perf_counter() - t0
    cpu = agent_cpu_s() - cpu0
    ticker.running = False
    ticker.join()
    out = {"mode": mode, "requests": requests, "wall_s": wall,
           "p50_us": 1e6 * sorted(times)[len(times) // 2],
           "p99_us": 1e6 * sorted(times)[int(len(times) * 0.99)],
           "longest_gil_wait_ms": 1e3 * ticker.longest}
    if mode == "oomscope":
        import oomscope
        out["agent_cpu_ms_per_request"] = 1e3 * cpu / requests
        st = oomscope.stats() or {}
        out["agent_stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
        oomscope.stop()
    if ctx is not None:
        ctx.__exit__(None, None, None)
        os.unlink(path)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per mode")
    p.add_argument("--collector", default="http://127.0.0.1:9",
                   help="where the agent reports (default: a closed port)")
    p.add_argument("--mode", choices=MODES, help="run one mode in this process (internal)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="the modes to compare, comma-separated (default: all four)")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="sleep this long between requests, in every mode (default: a tight loop)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every mode this many times, alternating, and report medians and "
                        "minimums: on a shared machine one run each swings by 1.5x")
    a = p.parse_args()
    if a.mode:
        print(json.dumps(one_mode(a.mode, a.requests, a.collector, a.think_ms / 1e3)))
        return
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error("unknown mode(s) %s; choose from %s" % (", ".join(unknown), ", ".join(MODES)))
    runs = {m: [] for m in modes}
    for _ in range(max(1, a.rounds)):
        for mode in modes:
            env = dict(os.environ, OOMSCOPE_AUTOSTART="0")
            env.pop("OOMSCOPE_COLLECTOR", None)
            r = subprocess.run([sys.executable, __file__, "--mode", mode, "--requests",
                                str(a.requests), "--collector", a.collector,
                                "--think-ms", str(a.think_ms)],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0:
                print("%-12s skipped: %s" % (mode, (r.stderr.strip().splitlines() or ["?"])[-1]))
                continue
            runs[mode].append(json.loads(r.stdout.strip().splitlines()[-1]))
    plain = runs.get("plain") or []
    print("%-12s %4s %9s %9s %7s %7s %8s %8s %12s %14s" % (
        "mode", "runs", "wall s", "min s", "x plain", "x min", "p50 us", "p99 us",
        "GIL wait ms", "agent ms/req"))
    for mode, rs in runs.items():
        if not rs:
            continue
        wall = median([r["wall_s"] for r in rs])
        best = min(r["wall_s"] for r in rs)
        ratio = wall / median([r["wall_s"] for r in plain]) if plain else float("nan")
        ratio_min = best / min(r["wall_s"] for r in plain) if plain else float("nan")
        cpu = [r["agent_cpu_ms_per_request"] for r in rs if "agent_cpu_ms_per_request" in r]
        print("%-12s %4d %9.3f %9.3f %7.2f %7.2f %8.0f %8.0f %12.1f %14s" % (
            mode, len(rs), wall, best, ratio, ratio_min, median([r["p50_us"] for r in rs]),
            median([r["p99_us"] for r in rs]), max(r["longest_gil_wait_ms"] for r in rs),
            "%.4f" % median(cpu) if cpu else "-"))


if __name__ == "__main__":
    main()
