"""A CPU torch loop that takes heap censuses between its requests, and
prints what each left resident: RSS without the agent's own heap (the
server's), and the agent's heap, before the first census and after the
last. One JSON line on stdout.
"""

import argparse
import json

import torch

import oomscope


def status(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss():
    return status()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--collector", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--censuses", type=int, default=6)
    a = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    # No censuses but ours, and no periodic sample between them.
    oomscope.start(collector=a.collector, name=a.name, census_auto=False, interval_s=3600)

    def serve(n):
        for i in range(n):
            with oomscope.request(id="r%d" % i, prompt_tokens=64):
                with torch.no_grad():
                    model(torch.randn(64, 512))

    def heap():
        return oomscope._native.stats()["agent_heap_bytes"]

    serve(50)
    heap_before = heap()
    server_before = rss() - heap_before
    scanned = []
    # The server's RSS after each census (and its anonymous part), for a
    # failure's message: a step at one census, or a creep over all.
    steps = []
    for _ in range(a.censuses):
        scanned.append(oomscope.census(10.0)["objects_scanned"])
        serve(20)
        steps.append((rss() - heap(), status("RssAnon") - heap()))
    heap_after = heap()
    server_after = rss() - heap_after
    oomscope.flush(10.0)
    print(json.dumps({
        "heap_before": heap_before, "heap_after": heap_after,
        "server_before": server_before, "server_after": server_after,
        "objects_scanned": scanned, "server_after_each": steps,
    }), flush=True)
    oomscope.stop()


if __name__ == "__main__":
    main()
