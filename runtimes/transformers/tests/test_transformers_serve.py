"""oomscope on a real `transformers serve` (PyPI transformers 5.x, on CPU)
serving a tiny random Llama under `oomscope run`: the second runtime after
vLLM, and unlike it in what the probe must read: no tokenize endpoint, no
usage in a stream unless asked, streams without `data: [DONE]`, FastAPI's
`{"detail": ...}` errors (400 for an over-context prompt), unknown request
fields rejected, one request at a time without continuous batching, and two
processes: the API server and the model's process it spawns (the engine).

Each start costs ~15 s here; one served instance without continuous
batching is shared by the probe and the clean stop."""

import json
import re
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from conftest import ROOT, harness, vllm_tests

VENV_BIN = os.path.join(ROOT, ".venv-tf", "bin")
MODEL = os.path.join(ROOT, "runtimes", "transformers", "tiny-llama")
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 120
#: After the server exits, incidents are checked past the collector's
#: correlation window (30 s): nothing may join, split or vanish by then.
SETTLED_S = 32

Cgroup = vllm_tests.Cgroup
descendants = vllm_tests.descendants
members = vllm_tests.members


class Serve(vllm_tests.Supervised):
    """`oomscope run --name NAME -- transformers serve MODEL ...` in `cgroup`.
    The model is given on the command line, so it has loaded before the
    server listens: /health answering means ready to generate."""

    what = "transformers serve"
    start_timeout_s = START_TIMEOUT_S
    stop_timeout_s = 60

    def __init__(self, tmp_path, collector, name, cgroup, *flags):
        self.port = harness.free_port()
        e = dict(os.environ)
        e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
                 PATH=VENV_BIN + os.pathsep + e.get("PATH", ""))
        self.launch(tmp_path, collector, name, cgroup,
                    [os.path.join(VENV_BIN, "transformers"), "serve", MODEL, "--device", "cpu",
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--max-model-len", str(MAX_MODEL_LEN), *flags], e)

    def complete(self, prompt, max_tokens=8):
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % self.port, body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def processes(self):
        """pid -> command line of every process under `oomscope run`."""
        out = {}
        for pid in descendants(self.proc.pid):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    out[pid] = f.read().split(b"\0")[:-1]
            except OSError:
                pass
        return {p: [a.decode() for a in argv] for p, argv in out.items() if argv}

    def engine(self):
        """The model's process: the one child that multiprocessing's spawn
        started to run the model (the other spawned helper is its resource
        tracker)."""
        found = {p: argv for p, argv in self.processes().items()
                 if any("spawn_main" in a for a in argv)}
        assert len(found) == 1, self.processes()
        return found.popitem()



def probe(collector, port, agent, *args):
    """`oomscope probe --json` against the server: its report, with its
    progress lines printed for the record."""
    t0 = time.monotonic()
    r = subprocess.run([harness.oomscope_bin(), "probe", "--endpoint", "http://127.0.0.1:%d/v1" % port,
                        "--collector", collector.url, "--agent", agent, "--json", *args],
                       capture_output=True, text=True, timeout=900)
    print("probe exited %d after %.0f s; its progress:\n%s"
          % (r.returncode, time.monotonic() - t0, r.stderr[-6000:]))
    assert r.stdout, r.stderr[-3000:]
    return json.loads(r.stdout)


def steps(report, suite):
    return [s for su in report["suites"] if su["suite"] == suite for s in su["steps"]]


def show_steps(report):
    for su in report["suites"]:
        print("suite %s: %s %s" % (su["suite"], su["status"], su.get("reason") or ""))
        for s in su["steps"]:
            print("  %-14s words %-5s tokens %-5s x%-3s ok %s refused %s rejected %s errors %s timeouts %s"
                  " effective %s (%s) failure %s"
                  % (s["label"], s["prompt_words"], s["prompt_tokens"], s["concurrency"], s["ok"],
                     s["refused"], s["rejected"], s["server_errors"], s["timeouts"],
                     s.get("effective_concurrency"), s.get("effective_method"), s.get("failure")))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `transformers serve` without continuous batching, answered once."""
    tmp = tmp_path_factory.mktemp("tfserve")
    collector = harness.Collector(tmp).start()
    cg = Cgroup("tfserve")
    s = Serve(tmp, collector, "tfserve", cg)
    try:
        assert s.wait_ready(), s.log()[-4000:]
        assert s.complete("hello world")["choices"]
        yield collector, s, cg
    finally:
        s.stop()
        collector.stop()
        cg.remove()


def test_the_api_server_and_its_engine_are_members_of_one_instance(served):
    collector, s, _ = served
    engine, argv = s.engine()
    procs = s.processes()
    server = [p for p, a in procs.items() if any(x.endswith("/transformers") for x in a)]
    assert len(server) == 1, procs
    # The engine is the API server's child, as spawned.
    with open("/proc/%d/stat" % engine) as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == server[0], (engine, procs)
    agents = harness.wait_for(lambda: [a for a in members(collector, "tfserve")
                                       if a["hello"]["pid"] in (server[0], engine)], 10)
    assert {a["hello"]["pid"] for a in agents} == {server[0], engine}, members(collector, "tfserve")
    assert len({a["instance"] for a in members(collector, "tfserve")}) == 1, members(collector, "tfserve")


def test_the_probe_finds_the_context_limit_and_serialization(served):
    """`oomscope probe` against transformers serve without continuous
    batching: the context in tokens within 5 % of --max-model-len, from the
    server's own refusals (400, `{"detail": ...}`) and usage counts, and
    concurrency 1: it serves one request at a time."""
    collector, s, _ = served
    p = probe(collector, s.port, "tfserve", "--suite", "long-context,concurrency",
              "--max-context", "4096", "--typical-context", "128", "--max-concurrency", "4",
              "--output-tokens", "8", "--seed", "31")
    show_steps(p)
    print("envelope:", json.dumps(p["envelope"], indent=1))
    print("server:", p["server"], "warnings:", p.get("warnings"))
    # What the server said of the probe's requests (its refusals, their sizes).
    print("server log:\n" + "\n".join(line for line in s.log().splitlines()
                                       if "POST" in line or "tokens" in line)[-4000:])
    env = p["envelope"]
    ctx = env["max_context_at_concurrency_1"]
    # The server refuses a prompt whose tokens and max_tokens pass 2048:
    # the bisection ends within 5 % below it, never above it.
    assert ctx["unit"] == "tokens", ctx
    assert 0.95 * MAX_MODEL_LEN <= ctx["value"] <= MAX_MODEL_LEN, ctx
    assert ctx["bounded_by"] == "max_context_setting", ctx
    # Every long-context step that the server answered counted tokens as
    # the server does: its usage, not words.
    answered = [st for st in steps(p, "long-context") if st["ok"]]
    assert answered and all(st["prompt_tokens"] for st in answered), answered

    conc = env["max_concurrency_at_typical_context"]
    assert conc["value"] == 1 and conc["bounded_by"] == "serialized", conc
    assert conc["offered"] and conc["offered"] > 1, conc
    ramp = [st for st in steps(p, "concurrency") if st["concurrency"] > 1]
    assert ramp and all(st["server_errors"] == 0 and st["rejected"] == 0 for st in ramp), ramp
    assert p["prompts"]["distinct"] == p["prompts"]["sent"], p["prompts"]


def test_a_clean_sigterm_is_no_incident(served):
    collector, s, _ = served
    engine, _ = s.engine()
    code = s.stop()
    # Uvicorn shuts down cleanly, then raises the SIGTERM again to end with
    # its status (143); the engine exits once its parent has.
    assert code in (0, 128 + signal.SIGTERM), (code, s.log()[-3000:])
    assert not os.path.exists("/proc/%d" % engine), "the engine outlived the stop"
    time.sleep(3)  # past the collector's lost grace (1 s)
    assert collector.cli("incidents", "--json") == []
    states = {a["hello"]["pid"]: a["state"] for a in members(collector, "tfserve")}
    assert states and "lost" not in states.values(), states


def test_continuous_batching_serves_a_batch_bounded_by_its_kv_blocks(tmp_path):
    """With --continuous-batching and a KV cache of 48 blocks of 16 tokens
    (768 tokens: always set, else it sizes the cache from RAM), requests of
    ~128 + 8 tokens need 8-9 blocks each: at most 5-6 run at once, more than 1."""
    blocks, block = 48, 16
    collector = harness.Collector(tmp_path).start()
    cg = Cgroup("tfserve-cb")
    s = Serve(tmp_path, collector, "tfserve-cb", cg, "--continuous-batching",
              "--cb-num-blocks", str(blocks), "--cb-block-size", str(block))
    try:
        assert s.wait_ready(), s.log()[-4000:]
        assert s.complete("hello world")["choices"]
        p = probe(collector, s.port, "tfserve-cb", "--suite", "concurrency", "--typical-context", "128",
                  "--max-concurrency", "16", "--output-tokens", "8", "--seed", "31")
    finally:
        s.stop()
        collector.stop()
        cg.remove()
    show_steps(p)
    print("envelope:", json.dumps(p["envelope"], indent=1))
    conc = p["envelope"]["max_concurrency_at_typical_context"]
    # Blocks are taken as a sequence grows: as many run at once as fit at
    # their prompts, until their answers need one more block each.
    # Requests in service are counted from the client's side (first token
    # to stream end): one ending as the next starts can count twice.
    fits = blocks // -(-conc["context_tokens"] // block)
    assert 2 <= conc["value"] <= fits + 1, (conc, fits)
    assert conc["offered"] > conc["value"], conc
    # transformers serve reports no load: the pool is read from its command
    # line, and it is the pool that held the batch, not a cap on sequences.
    assert conc["bounded_by"] == "kv_pool", conc
    held = [int(m.group(1)) for e in conc["evidence"]
            if "--cb-num-blocks 48 blocks of --cb-block-size 16 tokens" in e
            for m in [re.search(r"(\d+) at their prompts", e)] if m]
    assert held == [fits] and abs(held[0] - conc["value"]) <= 1, (held, fits, conc)


def test_a_sigkill_of_the_engine_is_one_incident_naming_it(tmp_path):
    collector = harness.Collector(tmp_path).start()
    cg = Cgroup("tfserve-kill")
    s = Serve(tmp_path, collector, "tfserve-kill", cg)
    try:
        assert s.wait_ready(), s.log()[-4000:]
        assert s.complete("hello world")["choices"]
        engine, argv = s.engine()
        os.kill(engine, signal.SIGKILL)
        t0 = time.monotonic()
        # The API server may serve on (it answers errors) or exit: either way
        # the engine's death is the incident.
        try:
            code = s.proc.wait(20)
        except subprocess.TimeoutExpired:
            code = None
        print("SIGKILL of the engine (pid %d); oomscope run: %s" % (engine, code))
        time.sleep(max(0.0, t0 + 3 - time.monotonic()))
        early = collector.cli("incidents", "--json")
        code = s.stop()
        time.sleep(max(0.0, t0 + SETTLED_S - time.monotonic()))
        incs = collector.cli("incidents", "--json")
        d = collector.cli("diagnose", incs[0]["id"], "--json") if incs else None
    finally:
        s.stop()
        collector.stop()
        cg.remove()
    print("incidents:", [(i["id"], i["kind"], [x["kind"] for x in i["parts"]], i["domain"]) for i in incs])
    print("verdict: domain %s, victim %s" % (d and d["domain"], d and d["victim"]))
    assert len(incs) == 1, incs
    root = incs[0]
    assert [i["id"] for i in early] == [root["id"]], (early, incs)
    assert root["kind"] == "member_died" and root["domain"] == "external_kill", root
    assert d["incident"] == root["id"] and d["domain"] == "external_kill", d
    victim = d["victim"]
    assert victim["pid"] == engine, (victim, engine)
    assert victim["status"]["signal"] == signal.SIGKILL, victim
    # Named by its command line, read while it lived: the title of a
    # spawned Python process is only "python".
    command = victim["command"]
    command = command if isinstance(command, str) else " ".join(command or [])
    assert "spawn_main" in command, (victim, argv)
