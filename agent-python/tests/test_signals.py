"""The agent never changes how a process dies (#33): SIGTERM is handled
natively, so a process (or a forked worker) stuck in a C call dies by it as
it does without the agent, after a Goodbye that names it; the app's own
handlers and SIG_IGN keep working; and multiprocessing children, which end
through os._exit, deliver what they recorded before they go.

Real processes and the test's own collector; a process that hangs is
killed by the test after its deadline and the test fails."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import events, wait_for

#: SYS_futex on x86_64 and aarch64: the main thread waits on a lock.
FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)

#: How long a process may take to die on SIGTERM: the Goodbye waits at most
#: 0.5 s for its ack (signals::SIGNAL_GOODBYE_WAIT), the rest is a loaded CI machine.
DIE_WITHIN_S = 5


def env_for(collector):
    e = {k: v for k, v in os.environ.items() if not k.startswith("OOMSCOPE_")}
    e["OOMSCOPE_AUTOSTART"] = "0"
    return e


def agents_by_id(collector):
    return {a["hello"]["agent_id"]: a for a in collector.agents()}


def in_futex(pid):
    """Whether `pid`'s main thread is blocked in a futex wait (a lock)."""
    try:
        with open("/proc/%d/syscall" % pid) as f:
            return f.read().split()[0] == str(FUTEX)
    except (OSError, IndexError):
        return False


#: Starts the agent (argv[1] == "agent") or not, says its agent id, records
#: 5 requests (with the agent), and blocks its main thread for good in
#: pthread_mutex_lock on a mutex it already holds (a call that never returns,
#: EINTR or not), through ctypes' CDLL (GIL released) or PyDLL (GIL held:
#: the agent's sampler cannot take it).
STUCK = r"""
import ctypes, sys, time
REQUESTS = 5
if sys.argv[1] == "agent":
    import oomscope
    oomscope.start(collector=sys.argv[3], name="stuck-" + sys.argv[2], interval_s=0.1)
    while not oomscope.stats()["connected"]:
        time.sleep(0.02)
    print(oomscope.agent_id(), flush=True)
    for n in range(REQUESTS):  # just before it blocks: the Goodbye delivers them
        with oomscope.request(id="r%d" % n):
            pass
else:
    print("-", flush=True)
lib = (ctypes.PyDLL if sys.argv[2] == "gil" else ctypes.CDLL)(None)
mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
lib.pthread_mutex_lock(mutex)
lib.pthread_mutex_lock(mutex)  # never returns
"""


def stuck_process(collector, agent, gil):
    p = subprocess.Popen([sys.executable, "-c", STUCK, "agent" if agent else "none", gil, collector.url],
                         env=env_for(collector), stdout=subprocess.PIPE, text=True)
    agent_id = p.stdout.readline().strip()
    assert agent_id, "it did not start"
    assert wait_for(lambda: in_futex(p.pid), 10, 0.02), "its main thread never blocked in the lock"
    return p, agent_id


def sigterm_and_wait(p):
    """SIGTERM, then its status and how long it took (SIGKILL past the deadline)."""
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    try:
        status = p.wait(DIE_WITHIN_S)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail("SIGTERM did not end the process within %d s: it needed SIGKILL" % DIE_WITHIN_S)
    return status, time.monotonic() - t0


@pytest.mark.skipif(FUTEX is None, reason="the futex syscall number of this machine is not known here")
@pytest.mark.parametrize("gil", ["released", "gil"])
def test_a_process_stuck_in_c_dies_by_sigterm_as_without_the_agent(collector, gil):
    # Control: without the agent, SIGTERM kills it where it is stuck.
    plain, _ = stuck_process(collector, False, gil)
    plain_status, plain_took = sigterm_and_wait(plain)
    assert plain_status == -signal.SIGTERM

    p, agent_id = stuck_process(collector, True, gil)
    status, took = sigterm_and_wait(p)
    assert status == -signal.SIGTERM, "with the agent it ended with %s, not by SIGTERM" % status
    # The Goodbye is said from the agent's own thread, without the GIL.
    a = wait_for(lambda: agents_by_id(collector).get(agent_id, {}).get("goodbye") and
                 agents_by_id(collector)[agent_id], 10)
    assert a, "no Goodbye: %s" % agents_by_id(collector).get(agent_id)
    assert a["state"] == "disconnected", a["state"]
    assert (a["goodbye"]["reason"], a["goodbye"]["exit_code"]) == ("SIGTERM", 128 + signal.SIGTERM)
    ends = [e for e in events(collector.timeline(agent_id), "request") if not e.get("start")]
    assert len(ends) == 5, "%d of the 5 requests before it blocked arrived" % len(ends)
    time.sleep(1.5)  # past the collector's --lost-grace of 1 s
    assert collector.cli("incidents", "--json") == [], "a clean SIGTERM was taken for a lost agent"
    print("died %.3f s after SIGTERM (without the agent %.3f s; gil %s)" % (took, plain_took, gil))


#: Starts its agent and forks a worker that starts its own (the fork
#: handler), says its agent id through a pipe and blocks for good in a lock
#: it holds; the parent SIGTERMs it once it is blocked and says the status
#: it ended with ("hung" if SIGTERM did not end it within the deadline).
FORKED_STUCK = r"""
import ctypes, os, signal, sys, time
import oomscope
oomscope.start(collector=sys.argv[1], name="fork-parent", interval_s=0.1)
while not oomscope.stats()["connected"]:
    time.sleep(0.02)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    while not oomscope.stats()["connected"]:
        time.sleep(0.02)
    os.write(w, oomscope.agent_id().encode() + b"\n")
    lib = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    lib.pthread_mutex_lock(mutex)
    lib.pthread_mutex_lock(mutex)
    os._exit(3)
child_id = os.read(r, 200).decode().strip()
deadline = time.monotonic() + 10
while open("/proc/%d/syscall" % pid).read().split()[0] != sys.argv[2]:
    assert time.monotonic() < deadline, "the worker never blocked"
    time.sleep(0.02)
os.kill(pid, signal.SIGTERM)
deadline = time.monotonic() + float(sys.argv[3])
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(child_id, os.waitstatus_to_exitcode(status), flush=True)
        break
    if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(child_id, "hung", flush=True)
        break
    time.sleep(0.02)
"""


@pytest.mark.skipif(FUTEX is None, reason="the futex syscall number of this machine is not known here")
def test_a_forked_worker_stuck_in_c_dies_by_sigterm(collector):
    r = subprocess.run([sys.executable, "-c", FORKED_STUCK, collector.url, str(FUTEX), str(DIE_WITHIN_S)],
                       env=env_for(collector), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    child_id, status = r.stdout.split()
    assert status == str(-signal.SIGTERM), "the stuck worker ended with %s, not by SIGTERM" % status
    a = wait_for(lambda: agents_by_id(collector).get(child_id, {}).get("goodbye") and
                 agents_by_id(collector)[child_id], 10)
    assert a, "the worker's agent said no Goodbye: %s" % agents_by_id(collector).get(child_id)
    assert (a["goodbye"]["reason"], a["goodbye"]["exit_code"]) == ("SIGTERM", 128 + signal.SIGTERM)
    assert a["hello"]["labels"].get("parent_pid"), "not the forked worker's agent"
    time.sleep(1.5)
    lost = [i for i in collector.cli("incidents", "--json") if i["agent_id"] == child_id]
    assert lost == [], lost


#: An app's handlers: one installed before the agent starts (called by the
#: agent's, as if it were not there), or after (replaces it). Each counts
#: SIGTERMs and lets the process go on; the second SIGTERM is answered
#: with sys.exit(4), whose exit says Goodbye.
HANDLERS = r"""
import os, signal, sys, time
import oomscope
seen = []
def on_term(signum, frame):
    seen.append(signum)
    print("handled", len(seen), flush=True)
    if len(seen) == 2:
        sys.exit(4)
if sys.argv[2] == "before":
    signal.signal(signal.SIGTERM, on_term)
oomscope.start(collector=sys.argv[1], name="handler-" + sys.argv[2], interval_s=0.1)
if sys.argv[2] == "after":
    signal.signal(signal.SIGTERM, on_term)
while not oomscope.stats()["connected"]:
    time.sleep(0.02)
print(oomscope.agent_id(), flush=True)
while True:
    time.sleep(0.01)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_the_apps_own_sigterm_handler_still_runs(collector, when):
    p = subprocess.Popen([sys.executable, "-c", HANDLERS, collector.url, when], env=env_for(collector),
                         stdout=subprocess.PIPE, text=True)
    try:
        agent_id = p.stdout.readline().strip()
        assert agent_id
        p.send_signal(signal.SIGTERM)
        assert p.stdout.readline().strip() == "handled 1"
        time.sleep(0.8)  # longer than the agent's Goodbye wait: it must not kill it
        assert p.poll() is None, "the process died, though its handler let it go on"
        a = agents_by_id(collector)[agent_id]
        assert a["state"] == "connected" and not a.get("goodbye"), a
        p.send_signal(signal.SIGTERM)
        assert p.stdout.readline().strip() == "handled 2"
        assert p.wait(DIE_WITHIN_S) == 4
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    a = wait_for(lambda: agents_by_id(collector).get(agent_id, {}).get("goodbye") and
                 agents_by_id(collector)[agent_id], 10)
    assert a, "no Goodbye at the handler's exit"
    assert (a["goodbye"]["reason"], a["goodbye"]["exit_code"]) == ("interpreter exit", 4)


def test_sig_ign_before_start_stays_ignored(collector):
    code = ("import signal, sys, time, oomscope\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "oomscope.start(collector=sys.argv[1], name='ignores')\n"
            "from oomscope import _hooks\n"
            "print(_hooks.sigterm, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, collector.url], env=env_for(collector),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().split() == ["ignored", "True"]
        p.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert p.poll() is None, "an ignored SIGTERM killed the process"
    finally:
        p.kill()
        p.wait()


#: Starts its agent and 4 multiprocessing children (fork), each recording
#: REQUESTS requests and returning (child 3 raises after its requests).
#: Each child tells its agent id through a queue; the parent prints, per
#: child, its agent id, its requests and its exit code.
MP = r"""
import multiprocessing as mp, sys, time
import oomscope
REQUESTS = int(sys.argv[2])

def work(i, q):
    while not oomscope.stats()["connected"]:
        time.sleep(0.01)
    for n in range(REQUESTS):
        with oomscope.request(id="c%d-%d" % (i, n)):
            pass
    q.put((i, oomscope.agent_id(), REQUESTS))
    if i == 3:
        raise RuntimeError("child 3 fails after its requests")

if __name__ == "__main__":
    oomscope.start(collector=sys.argv[1], name="mp-parent", interval_s=0.2)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=work, args=(i, q)) for i in range(4)]
    for p in procs:
        p.start()
    told = dict((i, (a, n)) for i, a, n in (q.get(timeout=60) for _ in procs))
    for i, p in enumerate(procs):
        p.join(60)
        print(told[i][0], told[i][1], p.exitcode, flush=True)
"""


def test_multiprocessing_children_deliver_what_they_recorded_before_os_exit(collector):
    requests = 60
    r = subprocess.run([sys.executable, "-c", MP, collector.url, str(requests)], env=env_for(collector),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    children = [line.split() for line in r.stdout.splitlines()]
    assert len(children) == 4, r.stdout
    assert [int(c[2]) for c in children] == [0, 0, 0, 1], children

    def said_goodbye():
        by_id = agents_by_id(collector)
        found = [by_id.get(c[0]) for c in children]
        return found if all(a and a.get("goodbye") for a in found) else None
    agents = wait_for(said_goodbye, 15)
    assert agents, "not every child said Goodbye: %s" % [agents_by_id(collector).get(c[0]) for c in children]
    for (agent_id, recorded, code), a in zip(children, agents):
        assert a["state"] == "disconnected", (agent_id, a["state"])
        assert (a["goodbye"]["reason"], a["goodbye"]["exit_code"]) == ("multiprocessing exit", int(code))
        ends = [e for e in events(collector.timeline(agent_id), "request") if not e.get("start")]
        assert len(ends) == int(recorded), "%s: %d of %s request ends arrived" % (agent_id, len(ends), recorded)
    time.sleep(1.5)
    lost = [i for i in collector.cli("incidents", "--json") if i["agent_id"] in {c[0] for c in children}]
    assert lost == [], lost


@pytest.mark.skipif(FUTEX is None, reason="the futex syscall number of this machine is not known here")
def test_sigterm_kills_within_the_goodbye_bound_with_the_collector_away(tmp_path):
    """Nothing listens at the collector's address: the Goodbye waits at
    most its bound (0.5 s) before the signal kills the process."""
    from conftest import free_port
    code = STUCK.replace("while not oomscope.stats()[\"connected\"]", "while False")
    p = subprocess.Popen([sys.executable, "-c", code, "agent", "released", "http://127.0.0.1:%d" % free_port()],
                         env=env_for(None), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip(), "it did not start"
    assert wait_for(lambda: in_futex(p.pid), 10, 0.02), "its main thread never blocked in the lock"
    status, took = sigterm_and_wait(p)
    assert status == -signal.SIGTERM, status
    print("died %.3f s after SIGTERM with no collector" % took)
