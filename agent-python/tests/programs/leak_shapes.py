"""A short-request torch service under the Python agent that keeps a part of
each request in a module global, in one of three shapes (or none):

- tensors: two tensors a request in a list (550 KiB: a 64x1100 float32
  input and a scaled copy);
- bytes: a dict keeping a 200 KiB `bytes` payload a request;
- objects: a list keeping, each request, a list of 300 small dicts of
  two strings each (~90 KiB);
- clean: the same work, nothing kept.

Prints "done <stats() as JSON>" after the last request, then keeps the agent
running until stdin closes, so what it sent can be read.
"""

import argparse
import json
import sys
import time

import torch

import oomscope

keep = []
payloads = {}

#: What each shape keeps a request, in bytes (the tests' yardstick).
TENSOR_BYTES = 2 * 64 * 1100 * 4
PAYLOAD_BYTES = 200 * 1024


def serve(shape, i, model):
    x = torch.randn(64, 1100)
    with torch.no_grad():
        y = model(x)
    if shape == "tensors":
        keep.append([x, x * 0.5])
    elif shape == "bytes":
        payloads["request-%d" % i] = bytes(PAYLOAD_BYTES)
    elif shape == "objects":
        keep.append([{"id": "r%d-%d" % (i, j), "text": "token %d of request %d" % (j, i)} for j in range(300)])
    return y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--collector", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--shape", choices=("tensors", "bytes", "objects", "clean"), required=True)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--pace-ms", type=float, default=20.0, help="think time between requests")
    p.add_argument("--rate", type=float, default=0.0,
                   help="requests per second to keep to (each starts at its slot); 0: --pace-ms after each")
    a = p.parse_args()
    torch.manual_seed(0)
    # Short requests, as the service: one thread, a small layer.
    torch.set_num_threads(1)
    model = torch.nn.Linear(1100, 16)
    oomscope.start(collector=a.collector, name=a.name, interval_s=0.5)
    started = time.monotonic()
    for i in range(a.requests):
        with oomscope.request(id="r%d" % i, prompt_tokens=64):
            serve(a.shape, i, model)
        if a.rate > 0:
            time.sleep(max(0.0, started + (i + 1) / a.rate - time.monotonic()))
        else:
            time.sleep(a.pace_ms / 1000.0)
    rate = a.requests / (time.monotonic() - started)
    # What the census sizes a kept dict at (its __sizeof__, as sys.getsizeof
    # without gc's header), each request keeping 300.
    dict_bytes = sum(d.__sizeof__() for d in keep[-1]) if a.shape == "objects" else 0
    print("done", json.dumps({"rate": rate, "dict_bytes": dict_bytes, "stats": oomscope.stats()}), flush=True)
    sys.stdin.read()
    oomscope.stop()


if __name__ == "__main__":
    main()
