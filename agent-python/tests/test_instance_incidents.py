"""Incidents of a multi-process server (#11), end to end with the real
kernel: the reference server with --workers 2 under `oomscope run --name
ref`, in a memory cgroup of the test's own.

- one worker over the cgroup's limit is one incident, whose default
  `diagnose` names the cgroup, the worker as the victim and the kernel's
  record of the kill;
- a SIGTERM stop is no incident, 10 times out of 10;
- a stop while another cgroup on the host is OOM-killed is no incident
  either, and never a host_ram verdict."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SERVER, oomscope_bin, wait_for
from test_instances import env_for, get, named

MIB = 1 << 20


def own_memory_cgroup():
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if controllers == "memory":
                return "/sys/fs/cgroup/memory" + path
    pytest.skip("no cgroup v1 memory controller on this host")


class Cgroup:
    def __init__(self, name):
        self.path = os.path.join(own_memory_cgroup(), "oomscope-%s-%d" % (name, os.getpid()))
        os.makedirs(self.path, exist_ok=True)

    def read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def join(self):
        """For preexec_fn: moves the starting child into this cgroup."""
        self.write("cgroup.procs", os.getpid())

    def remove(self):
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def start_ref(collector, tmp_path, cgroup, tag):
    port_file = str(tmp_path / ("%s.port" % tag))
    log = open(str(tmp_path / ("%s.log" % tag)), "w")
    proc = subprocess.Popen(
        [oomscope_bin(), "run", "--collector", collector.url, "--name", "ref", "--interval", "100ms", "--",
         sys.executable, SERVER, "--port", "0", "--port-file", port_file, "--vocab", "8000",
         "--d-model", "128", "--workers", "2"],
        env=env_for(collector), stdout=log, stderr=subprocess.STDOUT, preexec_fn=cgroup.join)
    deadline = time.monotonic() + 180
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            log.flush()
            raise RuntimeError("server did not start: %s" % open(log.name).read())
        time.sleep(0.1)
    return proc, int(open(port_file).read()), log


def post(port, body):
    sys.path.insert(0, os.path.dirname(SERVER))
    import drive
    return drive.post(port, "/generate", body)


def test_a_worker_over_the_cgroup_limit_is_one_incident_naming_the_worker(collector, tmp_path):
    cg = Cgroup("worker-kill")
    proc, port, log = start_ref(collector, tmp_path, cg, "kill")
    try:
        workers = get(port, "/admin/stats")["workers"]
        victim = workers[1]["pid"]
        # Room for what runs now and a little more; worker 1 then asks for far more.
        cg.write("memory.limit_in_bytes", int(cg.read("memory.usage_in_bytes")) + 150 * MIB)
        try:
            post(port, {"id": "big", "worker": 1, "hold_mb": 600, "prompt_tokens": 8, "max_tokens": 4})
        except Exception:
            pass  # the worker died mid-request
        assert proc.wait(90) == 1, open(log.name).read()
        assert wait_for(lambda: collector.cli("incidents", "--json"), 20), "no incident"
        time.sleep(3)  # past the lost grace: the worker's lost stream joins the kill
        incidents = collector.cli("incidents", "--json")
        assert len(incidents) == 1, incidents
        for args in (["diagnose", "--json"], ["diagnose", "--agent", "ref", "--json"]):
            d = collector.cli(*args)
            assert d["incident"] == incidents[0]["id"], (args, d["incident"])
            assert d["domain"] == "cgroup", (args, d)
            assert d["victim"]["pid"] == victim, (args, d["victim"], victim)
            assert any("Killed process %d" % victim in e for e in d["evidence"]), d["evidence"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        cg.remove()


def test_a_sigterm_stop_is_no_incident_ten_times_out_of_ten(collector, tmp_path):
    cg = Cgroup("stops")
    try:
        for i in range(10):
            proc, port, log = start_ref(collector, tmp_path, cg, "stop%d" % i)
            status, _ = post(port, {"id": "r%d" % i, "prompt_tokens": 8, "max_tokens": 4})
            assert status == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, open(log.name).read()
            log.close()
        time.sleep(2.5)  # past the collector's lost grace (1 s)
        assert collector.cli("incidents", "--json") == []
        assert not [a for a in named(collector, "ref") if a["state"] == "lost"]
    finally:
        cg.remove()


def test_a_stop_while_another_cgroup_is_oom_killed_is_no_incident(collector, tmp_path):
    ours, other = Cgroup("ours"), Cgroup("tenant")
    proc, port, log = start_ref(collector, tmp_path, ours, "tenant")
    try:
        other.write("memory.limit_in_bytes", 32 * MIB)
        tenant = subprocess.run([sys.executable, "-c", "bytearray(200 << 20)"], preexec_fn=other.join)
        assert tenant.returncode == -signal.SIGKILL, "the other tenant was OOM-killed"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, open(log.name).read()
        time.sleep(2.5)
        assert collector.cli("incidents", "--json") == []
        d = collector.cli("diagnose", "--agent", "ref", "--json")
        assert d["domain"] != "host_ram" and d["domain"] is None, d
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        ours.remove()
        other.remove()
