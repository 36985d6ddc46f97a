"""Ten thousand requests with the collector down (issue #33): a real agent
in its own process, a real collector stopped and started again on the same
port and database. Without a spool the agent's bounded memory keeps the
newest evidence whole and thins the older (stated on the samples kept);
with one, what the spool kept is resent and what it dropped is counted and
stated. Sized from the pace's measured bytes a second, so the test holds
whatever the agent's message rate."""

import json
import os
import subprocess
import sys
import time

from conftest import Collector, free_port

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "outage_service.py")
REQUESTS = 10000
# With the service's 100 warm-up requests before the outage.
SERVED = REQUESTS + 100
PACE_MS = 3.5
# Seconds of the pace's bytes the memory bound holds: its newest half
# (ledger.rs WHOLE_SHARE) is 13 s, over the 10 s that must stay whole, and
# the outage (10,000 requests 3.5 ms apart, 35 s at least) outlasts it all.
BUFFER_SECONDS = 26
WHOLE_S = 10
# The most a sample may be apart from the next in the thinned stretch.
THINNED_GAP_S = 2.0


class Service:
    def __init__(self, tmp_path, collector, name, *flags):
        self.log = open(str(tmp_path / ("%s.log" % name)), "w")
        env = dict(os.environ, OOMSCOPE_AUTOSTART="0")
        self.proc = subprocess.Popen(
            [sys.executable, PROGRAM, "--collector", collector.url, "--name", name,
             "--requests", str(REQUESTS), "--pace-ms", str(PACE_MS), *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

    def read(self):
        line = self.proc.stdout.readline()
        assert line, "the service died: %s" % open(self.log.name).read()
        return json.loads(line)

    def tell(self, word):
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def pace_bytes_per_s(tmp_path):
    """What the pace buffers a second, against a port nothing listens on."""
    nobody = Collector(tmp_path, port=free_port())
    r = subprocess.run(
        [sys.executable, PROGRAM, "--collector", nobody.url, "--name", "calibrate", "--requests", "1000",
         "--pace-ms", str(PACE_MS), "--calibrate"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OOMSCOPE_AUTOSTART="0"))
    assert r.returncode == 0, r.stderr
    rate = json.loads(r.stdout.splitlines()[-1])["bytes_per_s"]
    assert rate > 0
    return rate


def outage(tmp_path, name, *flags):
    """Runs the service through an outage; returns (down, back, its
    timeline, the time the collector came back)."""
    collector = Collector(tmp_path).start()
    service = Service(tmp_path, collector, name, *flags)
    try:
        up = service.read()
        assert up["up"], up
        collector.stop()
        service.tell("down")
        down = service.read()
        assert down["gone"], down
        collector.start()
        t_back = time.time_ns()
        service.tell("back")
        back = service.read()
        assert back["flushed"], back
        assert service.proc.wait(60) == 0
        timeline = collector.timeline(name)
    finally:
        service.close()
        collector.stop()
    assert timeline["events_cut_ns"] == 0, "every event in the reply"
    return down, back, timeline, t_back


def stored_seqs(timeline):
    """The messages stored, by seq: a batch of request readings is one
    message, expanded into a point and events per request, all of its seq."""
    return sorted({s["seq"] for s in timeline["samples"]} | {e["seq"] for e in timeline["events"]})


def statements(timeline):
    return [s["dropped_before"] for s in timeline["samples"] if s.get("dropped_before")]


def requests_accounted(timeline):
    """Requests ended: those stored one by one, those a stored batch
    counted as thinned, and those the agent stated dropped."""
    ends = [e for e in timeline["events"] if e["kind"] == "request" and not e["request"].get("start")]
    thinned = sum(int((s.get("requests") or {}).get("thinned_requests", 0)) for s in timeline["samples"])
    stated = sum(int(d.get("requests", 0)) for d in statements(timeline))
    return len(ends) + thinned + stated, stated


def missing(seqs):
    have = set(seqs)
    return [s for s in range(1, seqs[-1] + 1) if s not in have]


def test_without_a_spool_the_newest_stay_whole_and_the_older_are_thinned(tmp_path):
    bound = int(pace_bytes_per_s(tmp_path) * BUFFER_SECONDS)
    down, back, timeline, t_back = outage(tmp_path, "thin", "--buffer-max-bytes", str(bound))
    stats = back["stats"]
    # Memory stayed bounded: the buffer, and the process's growth over the
    # outage (the decoded messages take more than their encoded bytes).
    assert 0 < down["largest_buffer"] <= bound, (down["largest_buffer"], bound)
    assert down["rss_end"] - down["rss_down"] < 4 * bound + 16 * 2**20, down
    # Thinning happened, and is every message lost: none refused by a queue.
    assert stats["thinned"] > 0 and stats["max_stride"] >= 2, stats
    assert stats["dropped"] == stats["thinned"], stats

    seqs = stored_seqs(timeline)
    lost = missing(seqs)
    assert len(lost) == stats["dropped"], (len(lost), stats)
    # Every loss is stated on the samples kept, by kind.
    said = statements(timeline)
    assert sum(int(d.get("samples", 0)) + int(d.get("events", 0)) for d in said) == len(lost)
    assert all(int(d.get("by_spool", 0)) == 0 and int(d["stride"]) >= 2 for d in said), said
    # And by request: a dropped batch stands for the requests it carried.
    total, stated = requests_accounted(timeline)
    assert total == SERVED and stated > len(lost), (total, stated, len(lost))

    samples = [s for s in timeline["samples"] if down["t_down_ns"] <= s["time_ns"] <= t_back]
    whole_from = t_back - WHOLE_S * 10**9
    # The last 10 s before the reconnect: every message, none stated lost.
    newest = [s for s in seqs if s >= min(x["seq"] for x in samples if x["time_ns"] >= whole_from)]
    assert newest == list(range(newest[0], newest[-1] + 1)), "a gap in the newest 10 s"
    assert not [s for s in samples if s["time_ns"] >= whole_from and s.get("dropped_before")]
    # Before them, thinned but not missing: a sample every 2 s at least,
    # from the outage's start on.
    times = [down["t_down_ns"]] + [s["time_ns"] for s in samples if s["time_ns"] < whole_from] + [whole_from]
    widest = max(b - a for a, b in zip(times, times[1:])) / 1e9
    assert widest <= THINNED_GAP_S, widest
    thinned_samples = [s for s in samples if s["time_ns"] < whole_from and s.get("dropped_before")]
    assert thinned_samples, "the older stretch is thinned, and says so"


def test_with_a_spool_what_it_kept_is_resent_and_what_it_dropped_is_stated(tmp_path):
    rate = pace_bytes_per_s(tmp_path)
    # Memory for 5 s of the pace, the spool's disk for 15: the oldest of
    # the outage go past the spool's bound, the rest is reread and resent.
    memory, disk = int(rate * 5), int(rate * 15)
    spool = tmp_path / "spool"
    down, back, timeline, t_back = outage(
        tmp_path, "spooled", "--buffer-max-bytes", str(memory), "--spool-dir", str(spool),
        "--spool-max-bytes", str(disk))
    stats = back["stats"]
    assert 0 < down["largest_buffer"] <= memory, (down["largest_buffer"], memory)
    assert down["rss_end"] - down["rss_down"] < 4 * memory + 16 * 2**20, down
    assert stats["dropped"] > 0, "the outage outgrew the spool's bound: %s" % stats

    seqs = stored_seqs(timeline)
    lost = missing(seqs)
    # Every message went to the spool: those lost past its bound and those it kept.
    assert stats["spooled"] >= len(lost) + len([s for s in seqs if s > lost[-1]]), stats
    assert len(lost) == stats["dropped"], (len(lost), stats)
    said = statements(timeline)
    assert sum(int(d.get("samples", 0)) + int(d.get("events", 0)) for d in said) == len(lost)
    assert sum(int(d.get("by_spool", 0)) for d in said) == len(lost) - stats["thinned"], (said, stats)
    total, stated = requests_accounted(timeline)
    assert total == SERVED and stated > len(lost), (total, stated, len(lost))
    # What the spool kept, the newest, all arrived: from the last loss on,
    # every seq up to the end.
    after = [s for s in seqs if s > lost[-1]]
    assert after == list(range(lost[-1] + 1, seqs[-1] + 1))
    kept_samples = [s for s in timeline["samples"] if s["seq"] > lost[-1] and s["time_ns"] < t_back]
    span = (t_back - min(s["time_ns"] for s in kept_samples)) / 1e9
    assert span >= WHOLE_S, "the spool kept %.1f s before the reconnect" % span
