"""Boundary readings, not boundary messages (#33): at any request rate the
agent sends at most 20 messages a second, its periodic samples among
them, and every request's begin and end still reaches the collector's
timeline (the collector expands each message into the requests it carries).
Real torch requests, a real collector over loopback."""

import subprocess
import sys
import textwrap

import pytest

# 20 messages a second (agent-core's MIN_BATCH_SPACING, 50 ms, between any two samples).
MAX_BATCHES_PER_S = 20

SERVER = """
import json, sys, time, torch, oomscope
think_s, seconds = float(sys.argv[2]), float(sys.argv[3])
oomscope.start(collector=sys.argv[1], name="rate", interval_s=1, census_auto=False)
x = torch.ones(64)
def serve(n0, until):
    n = n0
    while time.monotonic() < until:
        with oomscope.request(id="r%d" % n, prompt_tokens=3, max_tokens=2) as r:
            (x * 2).sum().item()
            r.output_tokens = 2
        n += 1
        if think_s:
            time.sleep(think_s)
    return n
# Warm: the first messages (Hello, first periodic sample) are not the rate.
n = serve(0, time.monotonic() + 0.5)
assert oomscope.flush(10)
before = oomscope.stats()["acked"]
t0 = time.monotonic()
n = serve(n, t0 + seconds)
assert oomscope.flush(10)
elapsed = time.monotonic() - t0
stats = oomscope.stats()
print(json.dumps({"agent": oomscope.agent_id(), "requests": n, "elapsed": elapsed,
                  "messages": stats["acked"] - before, "dropped": stats["boundary_dropped"]}))
oomscope.stop()
"""


def serve(collector, think_s, seconds):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SERVER), collector.url, str(think_s),
                        str(seconds)], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in __import__("os").environ.items()
                            if k not in ("OOMSCOPE_COLLECTOR", "OOMSCOPE_AUTOSTART")})
    assert r.returncode == 0, r.stderr
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("think_s", [0.005, 0.0], ids=["180-per-s", "tight-loop"])
def test_messages_stay_under_the_cap_and_every_request_reaches_the_timeline(collector, think_s):
    run = serve(collector, think_s, 3.0)
    rate = run["requests"] / run["elapsed"]
    # The load is what the test is about: paced, or a tight loop of
    # hundreds to thousands a second even on a loaded 2-core machine.
    assert rate > (50 if think_s else 300), run
    # At most 20 messages a second, the periodic samples among them, and
    # one flush's worth at each end of the span.
    bound = run["elapsed"] * MAX_BATCHES_PER_S + 3
    assert run["messages"] <= bound, run
    assert run["dropped"] == 0, run

    t = collector.timeline(run["agent"])
    thinned = sum((s.get("requests") or {}).get("thinned_requests", 0) for s in t["samples"])
    requests = [e["request"] for e in t["events"] if e["kind"] == "request"]
    ends = [r["request_id"] for r in requests if not r["start"]]
    begins = [r["request_id"] for r in requests if r["start"]]
    n = run["requests"]
    # Every request's end: one by one, or counted as thinned (a message
    # keeps 200 whole; 20 a second of them is 4,000 requests a second).
    assert len(ends) + thinned == n, (len(ends), thinned, n)
    assert len(set(ends)) == len(ends)
    if rate < 2000:
        assert thinned == 0 and ends == ["r%d" % i for i in range(n)]
        assert begins == ends
    # Each end is a boundary point, with its RSS and its place in the count.
    points = [s for s in t["samples"] if (s.get("context") or {}).get("phase") == "after_request"]
    done = [s["context"]["requests_done"] for s in points]
    assert len(done) == len(ends) and done == sorted(done) and done[-1] == n, done[-5:]
    assert all(s["process"]["vm_rss_bytes"] > 1 << 20 for s in points)
    # Carried by few messages: the points share their message's seq.
    messages = {s["seq"] for s in points}
    span_s = (points[-1]["time_ns"] - points[0]["time_ns"]) / 1e9
    # At most one per 50 ms over the span, plus the flushes' (warm-up, end).
    assert len(messages) <= span_s * MAX_BATCHES_PER_S + 3, (len(messages), span_s)
    # Each message carries several requests: whole below 4,000 a second, and
    # past that a thinned batch keeps its extremes (~3 points) and counts
    # the rest, so the requests, not the points kept, are what it carried.
    assert len(messages) < n / 3, (len(messages), len(points), n)
