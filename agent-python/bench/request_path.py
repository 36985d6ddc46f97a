"""What marking a request costs, measured inside one process: the loop of
overhead.py (a 32x256 matmul and a dict of 50 small lists, torch imported),
with requests in turn unmarked, marked by the native calls alone, and marked
by ``with oomscope.request(...)`` (with and without an id to format). One
process and interleaved arms, so the machine's drift between runs, which is
larger than the effect on a shared VM, falls on every arm alike.

    .venv/bin/python agent-python/bench/request_path.py [--requests 12000] [--rounds 3]

Prints each arm's p50 and p90 and the p50 against the unmarked arm's.
"""

import argparse
import time

ARMS = ("unmarked", "native calls", "request(id=...)", "request()")


def one_round(requests):
    import torch
    import oomscope
    from oomscope import _native

    w = torch.randn(256, 256)

    def body():
        torch.randn(32, 256) @ w
        {k: [k, k + 1, k + 2] for k in range(50)}

    times = {arm: [] for arm in ARMS}
    for i in range(requests):
        arm = ARMS[i % len(ARMS)]
        start = time.perf_counter()
        if arm == "unmarked":
            body()
        elif arm == "native calls":
            _native.request_begin("r", 0, 0)
            body()
            _native.request_end("r", 0, "")
        elif arm == "request(id=...)":
            with oomscope.request(id="r%d" % i):
                body()
        else:
            with oomscope.request():
                body()
        times[arm].append(time.perf_counter() - start)
    return times


def quantile(values, q):
    return sorted(values)[int(len(values) * q)] * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12000, help="requests per round, all arms")
    p.add_argument("--rounds", type=int, default=3, help="rounds, one line each")
    a = p.parse_args()
    import oomscope
    # A closed port: the agent keeps its samples; its own cost is measured.
    oomscope.start(collector="http://127.0.0.1:9", name="bench-request-path")
    print("%-18s %10s %10s %10s" % ("arm", "p50 us", "p90 us", "x p50"))
    for r in range(a.rounds):
        times = one_round(a.requests)
        base = quantile(times["unmarked"], 0.5)
        for arm in ARMS:
            p50 = quantile(times[arm], 0.5)
            print("%-18s %10.1f %10.1f %10.3f" % (arm, p50, quantile(times[arm], 0.9), p50 / base))
        if r + 1 < a.rounds:
            print()
    oomscope.stop()


if __name__ == "__main__":
    main()
