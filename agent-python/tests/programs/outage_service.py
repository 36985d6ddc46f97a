"""A service that keeps serving through a collector outage (test_outage.py).

Talks to the test one line at a time. Prints {"up": ...} once its warm-up
requests are acked; on "down" (the test stopped the collector) waits until
the agent sees it gone, serves --requests requests, and prints what the
outage cost (times, RSS, the agent's largest buffer, its stats); on "back"
(the collector is up again) flushes and prints {"flushed": ..., "stats": ...}.
With --calibrate it serves its requests against a collector that never
answers and prints how many buffered bytes a second that pace makes.
"""

import argparse
import json
import os
import sys
import time

import oomscope


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def say(**kw):
    print(json.dumps(kw), flush=True)


def serve(n, pace_s, probe):
    """n small requests, `pace_s` apart; `probe` every 100 requests."""
    for i in range(n):
        with oomscope.request(id="r%d" % i, prompt_tokens=16, max_tokens=16) as r:
            r.output_tokens = len(str(sum(range(300))))
        time.sleep(pace_s)
        if i % 100 == 0:
            probe()


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--collector", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--pace-ms", type=float, default=3.0)
    p.add_argument("--buffer-max-bytes", type=int)
    p.add_argument("--spool-dir")
    p.add_argument("--spool-max-bytes", type=int)
    p.add_argument("--calibrate", action="store_true")
    a = p.parse_args()
    settings = dict(collector=a.collector, name=a.name)
    for key in ("buffer_max_bytes", "spool_dir", "spool_max_bytes"):
        if getattr(a, key) is not None:
            settings[key] = getattr(a, key)
    oomscope.start(**settings)
    pace = a.pace_ms / 1000

    if a.calibrate:
        t0 = time.monotonic()
        serve(a.requests, pace, lambda: None)
        elapsed = time.monotonic() - t0
        say(bytes_per_s=oomscope.stats()["buffered_bytes"] / elapsed, seconds=elapsed)
        return

    serve(100, pace, lambda: None)
    say(up=oomscope.flush(30.0), stats=oomscope.stats())
    assert sys.stdin.readline().strip() == "down"
    gone = wait_until(lambda: not oomscope.stats()["connected"], 30)
    largest = [0]

    def probe():
        largest[0] = max(largest[0], oomscope.stats()["buffered_bytes"])

    t_down, rss_down = time.time_ns(), rss()
    serve(a.requests, pace, probe)
    probe()
    say(gone=gone, t_down_ns=t_down, t_end_ns=time.time_ns(), rss_down=rss_down, rss_end=rss(),
        largest_buffer=largest[0], stats=oomscope.stats())
    assert sys.stdin.readline().strip() == "back"
    say(flushed=oomscope.flush(120.0), stats=oomscope.stats())
    oomscope.stop()


if __name__ == "__main__":
    main()
