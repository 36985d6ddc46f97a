"""One JSON shape: for the same collector, `oomscope <verb> --json` and
`oomscope.query.<verb>()` give the same message's serde form (AgentSummary,
Incident, TimelineResponse, Diagnosis), fed by replayed captures over real
gRPC; and the agents' listing carries each agent's latest load."""

import os
import subprocess
import sys

import oomscope.query as query
from conftest import FIXTURES, wait_for


def replay(collector, fixture, name):
    collector.cli("replay", os.path.join(FIXTURES, fixture), "--name", name)


def test_the_cli_and_python_print_the_same_json(collector):
    replay(collector, "kv_concurrency_oom.json", "kv")
    replay(collector, "leak_retained.json", "leak")
    url = collector.url
    assert wait_for(lambda: any(i["agent_name"] == "kv" for i in query.incidents(url)), 20), \
        query.incidents(url)

    agents = collector.cli("agents", "--json")
    assert isinstance(agents, list) and len(agents) == 2, agents
    assert agents == query.agents(url)

    incidents = collector.cli("incidents", "--json")
    assert incidents == query.incidents(url)
    assert collector.cli("incidents", "--agent", "kv", "--json") == query.incidents(url, agent="kv")
    [oom] = [i for i in incidents if i["agent_name"] == "kv"]
    assert oom["kind"] == "oom" and oom["domain"] == "gpu_vram", oom

    for name in ("kv", "leak"):
        t = collector.cli("timeline", name, "--max-points", "0", "--json")
        assert t == query.timeline(url, name), name
        assert t["hello"]["name"] == name and t["samples"] and t["events"], name
        by_agent = collector.cli("diagnose", "--agent", name, "--json")
        assert by_agent == query.diagnose(url, agent=name), name

    d = collector.cli("diagnose", oom["id"], "--json")
    assert d == query.diagnose(url, incident=oom["id"])
    # The verdict and the numbers behind it, as the CLI's tests read them.
    assert (d["incident"], d["domain"]) == (oom["id"], "gpu_vram"), d
    assert d["failure"]["requested_bytes"] > 0 and d["causes"], d
    assert d["causes"][0]["kind"] == "kv_growth", d["causes"]


def test_agents_carry_their_latest_context(collector):
    # A real agent reports its load as a runtime does, then a lighter one.
    script = """
import time, oomscope
oomscope.start(collector=%r, name="ctx", interval_s=0.05, boundary_min_interval_s=0)
oomscope.set_context(active_sequences=7, queued=5, kv_cache_bytes=3 << 30,
                     kv_cache_capacity_bytes=4 << 30, num_preemptions=2)
time.sleep(0.5)
oomscope.set_context(active_sequences=3, queued=1, num_preemptions=4)
time.sleep(0.5)
oomscope.stop()
""" % collector.url
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, OOMSCOPE_AUTOSTART="0"))
    assert r.returncode == 0, r.stderr
    url = collector.url
    [a] = query.agents(url)
    assert collector.cli("agents", "--json") == [a]
    t = query.timeline(url, "ctx")
    newest = max(t["samples"], key=lambda s: (s["sample"]["time_ns"], s["seq"]))["sample"]
    # The newest sample's context whole: KV use, running and waiting
    # requests, the runtime's own numbers (preemptions).
    assert a["context"] == newest["context"], (a["context"], newest["context"])
    c = a["context"]
    assert (c["active_sequences"], c["queued"], c["kv_cache_bytes"], c["kv_cache_capacity_bytes"]) \
        == (3, 1, 3 << 30, 4 << 30), c
    assert c["numbers"]["num_preemptions"] == 4, c
