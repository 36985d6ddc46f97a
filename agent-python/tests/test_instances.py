"""Instances (#11), the agent's side: short-lived helpers started with the
autostart never reach the collector; SIGTERM still says Goodbye; the
reference server with --workers under `oomscope run` is one instance of
four agents (supervisor, API process, two workers), a killed worker takes it
down as vLLM's does, and SIGTERM stops it all cleanly.

Every process here talks to the test's own collector only: the environment
is stripped of OOMSCOPE_* and given this collector's URL."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time

from conftest import SERVER, oomscope_bin, wait_for


def env_for(collector, **extra):
    """The autostart on (OOMSCOPE_COLLECTOR set), aimed at `collector`."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("OOMSCOPE_")}
    e.update(OOMSCOPE_COLLECTOR=collector.url, OOMSCOPE_INTERVAL_S="0.2", **extra)
    return e


#: What `oomscope run` tells the processes it starts, here without one: an
#: autostarted agent that lasts joins only under a supervisor (#28).
SUPERVISED = {"OOMSCOPE_SUPERVISOR_AGENT": "supervisor-test-host-1-1"}


def host_rss(pid):
    with open("/proc/%d/status" % pid) as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def named(collector, name):
    return [a for a in collector.agents() if a["hello"]["name"] == name]


def test_short_lived_helpers_reach_no_collector_and_a_lasting_process_does(collector, tmp_path):
    """Under a supervisor (its environment), as a server's helpers are."""
    spool = str(tmp_path / "spool")
    env = env_for(collector, OOMSCOPE_NAME="helper", OOMSCOPE_SPOOL=spool, **SUPERVISED)
    helpers = [subprocess.Popen([sys.executable, "-c", "pass" if i % 2 else "import time; time.sleep(0.3)"],
                                env=env) for i in range(10)]
    assert [p.wait(60) for p in helpers] == [0] * 10
    assert not os.path.exists(spool) or os.listdir(spool) == [], "a helper left a spool"
    lasting = subprocess.run([sys.executable, "-c", "import time; time.sleep(3)"],
                             env=dict(env, OOMSCOPE_NAME="lasting"), timeout=60)
    assert lasting.returncode == 0
    agents = wait_for(lambda: named(collector, "lasting"), 10)
    assert len(agents) == 1 and agents[0]["state"] == "disconnected", agents  # its Goodbye at exit
    assert agents[0]["samples"] >= 5, "the samples it took while held arrived too"
    assert named(collector, "helper") == [], "helpers reached the collector"
    assert len(os.listdir(spool)) == 1, "the lasting process's spool, made once released"


#: Waits until its agent is released and connected, then prints its id and
#: sleeps; `setup` runs first (e.g. installs the app's own SIGTERM handler).
SLEEPER = """
import os, signal, sys, time, oomscope
%s
while oomscope.stats()["held"] or not oomscope.stats()["connected"]:
    time.sleep(0.05)
print(oomscope.agent_id(), flush=True)
time.sleep(60)
"""


def sleeper(collector, name, setup="", **kw):
    return subprocess.Popen([sys.executable, "-c", SLEEPER % setup],
                            env=env_for(collector, OOMSCOPE_NAME=name, **SUPERVISED),
                            stdout=subprocess.PIPE, text=True, **kw)


def summary_of(collector, agent_id):
    """The collector's summary of one agent ({} while it has none)."""
    return next((a for a in collector.agents() if a["hello"]["agent_id"] == agent_id), {})


def state_of(collector, agent_id):
    return summary_of(collector, agent_id).get("state")


def exit_code_of(collector, agent_id):
    """Its Goodbye's status (absent: 0, as the proto reads it)."""
    return (summary_of(collector, agent_id).get("goodbye") or {}).get("exit_code", 0)


#: How a process ends: (its last line, its Goodbye's reason and status, the
#: status the parent sees).
ENDINGS = {
    "returns": ("pass", "interpreter exit", 0, 0),
    "exits": ("sys.exit(3)", "interpreter exit", 3, 3),
    "raises": ("raise ValueError('boom')", "interpreter exit", 1, 1),
    # The interpreter ends itself by SIGINT after its exit callbacks.
    "interrupted": ("raise KeyboardInterrupt", "KeyboardInterrupt", 130, -signal.SIGINT),
}


def test_the_goodbye_carries_the_status_the_process_exits_with(collector):
    """Python decides the exit status after its atexit callbacks: the agent
    says the Goodbye from the C library's exit with it, so a process that
    exits 1 is not taken for a clean stop (see the killed-worker test)."""
    code = """
import sys, time, oomscope
while oomscope.stats()["held"] or not oomscope.stats()["connected"]:
    time.sleep(0.05)
print(oomscope.agent_id(), flush=True)
%s
"""
    procs = {name: subprocess.Popen([sys.executable, "-c", code % e[0]],
                                    env=env_for(collector, OOMSCOPE_NAME=name, **SUPERVISED),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for name, e in ENDINGS.items()}
    ids = {name: p.stdout.readline().strip() for name, p in procs.items()}
    assert all(ids.values()), ids
    assert {name: p.wait(30) for name, p in procs.items()} == {name: e[3] for name, e in ENDINGS.items()}

    def goodbyes():
        by_id = {a["hello"]["agent_id"]: a for a in collector.agents()}  # one listing a look
        g = {name: by_id.get(i, {}).get("goodbye") for name, i in ids.items()}
        return g if all(g.values()) else None
    g = wait_for(goodbyes, 10)
    assert g, "not every process said Goodbye: %s" % collector.agents()
    said = {name: (x.get("reason"), x.get("exit_code", 0)) for name, x in g.items()}
    assert said == {name: (e[1], e[2]) for name, e in ENDINGS.items()}, said


def test_sigterm_says_goodbye_and_the_process_still_dies_by_sigterm(collector):
    default = sleeper(collector, "term-default")
    # An app's own handler, installed after the agent's, takes over; its exit says Goodbye at exit.
    own = sleeper(collector, "term-own", "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))")
    # A SIGTERM ignored before the agent started stays ignored.
    ignored = sleeper(collector, "term-ignored", preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    try:
        ids = {p: p.stdout.readline().strip() for p in (default, own, ignored)}
        assert all(ids.values()), ids
        for p in ids:
            p.send_signal(signal.SIGTERM)
        assert default.wait(20) == -signal.SIGTERM
        assert own.wait(20) == 3
        assert wait_for(lambda: state_of(collector, ids[default]) == "disconnected", 10), "no Goodbye on SIGTERM"
        assert wait_for(lambda: state_of(collector, ids[own]) == "disconnected", 10)
        # Each Goodbye carries the status its process ended with.
        assert exit_code_of(collector, ids[default]) == 128 + signal.SIGTERM
        assert exit_code_of(collector, ids[own]) == 3
        time.sleep(1)
        assert ignored.poll() is None, "an ignored SIGTERM killed the process"
        assert state_of(collector, ids[ignored]) == "connected"
    finally:
        for p in (default, own, ignored):
            if p.poll() is None:
                p.kill()
                p.wait()


class Run:
    """`oomscope run --name ref -- python server.py --workers 2`, the
    autostart on: every Python process of the tree gets its agent."""

    def __init__(self, collector, tmp_path, *flags):
        self.port_file = str(tmp_path / "ref.port")
        self.log = open(str(tmp_path / "ref.log"), "w")
        self.proc = subprocess.Popen(
            [oomscope_bin(), "run", "--collector", collector.url, "--name", "ref", "--", sys.executable, SERVER,
             "--port", "0", "--port-file", self.port_file, "--vocab", "8000", "--d-model", "128", "--workers", "2",
             *flags], env=env_for(collector), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start: %s" % self.output())
            time.sleep(0.1)
        self.port = int(open(self.port_file).read())

    def post(self, path, body=None):
        sys.path.insert(0, os.path.dirname(SERVER))
        import drive
        return drive.post(self.port, path, body or {})

    def output(self):
        self.log.flush()
        return open(self.log.name).read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def test_workers_under_oomscope_run_are_one_instance_and_sigterm_stops_it_cleanly(collector, tmp_path):
    run = Run(collector, tmp_path)
    try:
        status, body = run.post("/generate", {"id": "one", "prompt_tokens": 8, "max_tokens": 4})
        assert status == 200 and body["output_tokens"] == 4, body
        agents = wait_for(lambda: len(named(collector, "ref")) >= 4 and named(collector, "ref"), 20)
        hellos = [a["hello"] for a in agents or []]
        roles = sorted((h["runtime"], h["role"], h["rank"]) for h in hellos)
        assert roles == [("pytorch", "server", 0), ("pytorch", "worker", 0), ("pytorch", "worker", 1),
                         ("supervisor", "supervisor", 0)], hellos  # no resource tracker either
        sup = next(h for h in hellos if h["runtime"] == "supervisor")
        api = next(h for h in hellos if h["role"] == "server")
        workers = [h for h in hellos if h["role"] == "worker"]
        assert {h["instance"] for h in hellos} == {sup["agent_id"]}, hellos
        assert {a["instance"] for a in agents} == {sup["agent_id"]}, agents  # and the collector agrees
        assert api["parent_pid"] == sup["pid"] and all(w["parent_pid"] == api["pid"] for w in workers), hellos
        listed = {a["hello"]["agent_id"] for a in collector.cli("agents", "--json") if a["hello"]["name"] == "ref"}
        assert listed == {h["agent_id"] for h in hellos}

        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(60) == 0, run.output()
        states = wait_for(lambda: all(a["state"] == "disconnected" for a in named(collector, "ref"))
                          and named(collector, "ref"), 10)
        assert states and len(states) == 4, "everyone said Goodbye: %s" % named(collector, "ref")
        assert "died unexpectedly" not in run.output()
    finally:
        run.close()


def test_a_killed_worker_takes_the_api_process_down_as_vllms_does(collector, server_factory):
    """Without the autostart (OOMSCOPE_AUTOSTART=0): the server starts each
    worker's agent itself, with its role and rank."""
    s = server_factory("ref-kill", "--workers", "2", "--worker-hold-mb", "64")  # worker 0, at start
    status, _ = s.post("/generate", {"worker": 1, "hold_mb": 160})
    assert status == 200
    workers = get(s.port, "/admin/stats")["workers"]
    rss = [host_rss(w["pid"]) for w in workers]
    assert rss[1] - rss[0] > 64 << 20, rss  # 96 MiB apart: the holds are resident memory
    agents = wait_for(lambda: len(named(collector, "ref-kill")) == 3 and named(collector, "ref-kill"), 20)
    by_pid = {a["hello"]["pid"]: a["hello"] for a in agents or []}
    assert [(by_pid[w["pid"]]["role"], by_pid[w["pid"]]["rank"]) for w in workers] == [("worker", 0), ("worker", 1)]
    assert by_pid[s.proc.pid]["role"] == "server"

    victim = workers[1]["pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    line = "Worker proc EngineWorker-1 died unexpectedly (exit code: -9)"
    assert wait_for(lambda: line in open(s.log.name).read(), 10, every=0.05), open(s.log.name).read()
    assert time.monotonic() - t0 < 1.5, "noticed late"
    assert s.proc.wait(60) == 1
    # The server's Goodbye says it exited 1: no clean stop that would cover
    # the worker's broken stream, however soon after the kill it came.
    server_id = by_pid[s.proc.pid]["agent_id"]
    assert wait_for(lambda: state_of(collector, server_id) == "disconnected", 10)
    assert exit_code_of(collector, server_id) == 1
    assert wait_for(lambda: state_of(collector, by_pid[victim]["agent_id"]) == "lost", 15)
    for pid in (workers[0]["pid"], s.proc.pid):  # the rest stopped cleanly
        assert wait_for(lambda: state_of(collector, by_pid[pid]["agent_id"]) == "disconnected", 10), pid
