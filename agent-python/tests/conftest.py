"""Real parts for the Python tests: a real `oomscope collector` process on a
free loopback port with its own SQLite file, the real reference server, and
the real CLI. The binary comes from OOMSCOPE_BIN (scripts/test sets it to
target/debug/oomscope)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SERVER = os.path.join(ROOT, "runtimes", "pytorch-server", "server.py")
DRIVE_DIR = os.path.join(ROOT, "runtimes", "pytorch-server")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "torch-h200")

# The oomscope settings of whoever runs the tests (a collector URL, a spool,
# a name) never reach a process a test launches: each gets its own test's
# collector, or none. runtimes/vllm/tests load this module too.
for _key in [k for k in os.environ if k.startswith("OOMSCOPE_")]:
    if _key not in ("OOMSCOPE_BIN", "OOMSCOPE_LOG"):
        del os.environ[_key]


def oomscope_bin():
    path = os.environ.get("OOMSCOPE_BIN") or os.path.join(ROOT, "target", "debug", "oomscope")
    if not os.access(path, os.X_OK):
        pytest.fail("no oomscope binary at %s: run `cargo build -p oomscope` or set OOMSCOPE_BIN" % path)
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=30.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("process exited with %s before listening" % proc.returncode)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nothing listens on %d after %ss" % (port, timeout))


class Collector:
    def __init__(self, tmp_path, port=None):
        self.port = port or free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.db = str(tmp_path / ("collector-%d.db" % self.port))
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [oomscope_bin(), "collector", "--listen", "127.0.0.1:%d" % self.port, "--db", self.db,
             "--lost-grace", "1s"], stdout=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cli(self, *args, check=True):
        """Runs an `oomscope` verb against this collector; parses --json output."""
        r = subprocess.run([oomscope_bin(), *args, "--collector", self.url], capture_output=True, text=True,
                           timeout=120)
        if check and r.returncode != 0:
            raise AssertionError("oomscope %s failed (%d): %s" % (" ".join(args), r.returncode, r.stderr))
        return json.loads(r.stdout) if "--json" in args else r

    def timeline(self, agent):
        """`oomscope.query.timeline` (the TimelineResponse's serde form),
        flattened for reading: each sample is its `Sample` with its `seq`,
        each event its `Event` with its `seq`, `agent_id` and `kind` (the
        name of its oneof member, None without one)."""
        import oomscope.query
        return flat_timeline(oomscope.query.timeline(self.url, agent))

    def agents(self):
        import oomscope.query
        return oomscope.query.agents(self.url)


@pytest.fixture
def collector(tmp_path):
    c = Collector(tmp_path).start()
    yield c
    c.stop()


class Server:
    """The reference server in its own process, with the agent."""

    def __init__(self, tmp_path, collector, name, *flags, env=None):
        self.port_file = str(tmp_path / ("%s.port" % name))
        self.log = open(str(tmp_path / ("%s.log" % name)), "w")
        e = dict(os.environ, OOMSCOPE_AUTOSTART="0", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "--port", "0", "--port-file", self.port_file, "--collector", collector.url,
             "--name", name, "--vocab", "8000", "--d-model", "128", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start: %s" % open(self.log.name).read())
            time.sleep(0.1)
        self.port = int(open(self.port_file).read())

    def drive(self, requests, **kw):
        sys.path.insert(0, DRIVE_DIR)
        import drive
        return drive.drive(self.port, requests, **kw)

    def post(self, path, body=None):
        sys.path.insert(0, DRIVE_DIR)
        import drive
        return drive.post(self.port, path, body or {})

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: no atexit; the agent is "lost"
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def server_factory(tmp_path, collector):
    servers = []

    def make(name, *flags, env=None):
        s = Server(tmp_path, collector, name, *flags, env=env)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


def flat_timeline(t):
    """A TimelineResponse dict with its samples and events flattened (see
    Collector.timeline)."""
    kinds = EVENT_KINDS

    def event(e):
        body = dict(e["event"] or {}, seq=e["seq"], agent_id=e["agent_id"])
        body["kind"] = next((k for k in kinds if body.get(k) is not None), None)
        return body

    return dict(t, samples=[dict(s["sample"] or {}, seq=s["seq"]) for s in t["samples"]],
                events=[event(e) for e in t["events"]])


# Event's oneof members (proto/proto/oomscope/v1/agent.proto).
EVENT_KINDS = ("phase", "gc", "cache_release", "oom", "process_list", "snapshot", "heap_census",
               "child_start", "child_exit", "stop_forwarded", "request", "kernel_oom_kill",
               "kernel_alloc_failure")


def events(timeline, kind):
    return [e[kind] for e in timeline["events"] if e["kind"] == kind]


def wait_for(predicate, timeout=20.0, every=0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)
