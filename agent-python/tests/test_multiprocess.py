"""Right verdicts inside multi-process servers (#28), the agent's side: a
forked child never keeps its parent's connection (a killed parent is lost at
once, however long the child lives); an explicit ``oomscope.start()`` wins
over the autostart; the autostart joins only real servers.

Every process here talks to the test's own collector (conftest's, with
``--lost-grace 1s``) and nothing else."""

import os
import signal
import subprocess
import sys
import time

from conftest import wait_for
from test_instances import env_for, named, state_of

#: conftest's collector declares an agent lost this long after its stream breaks.
LOST_GRACE_S = 1.0


def socket_inodes(pid):
    """The inodes of the sockets `pid` holds open."""
    out = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            out.add(int(link[len("socket:["):-1]))
    return out


def tcp_inodes_to(port, pid):
    """The inodes of the TCP sockets (v4 and v6) whose remote port is `port`,
    from /proc/<pid>/net/tcp*: every socket of the network namespace."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open("/proc/%d/net/%s" % (pid, table)) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and int(fields[9]):
                found.add(int(fields[9]))
    return found


#: Starts its agent, waits until it is connected, forks a child that only
#: sleeps (the agent's fork handler gives it an agent of its own), and says
#: both pids and its agent id.
FORKER = """
import os, time, oomscope
oomscope.start(collector=%r, name="forking-parent", interval_s=0.2)
while not oomscope.stats()["connected"]:
    time.sleep(0.05)
pid = os.fork()
if pid == 0:
    time.sleep(30)
    os._exit(0)
print(oomscope.agent_id(), pid, flush=True)
time.sleep(60)
"""


def test_a_forked_child_keeps_no_connection_and_a_killed_parent_is_lost_at_once(collector):
    env = dict(env_for(collector), OOMSCOPE_AUTOSTART="0")
    parent = subprocess.Popen([sys.executable, "-c", FORKER % collector.url], env=env, stdout=subprocess.PIPE,
                              text=True)
    child = None
    try:
        agent_id, child = parent.stdout.readline().split()
        child = int(child)
        # The agent's "connected" is its stream opening; the collector lists
        # it once the Hello on that stream is stored, a moment later.
        assert wait_for(lambda: state_of(collector, agent_id) == "connected", 10, 0.05), \
            state_of(collector, agent_id)
        # The parent's stream is a socket to the collector's port that the
        # parent holds; the child must not hold it too (its own agent's
        # connection is another socket).
        time.sleep(0.5)
        to_collector = tcp_inodes_to(collector.port, parent.pid)
        parents = socket_inodes(parent.pid) & to_collector
        assert parents, "the parent holds no connection to the collector"
        assert not socket_inodes(child) & parents, "the child kept its parent's connection to the collector"

        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        killed = time.monotonic()
        gone = wait_for(lambda: state_of(collector, agent_id) in ("lost", "disconnected"), LOST_GRACE_S + 4, 0.1)
        waited = time.monotonic() - killed
        assert gone, "the killed parent still reads %r after %.1f s" % (state_of(collector, agent_id), waited)
        os.kill(child, 0)  # the child still lives: it did not keep the stream alive
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


#: With the autostart's agent running, the app's own start(): prints what
#: it returned, its agent id before and after, and its pid, then sleeps
#: (checked while alive).
RESTART = """
import os, sys, time, oomscope
assert oomscope.is_running(), "no autostarted agent"
try:
    oomscope.start(interval_s="soon")
    raise SystemExit("a bad value was accepted")
except ValueError:
    assert oomscope.is_running(), "a bad value stopped the autostart's agent"
%s
before = oomscope.agent_id()
returned = oomscope.start(collector=%r, **%r)
while oomscope.stats()["held"] or not oomscope.stats()["connected"]:
    time.sleep(0.05)
assert oomscope.flush(10)
print(returned, before, oomscope.agent_id(), os.getpid(), flush=True)
time.sleep(30)
"""


def test_an_explicit_start_reconfigures_the_autostarted_agent(collector):
    """Three cases: the autostart's agent still held (replaced without a
    trace), already heard with only a new identity (a new Hello, same id),
    and already heard with a setting it cannot change (Goodbye, then a new
    agent). Each ends with one live agent for its pid, under the app's name."""
    cases = {
        # name: (what runs before start(), start()'s arguments)
        "held": ("", dict(name="app-name", role="worker")),
        "heard": ("oomscope.flush(10)", dict(name="app-renamed", role="worker", rank=2)),
        "restarted": ("oomscope.flush(10)", dict(name="app-restarted", interval_s=0.1)),
    }
    procs = {}
    try:
        for case, (before, kwargs) in cases.items():
            # The autostart's own name would be "python" (sys.argv[0] is -c).
            procs[case] = subprocess.Popen([sys.executable, "-c", RESTART % (before, collector.url, kwargs)],
                                           env=env_for(collector), stdout=subprocess.PIPE, text=True)
        said = {case: p.stdout.readline().split() for case, p in procs.items()}
        assert all(len(s) == 4 for s in said.values()), said

        def wrong(listing):
            """What is not yet as it should be ({} when all is)."""
            out = {}
            for case, (returned, before, after, pid) in said.items():
                kwargs = cases[case][1]
                mine = [a for a in listing if a["hello"]["pid"] == int(pid)]
                live = [a["hello"] for a in mine if a["state"] == "connected"]
                old = [a for a in mine if a["hello"]["agent_id"] == before]
                want = [(after, kwargs["name"], kwargs.get("role", "server"), kwargs.get("rank", 0))]
                ok = returned == "True" and [(h["agent_id"], h["name"], h["role"], h["rank"]) for h in live] == want
                if case == "held":  # never heard: no trace of the autostart's agent
                    ok = ok and before != after and len(mine) == 1
                elif case == "heard":  # a new Hello, same agent
                    ok = ok and before == after and len(mine) == 1
                else:  # Goodbye, then a new agent
                    ok = ok and before != after and len(mine) == 2 and old[0]["state"] == "disconnected" \
                        and old[0]["goodbye"]["reason"] == "reconfigured"
                if not ok:
                    out[case] = (said[case], mine)
            return out

        assert wait_for(lambda: not wrong(collector.agents()), 10), wrong(collector.agents())
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_autostart_joins_only_servers(collector):
    """With OOMSCOPE_COLLECTOR exported, a process that only lives (a load
    generator) never joins; one that marks a request does, and so does one
    under a supervisor (`oomscope run`'s environment), by lasting alone."""
    lasting = "import time, oomscope; time.sleep(4); print(oomscope.stats()['held'], flush=True)"
    request = "import time, oomscope\nwith oomscope.request(id='r1'):\n    pass\n" + lasting.replace("; ", "\n")
    runs = {
        "plain": (lasting, {}),
        "marked": (request, {}),
        "supervised": (lasting, {"OOMSCOPE_SUPERVISOR_AGENT": "supervisor-test-host-1-1"}),
    }
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env=env_for(collector, OOMSCOPE_NAME=name, **extra),
                                    stdout=subprocess.PIPE, text=True)
             for name, (code, extra) in runs.items()}
    out = {name: p.communicate(timeout=60)[0].strip() for name, p in procs.items()}
    assert {name: p.returncode for name, p in procs.items()} == dict.fromkeys(runs, 0), out
    # Held to the end, and alive: its agent ran the whole time.
    assert out == {"plain": "True", "marked": "False", "supervised": "False"}, out
    assert wait_for(lambda: named(collector, "marked") and named(collector, "supervised"), 10), collector.agents()
    assert named(collector, "plain") == [], "a process that only lived joined the collector"
    marked = named(collector, "marked")
    assert len(marked) == 1 and marked[0]["samples"] >= 5, marked
