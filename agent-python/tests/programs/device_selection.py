"""A server's process as the device-selection tests need it, over the
scripted ``torch`` of fake_torch_cuda.py (installed before the agent starts):

- one-device: the main thread does set_device(2), allocates there, and
  serves requests; the agent samples from its own thread;
- device-map: a model spread over devices 1 and 3 from a main thread that
  never leaves device 0 (device_map="auto"); then a request whose
  allocation on device 3 fails;
- async: backend:cudaMallocAsync on device 1: the observer and the memory
  history are refused; empty_cache is called; a request fails with the
  async backend's OOM;
- held: the autostart's held agent in a process where CUDA is initialised
  but no device used (a helper); then the process allocates on device 2,
  which releases it.

Prints one JSON line at the end: the fake's calls and contexts, and the
agent's stats().
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_torch_cuda  # noqa: E402

GIB = fake_torch_cuda.GIB


def serve(oomscope, n, prefix):
    for i in range(n):
        with oomscope.request(id="%s%d" % (prefix, i), prompt_tokens=8):
            time.sleep(0.01)


def oom_request(oomscope, cuda, device, nbytes):
    try:
        with oomscope.request(id="too-big", prompt_tokens=8):
            cuda.alloc(nbytes, device)
    except fake_torch_cuda.OutOfMemoryError:
        return True
    return False


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--collector", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--case", choices=["one-device", "device-map", "async", "held"], required=True)
    p.add_argument("--no-primary-context", action="store_true",
                   help="a torch without _cuda_hasPrimaryContext")
    a = p.parse_args()
    fake = fake_torch_cuda.install(devices=4, capacity=8 * GIB,
                                   backend="cudaMallocAsync" if a.case == "async" else "native",
                                   primary_context=not a.no_primary_context)
    import torch  # the fake

    import oomscope
    cuda = torch.cuda
    caught = None
    extra = {}
    if a.case == "held":
        # As at interpreter start-up (the .pth), then torch.cuda initialised with nothing allocated.
        oomscope._start(True, collector=a.collector, name=a.name, interval_s=0.05)
        fake.initialized = True
        time.sleep(0.5)
        extra["held_calls"] = list(fake.calls)
        extra["held"] = oomscope.stats()["held"]
        cuda.alloc(GIB, 2)
        time.sleep(0.5)
    else:
        oomscope.start(collector=a.collector, name=a.name, interval_s=0.05,
                       history_max_entries=1000 if a.case == "async" else None)
    if a.case == "one-device":
        cuda.set_device(2)
        cuda.alloc(GIB)
        serve(oomscope, 5, "r")
        time.sleep(0.5)  # several periodic samples
    elif a.case == "device-map":
        cuda.alloc(2 * GIB, 1)
        cuda.alloc(3 * GIB, 3)
        serve(oomscope, 5, "r")
        time.sleep(0.5)
        caught = oom_request(oomscope, cuda, 3, 6 * GIB)
    elif a.case == "async":
        cuda.set_device(1)
        cuda.alloc(GIB)
        serve(oomscope, 3, "r")
        time.sleep(0.3)
        cuda.empty_cache()
        caught = oom_request(oomscope, cuda, None, 8 * GIB)
    time.sleep(0.2)
    flushed = oomscope.flush(10)
    report = fake.report()
    report.update(extra, stats=oomscope.stats(), flushed=flushed, oom_caught=caught,
                  empty_cache_wrapped=bool(getattr(cuda.empty_cache, "_oomscope_wrapped", False)))
    print(json.dumps(report), flush=True)
    oomscope.stop()


if __name__ == "__main__":
    main()
