"""A service as a newcomer would write it, under the Python agent with no
reference-server help: a CPU torch model, a request loop, and a global list
that keeps every request's input and output tensors and a string (256 KiB
of tensors a request). With --clear the list is emptied after each request:
the same work, no leak.

Prints "done" after the last request, then keeps the agent running until
stdin closes, so the censuses it owes can still run and be read.
"""

import argparse
import sys
import time

import torch

import oomscope

history = []


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--collector", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--pace-ms", type=float, default=20.0, help="pause between requests")
    p.add_argument("--clear", action="store_true", help="empty the list after each request (no leak)")
    a = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    oomscope.start(collector=a.collector, name=a.name, interval_s=0.5)
    for i in range(a.requests):
        with oomscope.request(id="r%d" % i, prompt_tokens=64):
            x = torch.randn(64, 512)
            with torch.no_grad():
                y = model(x)
            history.append((x, y, "request %d answered with %s" % (i, tuple(y.shape))))
            if a.clear:
                history.clear()
        time.sleep(a.pace_ms / 1000.0)
    print("done", flush=True)
    sys.stdin.read()
    oomscope.stop()


if __name__ == "__main__":
    main()
