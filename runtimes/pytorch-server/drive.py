"""Drives the reference server: N requests, C at a time; prints a JSON line
with the status counts and latency percentiles.

    python drive.py --port 8000 --requests 40 --concurrency 1 --prompt 16 --max-tokens 8
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time


def post(port, path, body, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def percentile(values, q):
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def drive(port, requests, concurrency=1, prompt=16, max_tokens=8, prefix="r", keep=False, pause_s=0.0):
    """With keep, the result also holds every successful request's latency;
    pause_s is each client's pause after each of its requests."""
    lock = threading.Lock()
    todo = list(range(requests))
    statuses, latencies, errors = {}, [], []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            t0 = time.perf_counter()
            status, body = post(port, "/generate", {"id": "%s-%d" % (prefix, i), "prompt_tokens": prompt,
                                                    "max_tokens": max_tokens})
            dt = (time.perf_counter() - t0) * 1e3
            if pause_s:
                time.sleep(pause_s)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    latencies.append(dt)
                else:
                    errors.append(body.get("error", ""))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"statuses": statuses, "p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99),
           "mean_ms": statistics.fmean(latencies) if latencies else None, "errors": errors[:3]}
    if keep:
        out["latencies_ms"] = latencies
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prefix", default="r")
    a = p.parse_args()
    print(json.dumps(drive(a.port, a.requests, a.concurrency, a.prompt, a.max_tokens, a.prefix)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
