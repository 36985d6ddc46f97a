"""The Python agent's device checks (issue #29), run by tests/device/python.part.sh
on the GPU machine with the carried wheel on PYTHONPATH. Prints one JSON
line per check, {"check", "pass", "detail"}:

- the cudaMallocAsync backend: the hooks it refuses are reported, the
  others installed, and a CUDA OOM is still caught, sent with the device's
  uuid and diagnosed as gpu_vram;
- memory outside PyTorch's allocator (CUDA context, cuBLAS workspace, a
  captured CUDA graph): the agent's reading against NVML's per-process usage;
- the sampler thread reads the process's device: set_device(0) and memory
  there, then the agent starts: it reads device 0 by NVML's uuid and adds no
  context (NVML's per-process usage before and after);
- NVML's cost per sample per GPU: the calls a GPU sample makes, timed N times.

    python3 tests/device/python_devices.py --bin .device/oomscope --collector URL --out DIR

Each process under test is this file again (--child NAME), so each starts
with CUDA untouched.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

MIB = 1 << 20


def emit(check, ok, detail):
    print(json.dumps({"check": check, "pass": bool(ok), "detail": detail}), flush=True)


def nvml_usage(pid):
    """NVML's per-process usage of `pid` in bytes (None when not listed). In
    a container NVML lists host pids: the one process listed is taken for
    ours (nothing else here uses the GPU)."""
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                       "--format=csv,noheader,nounits"], text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[p.strip() for p in line.split(",")] for line in out.splitlines()]
    rows = [r for r in rows if len(r) == 2 and r[1].isdigit()]
    mine = [r for r in rows if r[0] == str(pid)] or (rows if len(rows) == 1 else [])
    return int(mine[0][1]) * MIB if mine else None


def nvml_uuids():
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], text=True,
                                      timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


# ---- the processes under test (--child) ---------------------------------------------------------

def child(name, collector, agent):
    import torch

    import oomscope
    out = {"pid": os.getpid()}
    if name == "async":
        oomscope.start(collector=collector, name=agent, interval_s=0.1, history_max_entries=1000)
        torch.cuda.set_device(0)
        keep = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        with oomscope.request(id="r0", prompt_tokens=1):
            torch.cuda.synchronize()
        time.sleep(0.5)
        total = torch.cuda.get_device_properties(0).total_memory
        out["caught"] = False
        try:
            with oomscope.request(id="too-big", prompt_tokens=1):
                torch.empty(int(total * 1.5), dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            out["caught"], out["text"] = True, str(e)[:300]
        out["backend"] = torch.cuda.get_allocator_backend()
        del keep
    elif name == "non-pytorch":
        torch.cuda.set_device(0)
        oomscope.start(collector=collector, name=agent, interval_s=0.1)
        a = torch.randn(4096, 4096, device="cuda")
        b = a @ a  # cuBLAS: handle and workspace
        static = torch.randn(2048, 2048, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                static @ static
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = static @ static
        graph.replay()
        torch.cuda.synchronize()
        time.sleep(0.6)
        free, total = torch.cuda.mem_get_info(0)
        out.update(reserved=torch.cuda.memory_reserved(0), allocated=torch.cuda.memory_allocated(0),
                   driver_used=total - free, nvml_process=nvml_usage(os.getpid()))
        del a, b, captured, graph
    elif name == "sampler-device":
        torch.cuda.set_device(0)
        keep = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        time.sleep(0.5)
        out["before"] = nvml_usage(os.getpid())
        oomscope.start(collector=collector, name=agent, interval_s=0.05)
        for i in range(20):
            with oomscope.request(id="r%d" % i, prompt_tokens=1):
                time.sleep(0.01)
        time.sleep(1.0)
        out["after"] = nvml_usage(os.getpid())
        del keep
    out["flushed"] = oomscope.flush(10)
    out["stats"] = oomscope.stats()
    print(json.dumps(out), flush=True)
    oomscope.stop()


# ---- the checks -----------------------------------------------------------------------------------

def run_child(a, name, agent, env=None):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--collector", a.collector,
                        "--agent", agent], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, OOMSCOPE_AUTOSTART="0", **(env or {})))
    with open(os.path.join(a.out, agent + ".log"), "w") as f:
        f.write(r.stdout + "\n--- stderr\n" + r.stderr)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        last = (r.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError("%s exited %d: %s" % (name, r.returncode, last[-300:]))
    return json.loads(lines[-1])


def timeline(a, agent):
    import oomscope.query
    t = oomscope.query.timeline(a.collector, agent, 60)
    with open(os.path.join(a.out, agent + "-timeline.json"), "w") as f:
        json.dump(t, f)
    return t


def readings(t):
    return [x for s in t["samples"] for x in s["sample"]["allocator"]]


def diagnose(a, agent):
    r = subprocess.run([a.bin, "diagnose", "--agent", agent, "--json", "--collector", a.collector],
                       capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}


def check_async(a):
    got = run_child(a, "async", "dev-py-async", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    t = timeline(a, "dev-py-async")
    ooms = [e["event"]["oom"] for e in t["events"] if "oom" in e["event"]]
    o = ooms[0] if ooms else {}
    missing = sorted(got["stats"].get("torch_hooks_missing") or {})
    backend = (t["hello"].get("allocator_settings") or {}).get("backend")
    d = diagnose(a, "dev-py-async")
    uuids = nvml_uuids()
    ok = (got["caught"] and got["backend"] == "cudaMallocAsync" and backend == "cudaMallocAsync"
          and "oom_observer" in missing and o.get("device_uuid") in uuids and (o.get("stats") or {}).get("reserved_bytes", 0) > 0
          and d.get("domain") == "gpu_vram")
    emit("py: cudaMallocAsync OOM", ok, "caught %s; hooks missing %s; oom device %s uuid %s (NVML %s); requested %s B; "
         "reserved %s; domain %s causes %s; text %r" % (
             got["caught"], missing, o.get("device"), o.get("device_uuid"), uuids[:1], o.get("requested_bytes"),
             (o.get("stats") or {}).get("reserved_bytes"), d.get("domain"),
             ",".join(c["kind"] for c in d.get("causes", [])) or "-", got.get("text", "")[:80]))


def check_non_pytorch(a):
    got = run_child(a, "non-pytorch", "dev-py-nonpt")
    t = timeline(a, "dev-py-nonpt")
    last = readings(t)[-1] if readings(t) else {}
    agent_used = last.get("driver_total_bytes", 0) - last.get("driver_free_bytes", 0)
    nvml = got.get("nvml_process")
    outside = nvml - got["reserved"] if nvml is not None else None
    ok = (last.get("device_uuid") in nvml_uuids() and last.get("driver_total_bytes", 0) > 0
          and last.get("reserved_bytes", 0) > 0 and outside is not None and outside > 0)
    emit("py: memory outside PyTorch", ok, "agent: reserved %.0f MiB, device used %.0f MiB; process: reserved "
         "%.0f MiB, NVML %s MiB, outside the allocator %s MiB (context, cuBLAS, graph); mem_get_info used %.0f MiB" % (
             last.get("reserved_bytes", 0) / MIB, agent_used / MIB, got["reserved"] / MIB,
             None if nvml is None else nvml // MIB, None if outside is None else outside // MIB,
             got["driver_used"] / MIB))


def check_sampler_device(a):
    got = run_child(a, "sampler-device", "dev-py-device")
    t = timeline(a, "dev-py-device")
    got_devices = sorted({(x["device"], x["device_uuid"]) for x in readings(t)})
    uuids = nvml_uuids()
    before, after = got.get("before"), got.get("after")
    grew = after - before if before is not None and after is not None else None
    ok = got_devices == [(0, uuids[0] if uuids else "?")] and grew is not None and grew < 64 * MIB
    emit("py: sampler reads the process's device", ok, "read %s; NVML process %s -> %s MiB (%s MiB by the agent)" % (
        got_devices, None if before is None else before // MIB, None if after is None else after // MIB,
        None if grew is None else grew // MIB))


def check_nvml_cost(a, n=2000):
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        emit("py: NVML cost per sample per GPU", False, "no NVML: %s" % e)
        return
    if nvml.nvmlInit_v2() != 0:
        emit("py: NVML cost per sample per GPU", False, "nvmlInit_v2 failed")
        return
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    class Process(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                    ("computeInstanceId", ctypes.c_uint)]

    handle, mem, buf = ctypes.c_void_p(), Memory(), ctypes.create_string_buffer(96)
    procs, nprocs = (Process * 64)(), ctypes.c_uint()

    def sample(static):
        for i in range(count.value):
            nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle))
            nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem))
            nprocs.value = 64
            nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(nprocs), procs)
            if static:  # what each sample re-read before static facts were read once
                nvml.nvmlDeviceGetUUID(handle, buf, 96)
                nvml.nvmlDeviceGetName(handle, buf, 96)

    cost = {}
    for static in (True, False):
        sample(static)
        t0 = time.perf_counter()
        for _ in range(n):
            sample(static)
        cost[static] = (time.perf_counter() - t0) / n / max(1, count.value) * 1e6
    nvml.nvmlShutdown()
    emit("py: NVML cost per sample per GPU", True, "%.1f us (memory + processes), %.1f us with uuid and name re-read; "
         "%d GPU(s), %d samples" % (cost[False], cost[True], count.value, n))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin")
    p.add_argument("--collector", required=True)
    p.add_argument("--out")
    p.add_argument("--child")
    p.add_argument("--agent")
    a = p.parse_args()
    if a.child:
        return child(a.child, a.collector, a.agent)
    os.makedirs(a.out, exist_ok=True)
    for check in (check_async, check_non_pytorch, check_sampler_device, check_nvml_cost):
        try:
            check(a)
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the rest
            emit("py: %s crashed" % check.__name__, False, "%s: %s" % (type(e).__name__, str(e)[:300]))


if __name__ == "__main__":
    main()
