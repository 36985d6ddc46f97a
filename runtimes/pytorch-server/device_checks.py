"""The GPU checks of the reference server (run by tests/device/python.part.sh
on the H200): leak, fragmentation, KV concurrency and long-context
scenarios under --memory-cap, the GIL held per sample with a real
allocator and by a census, and the latency overhead. Prints one JSON line per check:
{"check", "pass", "detail"}.

    python device_checks.py --bin .device/oomscope --collector http://127.0.0.1:17433 --out DIR
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import drive  # noqa: E402

CAP = 2 << 30


def emit(check, ok, detail):
    print(json.dumps({"check": check, "pass": bool(ok), "detail": detail}), flush=True)


def start_server(a, name, *flags, env=None):
    port_file = os.path.join(a.out, name + ".port")
    log = open(os.path.join(a.out, name + ".log"), "w")
    e = dict(os.environ, OOMSCOPE_AUTOSTART="0", OOMSCOPE_INTERVAL_S="0.2", **(env or {}))
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "server.py"), "--port", "0", "--port-file", port_file,
                          "--collector", a.collector, "--name", name, "--device", "cuda", *flags],
                         stdout=log, stderr=subprocess.STDOUT, env=e)
    deadline = time.monotonic() + 180
    while not os.path.exists(port_file):
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("%s did not start: %s" % (name, open(log.name).read()[-2000:]))
        time.sleep(0.2)
    return p, int(open(port_file).read())


def stop(p):
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


def diagnose(a, name):
    r = subprocess.run([a.bin, "diagnose", "--agent", name, "--json", "--collector", a.collector],
                       capture_output=True, text=True, timeout=120)
    d = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr}
    with open(os.path.join(a.out, name + "-diagnose.json"), "w") as f:
        json.dump(d, f, indent=1)
    return d


def timeline(a, name):
    import oomscope.query
    t = oomscope.query.timeline(a.collector, name, 60)
    with open(os.path.join(a.out, name + "-timeline.json"), "w") as f:
        json.dump(t, f)
    return t


def events(t, kind):
    return [e["event"][kind] for e in t["events"] if kind in e["event"]]


def causes(d):
    return ",".join(c["kind"] for c in d.get("causes", [])) or "-"


def check_leak(a):
    p, port = start_server(a, "gpu-leak", "--leak-responses", "--memory-cap", str(CAP),
                           env={"OOMSCOPE_CENSUS_EVERY": "10", "OOMSCOPE_CENSUS_BUDGET_S": "2"})
    try:
        r = drive.drive(port, 40, prompt=16, max_tokens=8, prefix="leak")
        time.sleep(1.5)
        t = timeline(a, "gpu-leak")
    finally:
        stop(p)
    alloc = [s["allocator"][0]["allocated_bytes"] for s in (x["sample"] for x in t["samples"])
             if s["context"] and s["context"]["phase"] == "after_request" and s["allocator"]]
    per_req = (alloc[-1] - alloc[9]) / max(1, len(alloc) - 10) if len(alloc) > 10 else 0
    logits = 8 * 32000 * 2  # bf16 scores kept per response
    c = events(t, "heap_census")
    top = c[-1]["referrer_chain"] if c else []
    d = diagnose(a, "gpu-leak")
    ok = r["statuses"] == {200: 40} and abs(per_req - logits) < 0.1 * logits and any("cuda" in s for s in top)
    emit("py: leak (GPU tensors kept)", ok, "allocated +%.0f B/request (logits %d); chain %s; causes %s"
         % (per_req, logits, " <- ".join(top[:3]), causes(d)))


def check_oom(a, name, flags, load, expect):
    """A scenario that must end in a CUDA OOM caught by the agent."""
    p, port = start_server(a, name, "--memory-cap", str(CAP), *flags)
    try:
        r = load(port)
        time.sleep(1.0)
        t = timeline(a, name)
    finally:
        stop(p)
    ooms = events(t, "oom")
    d = diagnose(a, name)
    o = ooms[0] if ooms else {}
    obs = o.get("observer") or {}
    ctx = o.get("context") or {}
    snap = o.get("snapshot") or {}
    ok = (bool(ooms) and obs.get("device_allocated") == CAP and "out of memory" in o.get("error_text", "")
          and snap.get("segments", 0) > 0 and 507 in r["statuses"] and expect(o, d))
    emit("py: " + name, ok, "statuses %s; oom requested %s, observer cap %s, active_seqs %s, kv %s, "
         "reserved-allocated %s, largest free %s; domain %s causes %s" % (
             r["statuses"], o.get("requested_bytes"), obs.get("device_allocated"), ctx.get("active_sequences"),
             ctx.get("kv_cache_bytes"), (o.get("stats") or {}).get("reserved_bytes", 0)
             - (o.get("stats") or {}).get("allocated_bytes", 0), snap.get("largest_free_block_bytes"),
             d.get("domain"), causes(d)))


def check_gil(a):
    import bench_overhead
    g = bench_overhead.gil_cost(1000)
    emit("py: GIL per sample (real allocator)", g["cuda"] and g["gil_per_sample_us"] < 1000,
         "%.1f us per sample, %.1f us per request context, census %.0f ms over %d objects" % (
             g["gil_per_sample_us"], g["request_context_us"], g["census_ms"], g["census_objects"]))
    emit("py: a census's longest GIL hold (bar 20 ms)", g["census_longest_hold_ms"] <= 20.0,
         "%.1f ms (%.1f ms on CPU) over three censuses of %d objects; one raw gc.get_objects() %.1f ms" % (
             g["census_longest_hold_ms"], g["census_longest_hold_cpu_ms"], g["census_objects"],
             g["gc_get_objects_ms"]))


def check_overhead(a):
    r = subprocess.run([sys.executable, os.path.join(HERE, "bench_overhead.py"), "--oomscope-bin", a.bin,
                        "--requests", "40", "--blocks", "5", "--device", "cuda"], capture_output=True, text=True,
                       timeout=400)
    out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}
    with open(os.path.join(a.out, "overhead.json"), "w") as f:
        json.dump(out or {"stderr": r.stderr}, f)
    ok = bool(out) and out["p50_overhead_pct"] < 1.0
    emit("py: p50 latency overhead", ok, "p50 %+.2f%% p99 %+.2f%% (block p50s off %s on %s)" % (
        out.get("p50_overhead_pct", float("nan")), out.get("p99_overhead_pct", float("nan")),
        out.get("off", {}).get("block_p50s"), out.get("on", {}).get("block_p50s")) if out else r.stderr[-300:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--collector", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    big = ["--d-model", "1024", "--layers", "8", "--heads", "16"]
    checks = [
        lambda: check_leak(a),
        lambda: check_oom(a, "gpu-fragment", ["--fragment", "--fragment-kib", "8192", "--fragment-keep", "256"],
                          lambda port: drive.drive(port, 60, prefix="frag"), lambda o, d: d.get("domain") == "gpu_vram"),
        lambda: check_oom(a, "gpu-kv-concurrency", big,
                          lambda port: drive.drive(port, 8, concurrency=8, prompt=4096, max_tokens=64, prefix="kv"),
                          lambda o, d: (o.get("context") or {}).get("kv_cache_bytes", 0) > 0),
        lambda: check_oom(a, "gpu-long-context", big,
                          lambda port: drive.drive(port, 1, prompt=60000, max_tokens=4, prefix="long"),
                          lambda o, d: d.get("domain") == "gpu_vram"),
        lambda: check_gil(a),
        lambda: check_overhead(a),
    ]
    for c in checks:
        try:
            c()
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the rest
            emit("py: check crashed", False, "%s: %s" % (type(e).__name__, e))


if __name__ == "__main__":
    main()
