"""The reference server with its switches, driven with 40 requests over
HTTP (CPU tensors here): what the collector holds (samples, heap censuses,
gc events), then its verdict. Census every 10 requests."""

import pytest

from conftest import events, wait_for

REQUESTS = 40
CENSUS_EVERY = 10
PROMPT, MAX_TOKENS, VOCAB = 16, 8, 8000
#: One response's logits: MAX_TOKENS rows of VOCAB float32 scores.
LOGITS_BYTES = MAX_TOKENS * VOCAB * 4
#: Censuses by count only (not on suspicion, tested in test_slow_leak.py), so
#: the spans below are exact; a generous budget, so that a loaded machine
#: does not cut a census short (its counts would be a part of the heap).
ENV = {"OOMSCOPE_CENSUS_EVERY": str(CENSUS_EVERY), "OOMSCOPE_INTERVAL_S": "0.2",
       "OOMSCOPE_CENSUS_BUDGET_S": "30", "OOMSCOPE_CENSUS_INTERVAL_S": "0", "OOMSCOPE_CENSUS_AUTO": "0"}


#: The client's pause after each request. A census waits (up to 2 s) for a
#: moment with no request in flight; requests sent back to back leave it
#: none on a fast machine, and it is then taken mid-request, its counts
#: holding that request's temporaries (CI once saw 15 such tensors). The
#: counts below are exact only between requests: `span` checks that.
PAUSE_S = 0.05


def run_scenario(collector, server_factory, name, *flags):
    s = server_factory(name, *flags, env=ENV)
    r = s.drive(REQUESTS, prompt=PROMPT, max_tokens=MAX_TOKENS, prefix=name, pause_s=PAUSE_S)
    assert r["statuses"] == {200: REQUESTS}, r
    censuses = wait_for(lambda: len(events(collector.timeline(name), "heap_census")) >= REQUESTS // CENSUS_EVERY
                        and events(collector.timeline(name), "heap_census"), 60)
    assert censuses, "no censuses from %s" % name
    return s, collector.timeline(name)


def by_type(census):
    return {t["type_name"]: t for t in census["types"]}


def growth(first, last, name):
    a, b = by_type(first).get(name, {}), by_type(last).get(name, {})
    return b.get("count", 0) - a.get("count", 0), b.get("bytes", 0) - a.get("bytes", 0)


def census_points(timeline):
    """(requests_done, census, the sample before it) for each census: the
    agent sends a sample with phase "census" just before each one."""
    out, before = [], None
    items = sorted([(s["seq"], s) for s in timeline["samples"]] + [(e["seq"], e) for e in timeline["events"]],
                   key=lambda x: x[0])
    for _, item in items:
        if "kind" not in item:
            if item["context"] and item["context"]["phase"] == "census":
                before = item
        elif item["kind"] == "heap_census":
            out.append((before["context"]["requests_done"], item["heap_census"], before))
    return out


class Requests:
    """The requests whose leftovers lie between two censuses: `n` by the
    samples before them, give or take the requests that ended while each
    ran (its GIL slices let the server go on; CI once saw one: 19 of 20)."""

    def __init__(self, n, first, last):
        self.n = n
        self.lo = n - first.get("requests_ended_during", 0)
        self.hi = n + last.get("requests_ended_during", 0)

    def holds(self, count, per=1, rel=0.0):
        return self.lo * per * (1 - rel) <= count <= self.hi * per * (1 + rel)

    def __repr__(self):
        return "%d requests (%d..%d)" % (self.n, self.lo, self.hi)


def span(timeline):
    """The second and last censuses (the first has no baseline, so it lists
    only the largest types) and the requests completed between them; both
    taken between requests."""
    points = census_points(timeline)
    (n0, first, s0), (n1, last, s1) = points[1], points[-1]
    assert n1 - n0 >= 15, [p[0] for p in points]
    in_flight = [s["context"]["numbers"]["requests_in_flight"] for s in (s0, s1)]
    assert in_flight == [0, 0], "a census taken mid-request: %s" % in_flight
    return first, last, Requests(n1 - n0, first, last)


def test_leak_responses_grow_per_request_and_the_type_is_named(collector, server_factory):
    _, t = run_scenario(collector, server_factory, "leaky", "--leak-responses")
    first, last, n = span(t)
    dc, db = growth(first, last, "__main__.Completion")
    assert n.holds(dc), (dc, db, n)  # one kept response per request
    dc, db = growth(first, last, "torch.Tensor[cpu]")
    assert dc >= n.lo and n.holds(db, LOGITS_BYTES, rel=0.02), (dc, db, n)
    chain = last["referrer_chain"]
    assert chain[0] == "module __main__ global RESPONSE_LOG", chain
    assert any(step.startswith("__main__.Completion.logits") for step in chain), chain
    assert chain[-1].startswith("torch.Tensor[cpu]"), chain


def test_without_a_switch_nothing_grows(collector, server_factory):
    _, t = run_scenario(collector, server_factory, "clean")
    first, last, n = span(t)
    dc, db = growth(first, last, "torch.Tensor[cpu]")
    assert db < LOGITS_BYTES, (dc, db, n)  # not even one response's worth
    assert growth(first, last, "__main__.Completion")[0] == 0


def test_gc_cycles_grow_until_the_cycle_collector_runs(collector, server_factory):
    s, t = run_scenario(collector, server_factory, "cycles", "--gc-cycles")
    c = events(t, "heap_census")
    first, last, n = span(t)
    dc, db = growth(first, last, "__main__.Completion")
    assert n.holds(dc), (dc, db, n)
    status, body = s.post("/admin/gc")
    assert status == 200 and body["collected"] > 0, body
    t = wait_for(lambda: (lambda t: len(events(t, "heap_census")) > len(c) and t)(collector.timeline("cycles")), 30)
    assert t, "no census after gc"
    gcs = [g for g in events(t, "gc") if g["generation"] == 2]
    assert gcs and max(g["collected"] for g in gcs) >= REQUESTS, gcs
    after = events(t, "heap_census")[-1]
    assert by_type(after).get("__main__.Completion", {}).get("count", 0) == 0


def test_host_leak_grows_rss_and_names_the_retaining_type(collector, server_factory):
    _, t = run_scenario(collector, server_factory, "hostleak", "--host-leak")
    first, last, n = span(t)
    dc, db = growth(first, last, "torch.Tensor[cpu]")
    # The count may catch a few of the engine's temporaries mid-step; the
    # bytes are the copies.
    assert n.lo - 3 <= dc <= n.hi + 3 and n.holds(db, LOGITS_BYTES, rel=0.02), (dc, db, n)
    assert last["referrer_chain"][0] == "module __main__ global HOST_COPIES", last["referrer_chain"]
    # RSS as each census began: like with like, since after each census the
    # agent hands the heap's free pages back (malloc_trim), the server's
    # included, so an RSS read between censuses holds free memory that a
    # later one does not.
    rss = [(n, s["process"]["vm_rss_bytes"]) for n, _, s in census_points(t)]
    (n0, r0), (n1, r1) = rss[1], rss[-1]
    assert n1 - n0 >= 15 and (r1 - r0) / (n1 - n0) >= 0.5 * LOGITS_BYTES, rss


# Verdicts: the diagnostician (analysis/) names leak, gc_retained and
# host_growth with `bytes_per_request`; these hold it to the live evidence.

def diagnose(collector, name):
    return collector.cli("diagnose", "--agent", name, "--json")


def causes(d):
    return {c["kind"]: c for c in d["causes"]}


def test_verdict_leak_names_the_type(collector, server_factory):
    run_scenario(collector, server_factory, "leaky-v", "--leak-responses")
    d = causes(diagnose(collector, "leaky-v"))
    assert "leak" in d, d
    leak = d["leak"]
    assert any("torch.Tensor[cpu]" in e or "Completion" in e for e in leak["evidence"]), leak
    assert leak["metrics"]["bytes_per_request"] == pytest.approx(LOGITS_BYTES, rel=0.1), leak


def test_verdict_no_leak_without_a_switch(collector, server_factory):
    run_scenario(collector, server_factory, "clean-v")
    d = causes(diagnose(collector, "clean-v"))
    assert "leak" not in d and "gc_retained" not in d, d


def test_verdict_gc_cycles_are_gc_retained_not_a_leak(collector, server_factory):
    s, _ = run_scenario(collector, server_factory, "cycles-v", "--gc-cycles")
    s.post("/admin/gc")
    wait_for(lambda: any(g["generation"] == 2 for g in events(collector.timeline("cycles-v"), "gc")), 30)
    d = causes(diagnose(collector, "cycles-v"))
    assert "gc_retained" in d and "leak" not in d, d


def test_verdict_host_leak_is_host_growth_named_by_the_census(collector, server_factory):
    # CPU tensors kept per request: host RSS grows, and the census names the
    # type. Either verdict says so with the tensor's bytes: host_growth where
    # RSS grows for certain, else leak (the census's growth, with RSS rising
    # along), as when a census's trim has just given pages back.
    run_scenario(collector, server_factory, "hostleak-v", "--host-leak")
    d = causes(diagnose(collector, "hostleak-v"))
    found = d.get("host_growth") or d.get("leak")
    assert found, d
    assert any("torch.Tensor[cpu]" in e for e in found["evidence"]), found
    assert found["metrics"]["retained_type_bytes_per_request"] == pytest.approx(LOGITS_BYTES, rel=0.1), found
    assert any(e.startswith("host RSS") or "host RSS" in e for e in found["evidence"]), found


def test_the_agent_switches_off_and_on_in_a_running_server(collector, server_factory):
    """POST /admin/agent, which the overhead benchmark uses for its A/B blocks:
    off, requests are served without a boundary sample; on again, a new agent
    of the same name streams."""
    s = server_factory("switch")
    assert s.drive(3, prefix="a")["statuses"] == {200: 3}
    assert s.post("/admin/agent", {"on": False}) == (200, {"running": False})
    assert s.drive(4, prefix="b")["statuses"] == {200: 4}
    assert s.post("/admin/agent", {"on": True}) == (200, {"running": True})
    assert s.drive(2, prefix="c")["statuses"] == {200: 2}
    def switch_agents():
        mine = [a for a in collector.cli("agents", "--json") if a["hello"]["name"] == "switch"]
        return sorted(mine, key=lambda a: a["first_seen_ns"]) if len(mine) == 2 else None

    def served(agent_id):
        t = collector.timeline(agent_id)
        return sorted(e["request_id"] for e in events(t, "request") if not e["start"])

    agents = wait_for(switch_agents, 20)
    assert agents, collector.cli("agents", "--json")
    first, second = agents
    assert first["state"] == "disconnected", "switching off says Goodbye"
    assert served(first["hello"]["agent_id"]) == ["a-0", "a-1", "a-2"]
    assert wait_for(lambda: served(second["hello"]["agent_id"]) == ["c-0", "c-1"], 20), served(second["hello"]["agent_id"])
