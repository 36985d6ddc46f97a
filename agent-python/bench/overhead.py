"""The side-by-side loop of issue #17: one process per mode (plain, memray if
installed, tracemalloc, the oomscope agent), the same short requests in a
loop (a 32x256 matmul and a dict of 50 small lists each, torch imported).

For each mode: wall time, p50 and p99 of a request, and the longest wait a
second Python thread saw for the GIL (a ticker sleeping 1 ms; in plain mode
that is the interpreter's own switch interval). In oomscope mode also the
agent's own CPU per request, from /proc/self/task/*/stat of its threads
(named oomscope-*), and the censuses it ran.

    .venv/bin/python agent-python/bench/overhead.py [--requests 3000] [--collector URL]

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


def one_mode(mode, requests, collector):
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
    a = p.parse_args()
    if a.mode:
        print(json.dumps(one_mode(a.mode, a.requests, a.collector)))
        return
    rows = []
    for mode in MODES:
        env = dict(os.environ, OOMSCOPE_AUTOSTART="0")
        env.pop("OOMSCOPE_COLLECTOR", None)
        r = subprocess.run([sys.executable, __file__, "--mode", mode, "--requests", str(a.requests),
                            "--collector", a.collector], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print("%-12s skipped: %s" % (mode, (r.stderr.strip().splitlines() or ["?"])[-1]))
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    plain = next((r for r in rows if r["mode"] == "plain"), None)
    print("%-12s %9s %7s %8s %8s %12s %14s" % ("mode", "wall s", "x plain", "p50 us", "p99 us",
                                              "GIL wait ms", "agent ms/req"))
    for r in rows:
        ratio = r["wall_s"] / plain["wall_s"] if plain else float("nan")
        print("%-12s %9.3f %7.2f %8.0f %8.0f %12.1f %14s" % (
            r["mode"], r["wall_s"], ratio, r["p50_us"], r["p99_us"], r["longest_gil_wait_ms"],
            "%.4f" % r["agent_cpu_ms_per_request"] if "agent_cpu_ms_per_request" in r else "-"))


if __name__ == "__main__":
    main()
