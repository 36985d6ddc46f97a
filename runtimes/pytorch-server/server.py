"""The oomscope reference PyTorch inference server.

A small HTTP server around a tiny decoder-only transformer (random weights;
on the GPU when there is one), with real batching of concurrent requests and a
KV cache per sequence. Switches reproduce the incidents of the design:

  --leak-responses   keep every response object (its logits tensor inside)
  --host-leak        keep a CPU copy of every response's logits
  --gc-cycles        leave each response in a reference cycle, with automatic
                     gc off (as latency-tuned servers run); POST /admin/gc
                     collects
  --fragment         interleave long- and short-lived tensors of mixed sizes
  --max-active N     cap active sequences (the rest queue)
  --max-context N    refuse requests longer than N tokens
  --kv-dtype T       keep the KV cache in float32 or bfloat16 (halved, rounded:
                     the answers' numerics change)
  --slow-prefill-ms-per-token MS  a slow server (a big model on a small
                     machine): the engine sleeps MS ms per prompt token
                     before each prefill, holding the engine meanwhile (with
                     --max-active 1, one request at a time, as a serializing
                     server is). A client that gives up does not stop it:
                     the request runs to its end, as on a server that never
                     notices a dropped connection
  --memory-cap BYTES torch.cuda.set_per_process_memory_fraction, so a GPU OOM
                     comes early and safely
  --workers N        multi-process, as vLLM runs: this process serves HTTP and
                     N engine worker processes (multiprocessing "spawn") load
                     the model and generate; each has its own agent (role
                     "worker", its rank). A worker that dies takes the server
                     down (exit 1, after "Worker proc ... died unexpectedly");
                     SIGTERM stops the workers, then exits 0
  --worker-hold-mb MB  worker --worker-hold-rank (0) holds MB of host memory
                     once loaded (touched pages, kept for good)
  --layout forked-api  the other common multi-process layout: this (main)
                     process starts a multiprocessing Manager (a shared dict
                     of stats: pids, requests served), forks an API process
                     (multiprocessing "fork") that serves HTTP, and spawns one
                     inference worker ("spawn") that loads the model and
                     generates; the API process passes it requests over a
                     pipe. Agents: the API process names itself role
                     "api_server", the worker "worker" (its own
                     oomscope.start, as apps call it), the Manager "manager",
                     the main process "launcher". The main process only
                     watches: when the worker (or the API process) dies, it
                     SIGKILLs the other, shuts the Manager down and exits 1
                     (after "... died unexpectedly"); SIGTERM/SIGINT stop the
                     API process, then the worker, then the Manager: exit 0.
                     The API process and the Manager die with the main
                     process (PR_SET_PDEATHSIG), however it dies
  --worker-leak-mb-per-request MB  with --workers or --layout forked-api:
                     the worker keeps MB MiB of CPU torch tensors (written,
                     so resident) per request it serves, in a module-level
                     list, so that a memory limit kills it after enough
                     requests

How it answers, for probing clients against behaviours of other servers:

  --streams          answer `stream: true` with an event stream (a chunk a
                     token, the last with finish_reason "length"; usage in a
                     last chunk with `stream_options.include_usage`; then
                     `data: [DONE]`); without it `stream` is ignored (JSON)
  --empty-stream-over-context  a prompt over --max-context is answered 200
                     with nothing generated: streamed, an event stream that
                     carries no event; else a JSON body with no choices and no
                     usage (as a llama.cpp-based server answered); implies
                     --streams
  --tokens-per-word N  the tokenizer makes N tokens of each prompt word;
                     /tokenize, usage and the --max-context check count them
  --no-tokenize      POST /tokenize answers 404 and streams carry no usage,
                     so a client must count tokens from non-streamed usage
  --fastapi-shapes   as `transformers serve` answers: errors are FastAPI's
                     {"detail": ...} (400 over --max-context), a request
                     field outside OpenAI's is refused with pydantic's 422
                     (`extra_forbidden`), and streams end without
                     `data: [DONE]` (the connection closes after the finish
                     reason)
  --no-usage         no answer carries usage (with --no-tokenize the server
                     counts tokens nowhere a client can read)
  --refusal-counts   a prompt over --max-context is refused in llama-cpp-
                     python's words, which state the prompt's count:
                     "Requested tokens (N) exceed context window of M"

Worker processes are titled (comm, what ps and the kernel's OOM report show)
EngineWorker-N (--workers) or InferWorker-0, APIServer and SyncManager
(--layout forked-api).

A well-run front door (serving.py), each part with a switch to turn it off
so that `oomscope probe` can show it catches a server without it:

  --max-active/--max-queue/--max-total-tokens  admission caps: 429 beyond them
  (off: --no-admission-caps);  readiness: 503 until loaded (off:
  --no-readiness-gate);  gradual restore over --restore-seconds after
  readiness (off: --no-gradual-restore);  Idempotency-Key replay from a file
  that survives restarts (off: --no-idempotency).

HTTP: POST /generate {"id", "prompt_tokens", "max_tokens"} ->
{"id", "output_tokens", "latency_ms"} (507 on out-of-memory, 400 on a bad
request; with workers also "worker": the rank to serve it, else round
robin, and "hold_mb": that worker first holds this much more host memory);
OpenAI-compatible GET /v1/models and POST /v1/completions {"model",
"prompt", "max_tokens", "stream"} (one word of the prompt is one token, or
--tokens-per-word; 500 with the error text on out-of-memory) and POST
/v1/chat/completions {"messages", ...} (the contents joined are the prompt;
with --chat-only the only one); POST /tokenize
{"prompt"} -> {"count", "tokens"} (vLLM's shape); GET /health (200 once ready, else 503);
GET /admin/stats (with workers, "workers": each one's rank and pid; with
--layout forked-api, "shared": the Manager's dict); POST /admin/gc;
POST /admin/census; POST /admin/agent {"on": bool} starts or stops the
oomscope agent in this process (overhead benchmarks).

    python server.py --port 8000 [--collector http://127.0.0.1:7433] [--no-agent]
"""

import argparse
import collections
import contextlib
import gc
import itertools
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.managers
import os
import random
import signal
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyDecoder, cache_bytes  # noqa: E402
from serving import Admission, IdempotencyStore, Refusal, completion_events, sse, tokenize  # noqa: E402

try:
    import oomscope
except ImportError:  # the server runs without the agent too
    oomscope = None

#: What --leak-responses and --host-leak keep: module globals, as a careless
#: app keeps a response log.
RESPONSE_LOG = []
HOST_COPIES = []
#: What a worker holds for hold_mb and --worker-hold-mb: host memory kept for
#: good, as a leaking engine keeps it.
HELD = []
#: Held memory grows a chunk at a time, so a memory limit is crossed part
#: way through, as a growing process crosses it.
HOLD_CHUNK = 16 << 20
PAGE = 4096
#: What --worker-leak-mb-per-request keeps: tensors, one per request, for good.
LEAKED = []


class Completion:
    """A finished generation, as an app might keep it: tokens and scores."""

    def __init__(self, request_id, tokens, logits):
        self.request_id = request_id
        self.tokens = tokens
        self.logits = logits


class Sequence:
    def __init__(self, request_id, prompt, max_tokens):
        self.id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.cache = {}
        self.out = []
        self.logits = []
        self.done = threading.Event()
        self.error = None


class Engine:
    """The scheduler: admits queued sequences (up to --max-active), prefills
    each, then decodes all active sequences together, one token a step."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        self.device = next(model.parameters()).device
        self.queue = collections.deque()
        self.active = []
        self.cv = threading.Condition()
        self.long_lived = collections.deque(maxlen=args.fragment_keep)
        self.rng = random.Random(0)
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    def submit(self, seq):
        with self.cv:
            self.queue.append(seq)
            self.cv.notify()

    def _run(self):
        while True:
            with self.cv:
                while not self.queue and not self.active:
                    self.cv.wait()
                cap = self.args.max_active or 1 << 30
                new = []
                while self.queue and len(self.active) + len(new) < cap:
                    new.append(self.queue.popleft())
                queued = len(self.queue)
            try:
                with torch.no_grad():
                    for seq in new:
                        self._step([seq], prefill=True)
                        self.active.append(seq)
                    if self.active:
                        self._step(self.active, prefill=False)
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                for seq in new + self.active:
                    if not seq.done.is_set():
                        seq.error = e
                        seq.cache = {}
                        seq.done.set()
                self.active = [s for s in self.active if not s.done.is_set()]
                continue
            batch = len(self.active)
            finished = [s for s in self.active if len(s.out) >= s.max_tokens]
            self.active = [s for s in self.active if len(s.out) < s.max_tokens]
            self._report(queued, batch)
            for seq in finished:
                self._finish(seq)

    def _step(self, seqs, prefill):
        if prefill:
            if self.args.slow_prefill_ms_per_token:
                time.sleep(self.args.slow_prefill_ms_per_token * len(seqs[0].prompt) / 1e3)
            tokens = torch.tensor([seqs[0].prompt], device=self.device)
        else:
            tokens = torch.tensor([[s.out[-1]] for s in seqs], device=self.device)
        logits = self.model(tokens, [s.cache for s in seqs])[:, -1, :]
        nxt = logits.float().argmax(-1).tolist()
        for s, t, row in zip(seqs, nxt, logits):
            if prefill or len(s.out) < s.max_tokens:
                s.out.append(int(t))
                s.logits.append(row)
        if self.args.fragment:
            self._fragment()

    def _fragment(self):
        """Mixed sizes, every other one kept for a while: cached free blocks
        end up split between long-lived neighbours."""
        unit = self.args.fragment_kib * 1024
        for i in range(4):
            t = torch.empty(unit * self.rng.randint(1, 16), dtype=torch.uint8, device=self.device)
            if i % 2 == 0:
                self.long_lived.append(t)

    def _report(self, queued, batch):
        """After a step: what runs now (without the finished), and the step's
        batch (with them), which the agent keeps at its peak between samples:
        request ends are sampled at exactly the steps that finished some."""
        if oomscope is None:
            return
        kv = sum(cache_bytes(s.cache) for s in self.active)
        oomscope.set_context(
            active_sequences=len(self.active), queued=queued, batch_size=batch,
            active_tokens=sum(len(s.prompt) + len(s.out) for s in self.active), kv_cache_bytes=kv)

    def _finish(self, seq):
        logits = torch.stack(seq.logits)
        # Each generated token's log-probability, for `logprobs` in the answer.
        picked = torch.tensor(seq.out, device=logits.device).unsqueeze(-1)
        seq.token_logprobs = torch.log_softmax(logits.float(), -1).gather(-1, picked).squeeze(-1).tolist()
        completion = Completion(seq.id, list(seq.out), logits)
        if self.args.leak_responses:
            RESPONSE_LOG.append(completion)
        if self.args.host_leak:
            HOST_COPIES.append(logits.detach().to("cpu", copy=True))
        if self.args.gc_cycles:
            completion.self_ref = completion  # garbage only the cycle collector frees
        seq.cache, seq.logits = {}, []
        seq.done.set()


#: The /v1/completions request fields a strict server (--fastapi-shapes) knows.
OPENAI_FIELDS = {"model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p", "n",
                 "stop", "seed", "user", "echo", "logprobs", "presence_penalty", "frequency_penalty"}
#: The /v1/chat/completions fields it knows: `messages` for `prompt`, and
#: `logprobs` a boolean with `top_logprobs`, as OpenAI's chat API has them.
CHAT_FIELDS = (OPENAI_FIELDS - {"prompt", "echo"}) | {"messages", "top_logprobs"}


def make_handler(state, args):
    """`state` holds the engine once the model is loaded (None before), the
    admission counters, the idempotency store and the served model name."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _reply(self, code, body, headers=()):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, chunks):
            """An event stream of `chunks` (none: a 200 stream that carries no event), then the connection closes."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(sse(chunks))
            self.close_connection = True

        def _refuse(self, r, openai=False):
            body = {"error": {"message": r.message, "type": "overloaded" if r.status == 429 else "unavailable",
                              "code": r.status}} if openai else {"error": r.message}
            self._reply(r.status, body, [("Retry-After", str(r.retry_after))])

        def do_GET(self):
            engine = state["engine"]
            if self.path == "/health":
                if state["admission"].ready():
                    self._reply(200, {"ok": True, "device": str(engine.device)})
                else:
                    self._reply(503, {"ok": False, "loading": True}, [("Retry-After", "1")])
            elif self.path in ("/v1/models", "/v1/models/"):
                self._reply(200, {"object": "list", "data": [
                    {"id": state["model_name"], "object": "model", "owned_by": "oomscope-reference"}]})
            elif self.path == "/admin/stats":
                adm = state["admission"]
                stats = {"agent": oomscope.stats() if oomscope else None,
                         "response_log": len(RESPONSE_LOG), "host_copies": len(HOST_COPIES),
                         "in_flight": adm.in_flight, "in_flight_cap": adm.cap_now(), "ready": adm.ready()}
                if isinstance(engine, RemoteEngine):
                    stats["workers"] = engine.describe()
                if state.get("shared") is not None:
                    stats["shared"] = dict(state["shared"])
                self._reply(200, stats)
            else:
                self._reply(404, {"error": "no such path"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(n) or b"{}")
            except ValueError as e:
                return self._reply(400, {"error": "bad JSON: %s" % e})
            if self.path == "/generate":
                return self._generate(body)
            if self.path in ("/v1/completions", "/v1/completions/") and not args.chat_only:
                return self._completions(body)
            if self.path in ("/v1/chat/completions", "/v1/chat/completions/"):
                return self._completions(body, chat=True)
            if self.path == "/tokenize" and not args.no_tokenize:
                # vLLM's shape: {"prompt"} -> {"count", "tokens"}.
                ids = tokenize(body.get("prompt", ""), state["vocab"], args.tokens_per_word)
                return self._reply(200, {"count": len(ids), "tokens": ids})
            if self.path == "/admin/gc":
                collected = gc.collect()
                census = oomscope.census() if oomscope and oomscope.is_running() else None
                return self._reply(200, {"collected": collected, "census": census is not None})
            if self.path == "/admin/census":
                census = oomscope.census() if oomscope and oomscope.is_running() else None
                return self._reply(200, {"census": census})
            if self.path == "/admin/agent":
                if oomscope is None:
                    return self._reply(409, {"error": "started with --no-agent"})
                if body.get("on") and not oomscope.is_running():
                    oomscope.start(collector=args.collector, name=agent_name(args))
                elif not body.get("on") and oomscope.is_running():
                    oomscope.stop("agent switched off over /admin/agent")
                return self._reply(200, {"running": oomscope.is_running()})
            self._reply(404, {"error": "no such path"})

        def _admit(self, tokens, openai):
            """The front door: readiness, then admission. Returns the engine, or None after refusing."""
            adm = state["admission"]
            if args.readiness_gate and not adm.ready():
                self._refuse(Refusal(503, 1, "not ready: the model is still loading"), openai)
                return None
            try:
                adm.enter(tokens)
            except Refusal as r:
                self._refuse(r, openai)
                return None
            return True

        def _run(self, rid, prompt, max_tokens, worker=None, hold_mb=0):
            """Generates; returns (output tokens, None) or (None, exception)."""
            engine = state["engine"]
            if engine is None:
                # No readiness gate: the request got in before the model exists.
                return None, RuntimeError("model not loaded yet")
            seq = Sequence(rid, prompt, max_tokens)
            seq.worker, seq.hold_mb = worker, hold_mb  # for a WorkerPool; the Engine ignores them
            try:
                with _request(rid, len(prompt), max_tokens) as r:
                    engine.submit(seq)
                    seq.done.wait()
                    if seq.error is not None:
                        raise seq.error
                    if r is not None:
                        r.output_tokens = len(seq.out)
            except Exception as e:  # noqa: BLE001
                state["count"]("failed")
                return None, e
            state["count"]("served")
            self.token_logprobs = getattr(seq, "token_logprobs", None)
            return list(seq.out), None

        def _completions(self, body, chat=False):
            """/v1/completions, or with `chat` /v1/chat/completions: the
            messages' contents, joined, are the prompt (no chat template: a
            tokenizer of words has none) and the answer is a message."""
            if args.fastapi_shapes:
                # A strict schema, as FastAPI + pydantic with extra="forbid" answers.
                extra = sorted(set(body) - (CHAT_FIELDS if chat else OPENAI_FIELDS))
                if extra:
                    return self._reply(422, {"detail": [
                        {"type": "extra_forbidden", "loc": ["body", k], "msg": "Extra inputs are not permitted",
                         "input": body[k]} for k in extra]})
            model = body.get("model")
            if model not in (None, "", state["model_name"]):
                return self._reply(404, {"error": {"message": "model %r not found; this server serves %r" % (
                    model, state["model_name"]), "type": "not_found", "code": 404}})
            prompt = body.get("prompt", "")
            if chat:
                prompt = " ".join(str(m.get("content") or "") for m in body.get("messages") or []
                                  if isinstance(m, dict))
            # Chat answers are never streamed here.
            stream = bool(body.get("stream")) and args.streams and not chat
            try:
                max_tokens = int(body.get("max_tokens") or 16)
            except (TypeError, ValueError):
                return self._reply(400, {"error": {"message": "max_tokens must be an integer", "type": "invalid_request_error"}})
            ids = tokenize(prompt, state["vocab"], args.tokens_per_word)
            if max_tokens < 1:
                return self._reply(400, {"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error"}})
            over = args.max_context and len(ids) + max_tokens > args.max_context
            if over and args.empty_stream_over_context:
                # As a llama.cpp-based server did: 200, and nothing generated.
                if stream:
                    return self._stream([])
                return self._reply(200, {"id": "cmpl-%s" % os.urandom(8).hex(), "object": "text_completion",
                                         "created": int(time.time()), "model": state["model_name"], "choices": []})
            if over:
                text = "context %d > --max-context %d" % (len(ids) + max_tokens, args.max_context)
                if args.refusal_counts:
                    text = "Requested tokens (%d) exceed context window of %d" % (len(ids), args.max_context)
                if args.fastapi_shapes:
                    return self._reply(400, {"detail": text})
                return self._reply(400, {"error": {"message": text, "type": "context_length_exceeded"}})
            key = self.headers.get("Idempotency-Key") if args.idempotency else None
            tokens = len(ids) + max_tokens
            if key:
                stored, ev = state["idempotency"].begin(key)
                if stored is not None:
                    return self._reply(200, stored, [("X-Idempotent-Replay", "true")])
            response = None
            try:
                if self._admit(tokens, openai=True) is None:
                    return
                try:
                    out, err = self._run("cmpl-%x" % time.monotonic_ns(), ids, max_tokens)
                finally:
                    state["admission"].leave(tokens)
                if err is not None:
                    oom = "out of memory" in str(err) or isinstance(err, MemoryError) or getattr(err, "oom", False)
                    return self._reply(500, {"error": {"message": "%s: %s" % (type(err).__name__, err),
                                                       "type": "OutOfMemoryError" if oom else "server_error", "code": 500}})
                usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
                rid, created = "cmpl-%s" % os.urandom(8).hex(), int(time.time())
                if stream:
                    with_usage = (bool((body.get("stream_options") or {}).get("include_usage"))
                                  and not args.no_tokenize and not args.no_usage)
                    return self._stream(completion_events(rid, state["model_name"], created,
                                                          [" t%d" % t for t in out], usage, with_usage,
                                                          done=not args.fastapi_shapes))
                response = {"id": rid, "object": "text_completion", "created": created,
                            "model": state["model_name"],
                            "choices": [{"index": 0, "text": " ".join("t%d" % t for t in out), "finish_reason": "length",
                                         "logprobs": None}],
                            "usage": usage}
                lps = getattr(self, "token_logprobs", None)
                if chat:
                    text = response["choices"][0].pop("text")
                    response.update(id="chatcmpl-" + rid[5:], object="chat.completion")
                    response["choices"][0]["message"] = {"role": "assistant", "content": text}
                    if body.get("logprobs") is True and lps is not None and len(lps) == len(out):
                        response["choices"][0]["logprobs"] = {"content": [
                            {"token": "t%d" % t, "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(out, lps)]}
                elif body.get("logprobs") is not None and lps is not None and len(lps) == len(out):
                    response["choices"][0]["logprobs"] = {"tokens": ["t%d" % t for t in out], "token_logprobs": lps}
                if args.no_usage:
                    del response["usage"]
                self._reply(200, response)
            finally:
                if key:
                    state["idempotency"].finish(key, response)

        def _generate(self, body):
            try:
                rid = str(body.get("id") or "req-%d" % time.monotonic_ns())
                prompt_tokens = int(body.get("prompt_tokens", 16))
                max_tokens = int(body.get("max_tokens", 8))
                hold_mb = int(body.get("hold_mb") or 0)
                worker = None if body.get("worker") is None else int(body["worker"])
            except (TypeError, ValueError) as e:
                return self._reply(400, {"error": "bad request: %s" % e})
            if prompt_tokens < 1 or max_tokens < 1:
                return self._reply(400, {"error": "prompt_tokens and max_tokens must be >= 1"})
            engine = state["engine"]
            if worker is not None and not (isinstance(engine, RemoteEngine) and 0 <= worker < len(engine.workers)):
                return self._reply(400, {"error": "no worker %d (see --workers)" % worker})
            if args.max_context and prompt_tokens + max_tokens > args.max_context:
                return self._reply(400, {"error": "context %d > --max-context %d" % (
                    prompt_tokens + max_tokens, args.max_context)})
            rng = random.Random(rid)
            prompt = [rng.randrange(state["vocab"]) for _ in range(prompt_tokens)]
            t0 = time.perf_counter()
            tokens = prompt_tokens + max_tokens
            if self._admit(tokens, openai=False) is None:
                return
            try:
                out, e = self._run(rid, prompt, max_tokens, worker, hold_mb)
            finally:
                state["admission"].leave(tokens)
            if e is not None:
                oom = "out of memory" in str(e) or isinstance(e, MemoryError) or getattr(e, "oom", False)
                return self._reply(507 if oom else 500, {"id": rid, "error": "%s: %s" % (type(e).__name__, e)})
            self._reply(200, {"id": rid, "output_tokens": len(out),
                              "latency_ms": (time.perf_counter() - t0) * 1e3})

    return Handler


class _NoAgent:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _request(rid, prompt_tokens, max_tokens):
    if oomscope is None or not oomscope.is_running():
        return _NoAgent()
    return oomscope.request(id=rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--port-file", help="write the port here once listening")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or float16/bfloat16 (GPU default bfloat16)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--leak-responses", action="store_true")
    p.add_argument("--host-leak", action="store_true")
    p.add_argument("--gc-cycles", action="store_true")
    p.add_argument("--fragment", action="store_true")
    p.add_argument("--fragment-kib", type=int, default=1024, help="size unit of --fragment tensors")
    p.add_argument("--fragment-keep", type=int, default=64, help="long-lived --fragment tensors kept")
    p.add_argument("--max-active", type=int, default=0)
    p.add_argument("--max-context", type=int, default=0)
    p.add_argument("--kv-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the KV cache's element type (default: the model's); bfloat16 halves it and rounds it")
    p.add_argument("--slow-prefill-ms-per-token", type=float, default=0.0,
                   help="sleep this long per prompt token before each prefill (a slow server)")
    p.add_argument("--memory-cap", type=int, default=0, help="bytes; needs CUDA")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting beyond --max-active; more get 429 (a bounded queue)")
    p.add_argument("--max-total-tokens", type=int, default=0, help="tokens in flight (prompt + max_tokens); 0 = no cap")
    p.add_argument("--no-admission-caps", dest="admission_caps", action="store_false",
                   help="admit everything: no --max-active, queue or token cap")
    p.add_argument("--no-readiness-gate", dest="readiness_gate", action="store_false",
                   help="accept requests before the model is loaded")
    p.add_argument("--no-gradual-restore", dest="gradual_restore", action="store_false",
                   help="admit at the full cap as soon as ready")
    p.add_argument("--restore-seconds", type=float, default=5.0, help="the admission ramp after readiness")
    p.add_argument("--no-idempotency", dest="idempotency", action="store_false", help="ignore Idempotency-Key")
    p.add_argument("--idempotency-store", default=None,
                   help="JSON-lines file of completed responses by key (default: one per port in the temp dir)")
    p.add_argument("--streams", action="store_true",
                   help="answer `stream: true` with an event stream (else JSON, as if streaming were unsupported)")
    p.add_argument("--empty-stream-over-context", action="store_true",
                   help="a prompt over --max-context gets 200 and nothing generated (implies --streams)")
    p.add_argument("--tokens-per-word", type=int, default=1, help="tokens the tokenizer makes of each prompt word")
    p.add_argument("--no-tokenize", action="store_true",
                   help="no /tokenize (404) and no usage in streams: a client must count tokens otherwise")
    p.add_argument("--fastapi-shapes", action="store_true",
                   help="FastAPI-shaped errors ({\"detail\": ...}), unknown request fields refused (422), "
                        "streams without data: [DONE]")
    p.add_argument("--chat-only", action="store_true",
                   help="serve /v1/chat/completions but not /v1/completions (as many deployments do)")
    p.add_argument("--no-usage", action="store_true", help="no usage in any answer (with --no-tokenize: no count at all)")
    p.add_argument("--refusal-counts", action="store_true",
                   help="over-context refusals state the prompt's count, as llama-cpp-python's do")
    p.add_argument("--load-seconds", type=float, default=0.0, help="extra time the model load takes (a big model's)")
    p.add_argument("--served-model-name", default=None, help="the name /v1/models lists")
    p.add_argument("--workers", type=int, default=0,
                   help="N engine worker processes behind this API process (0: one process does all)")
    p.add_argument("--worker-hold-mb", type=int, default=0,
                   help="with --workers: MB of host memory worker --worker-hold-rank holds once loaded")
    p.add_argument("--worker-hold-rank", type=int, default=0)
    p.add_argument("--layout", choices=("auto", "forked-api"), default="auto",
                   help="auto: one process, or --workers; forked-api: main + Manager + forked API process + "
                        "spawned worker (see the module's docstring)")
    p.add_argument("--worker-leak-mb-per-request", type=float, default=0.0,
                   help="with workers: MiB of CPU tensors each worker keeps per request it serves")
    p.add_argument("--no-agent", action="store_true", help="do not start oomscope (for overhead runs)")
    p.add_argument("--collector", default=None, help="else OOMSCOPE_COLLECTOR")
    p.add_argument("--name", default=None, help="agent name, else OOMSCOPE_NAME or pytorch-server")
    args = p.parse_args(argv)
    args.streams = args.streams or args.empty_stream_over_context
    if args.tokens_per_word < 1:
        p.error("--tokens-per-word is at least 1")
    if args.layout == "forked-api" and args.workers:
        p.error("--layout forked-api has one worker; --workers is the other layout")
    if args.worker_leak_mb_per_request and not (args.workers or args.layout == "forked-api"):
        p.error("--worker-leak-mb-per-request needs workers (--workers N or --layout forked-api)")
    return args


def agent_name(args):
    return args.name or os.environ.get("OOMSCOPE_NAME") or "pytorch-server"


def model_name(args):
    return "tiny-decoder-d%d-l%d" % (args.d_model, args.layers)


def setup_device(args):
    """The device and dtype, with --memory-cap applied."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.memory_cap:
        if device.type != "cuda":
            sys.exit("--memory-cap needs a CUDA device")
        # An index, not torch.device("cuda"): set_per_process_memory_fraction refuses
        # a device without one (seen on the H200 with torch 2.11).
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap / total), index)
    return device, dtype


def load_engine(args, device, dtype):
    """The model, loaded inside the agent's "load" phase, and its engine."""
    name = model_name(args)
    load = (oomscope.phase("load", model=name, revision="random-init", dtype=str(dtype).replace("torch.", ""))
            if oomscope else _NoAgent())
    with load:
        torch.manual_seed(0)
        kv_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.kv_dtype)
        model = TinyDecoder(args.vocab, args.d_model, args.layers, args.heads, dtype, device, kv_dtype).eval()
        time.sleep(args.load_seconds)
    return Engine(model, args)


def front_door(args, name):
    """The HTTP state before the model is there, and the listening server."""
    in_flight = (args.max_active + args.max_queue) if args.max_active else args.max_queue
    store_path = args.idempotency_store or (
        os.path.join(tempfile.gettempdir(), "oomscope-ref-idempotency-%d.jsonl" % args.port) if args.port else None)
    state = {"engine": None, "vocab": args.vocab, "model_name": args.served_model_name or name,
             "admission": Admission(in_flight, args.max_total_tokens, caps=args.admission_caps,
                                    gradual=args.gradual_restore, restore_s=args.restore_seconds),
             "idempotency": IdempotencyStore(store_path if args.idempotency else None),
             "shared": None, "count": lambda outcome: None}
    if not args.admission_caps:
        args.max_active = 0
    # Listen first, load second: while loading, /health says 503 and (with the
    # readiness gate) so does every request.
    # A listen backlog above a burst: refusing is the admission layer's job
    # (429/503 with Retry-After), not the kernel's (a reset connection).
    ThreadingHTTPServer.request_queue_size = 1024
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(state, args))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return state, server


def announce(args, port, device, name):
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    print("pytorch-server listening on 127.0.0.1:%d (%s, %s), ready" % (port, device, name), flush=True)


def main(argv=None):
    args = parse_args(argv)
    global oomscope
    if args.no_agent:
        oomscope = None
    if args.layout == "forked-api":
        # Before this process's own start(): its forked children inherit an
        # autostarted agent (under `oomscope run`), which their own start() renames.
        return serve_forked_api(args)
    if oomscope is not None:
        oomscope.start(collector=args.collector, name=agent_name(args))
    if args.workers > 0:
        return serve_with_workers(args)
    if args.gc_cycles:
        gc.disable()
    device, dtype = setup_device(args)
    name = model_name(args)
    state, server = front_door(args, name)
    state["engine"] = load_engine(args, device, dtype)
    state["admission"].set_ready()
    announce(args, server.server_address[1], device, name)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


# --workers: the API process and its engine workers ------------------------


class RemoteError(Exception):
    """A request's failure in a worker, passed on by the API process: its
    type's name, text and whether it was an out-of-memory error. Not a
    MemoryError here, so the API process's agent reports no OOM of its own
    (the worker's agent reported it where it happened)."""

    def __init__(self, type_name, text, oom):
        super().__init__(text)
        self.type_name, self.oom = type_name, oom


_REMOTE_TYPES = {}


def remote_error(type_name, text, oom):
    """A RemoteError whose class carries the worker's type name, so that the
    reply reads as it would from one process ("OutOfMemoryError: ...")."""
    cls = _REMOTE_TYPES.get(type_name)
    if cls is None:
        cls = _REMOTE_TYPES[type_name] = type(type_name, (RemoteError,), {})
    return cls(type_name, text, oom)


class WorkerHandle:
    """One engine worker as the API process sees it: its process (None in
    the forked API process: the main process started it), its end of the
    pipe (sends under a lock: many HTTP threads share it), its pid (from its
    "ready") and whether it has loaded its model."""

    def __init__(self, rank, proc, conn, name=None):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.name = name or (proc.name if proc is not None else "worker-%d" % rank)
        self.pid = proc.pid if proc is not None else None
        self.send_lock = threading.Lock()
        self.ready = threading.Event()
        self.closed = threading.Event()  # its pipe closed: it is gone

    def send(self, message):
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except (OSError, EOFError, ValueError):  # the worker is gone
            return False

    def alive(self):
        return self.proc.is_alive() if self.proc is not None else not self.closed.is_set()


@contextlib.contextmanager
def _environ(**values):
    """os.environ with `values` for a moment: what a spawned child inherits."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class RemoteEngine:
    """The engine as an API process sees it when worker processes generate:
    `submit(seq)` sends the sequence to a worker (the one it names, else
    round robin) and a reader thread per worker completes it when the answer
    comes back, so the HTTP handler is the same as with one process."""

    def __init__(self, device):
        self.device = device
        self.lock = threading.Lock()
        self.pending = {}  # ticket -> (seq, worker)
        self.tickets = itertools.count(1)
        self.turn = itertools.count()
        self.workers = []

    def attach(self, w):
        self.workers.append(w)
        threading.Thread(target=self._read, args=(w,), name="worker-%d-reader" % w.rank, daemon=True).start()

    def wait_ready(self, stop):
        """True once every worker has loaded; False if `stop` came first."""
        while not stop.is_set():
            if all(w.ready.is_set() for w in self.workers):
                return True
            stop.wait(0.05)
        return False

    def submit(self, seq):
        ticket = next(self.tickets)
        rank = seq.worker if getattr(seq, "worker", None) is not None else next(self.turn) % len(self.workers)
        w = self.workers[rank]
        with self.lock:
            self.pending[ticket] = (seq, w)
        if not w.send((ticket, seq.id, list(seq.prompt), seq.max_tokens, getattr(seq, "hold_mb", 0))):
            self._complete(ticket, None, ("WorkerGone", "worker %d is gone" % w.rank, False))

    def describe(self):
        return [{"rank": w.rank, "name": w.name, "pid": w.pid, "alive": w.alive(), "ready": w.ready.is_set()}
                for w in self.workers]

    def _complete(self, ticket, out, error):
        with self.lock:
            entry = self.pending.pop(ticket, None)
        if entry is None:
            return
        seq = entry[0]
        if error is not None:
            seq.error = remote_error(*error)
        else:
            seq.out = out
        seq.done.set()

    def _read(self, w):
        while True:
            try:
                message = w.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "ready":
                w.pid = message[2]
                w.ready.set()
            elif message[0] == "done":
                _, ticket, out, error = message
                self._complete(ticket, out, error)
        # The pipe closed: the worker is gone; what it had will not come back.
        w.closed.set()
        with self.lock:
            lost = [t for t, (_, owner) in self.pending.items() if owner is w]
        for ticket in lost:
            self._complete(ticket, None, ("WorkerGone", "worker %d died" % w.rank, False))


class WorkerPool(RemoteEngine):
    """--workers: the API process starts the workers itself. A monitor
    thread waits on every worker's sentinel and calls `on_death(proc)` for
    the first that ends while the pool is not stopping."""

    def __init__(self, args, on_death):
        super().__init__(args.device)
        self.on_death = on_death
        self.stopping = False
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each, as vLLM starts them
        for rank in range(args.workers):
            ours, theirs = ctx.Pipe()
            # Each worker's own agent (the autostart, under `oomscope run`) reads
            # its role and rank at interpreter start: the environment it gets.
            with _environ(OOMSCOPE_ROLE="worker", OOMSCOPE_RANK=str(rank)):
                proc = ctx.Process(target=worker_main, args=(rank, args, theirs), name="EngineWorker-%d" % rank,
                                   daemon=True)
                proc.start()
            theirs.close()
            self.attach(WorkerHandle(rank, proc, ours))
        threading.Thread(target=self._monitor, name="worker-monitor", daemon=True).start()

    def _monitor(self):
        # As vLLM's MultiprocWorkerMonitor: the first worker to end, unless
        # we are stopping them, ends the server.
        sentinels = {w.proc.sentinel: w for w in self.workers}
        ended = multiprocessing.connection.wait(list(sentinels))
        if self.stopping:
            return
        proc = sentinels[ended[0]].proc
        proc.join(1)  # reaps it, so that exitcode is set
        self.on_death(proc)

    def stop(self, timeout=10.0):
        """Asks every worker to finish (its agent says Goodbye at its exit),
        then terminates what is left after `timeout`."""
        self.stopping = True
        for w in self.workers:
            w.send(None)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)


def serve_with_workers(args):
    """--workers N: this process serves HTTP; N spawned workers load the model
    and generate. Returns the exit status: 1 when a worker died, as vLLM's
    API server exits, 0 after SIGTERM/SIGINT stopped the workers cleanly."""
    stop = threading.Event()
    died = []

    def on_death(proc):
        print("Worker proc %s died unexpectedly (exit code: %s), shutting down executor." % (
            proc.name, proc.exitcode), file=sys.stderr, flush=True)
        died.append(proc)
        stop.set()

    # Before the workers start: a stop during their load still stops them.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    name = model_name(args)
    state, server = front_door(args, name)
    pool = WorkerPool(args, on_death)
    if pool.wait_ready(stop):
        state["engine"] = pool  # as with one process: no engine until loaded
        state["admission"].set_ready()
        announce(args, server.server_address[1], "%s, %d workers" % (args.device, args.workers), name)
        stop.wait()
    server.shutdown()
    pool.stop(timeout=5.0 if died else 10.0)
    return 1 if died else 0


def hold_host_memory(mb):
    """Allocates `mb` MiB of host memory a chunk at a time, touching every
    page (so it is resident, in RSS and the cgroup), and keeps it."""
    left = int(mb) << 20
    while left > 0:
        n = min(HOLD_CHUNK, left)
        chunk = bytearray(n)
        chunk[::PAGE] = b"\x01" * len(range(0, n, PAGE))
        HELD.append(chunk)
        left -= n


def set_title(title):
    """This process's name in ps, top and the kernel's OOM report (15
    characters at most), as serving frameworks name their processes."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(title[:15])
    except OSError:
        pass


def leak_tensors(mb):
    """--worker-leak-mb-per-request: `mb` MiB more of CPU tensors, kept for
    good. torch.ones writes every page, so all of it is resident (anon RSS,
    charged to the memory cgroup) at once."""
    if mb > 0:
        LEAKED.append(torch.ones(int(mb * (1 << 20)) // 4, dtype=torch.float32))


def worker_main(rank, args, conn):
    """An engine worker: a spawned interpreter, so the autostart (under
    `oomscope run`) has already given it its own agent as role "worker" with
    this rank; without it, the agent starts here with them. Loads the model,
    then serves the API process's requests until told to stop (None) or the
    API process is gone (the pipe closes)."""
    # Ctrl-C reaches the whole process group: the API process stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_title(multiprocessing.current_process().name)
    global oomscope
    if args.no_agent:
        oomscope = None
    elif oomscope is not None:
        oomscope.start(collector=args.collector, name=agent_name(args), role="worker", rank=rank)
    if args.gc_cycles:
        gc.disable()
    device, dtype = setup_device(args)
    engine = load_engine(args, device, dtype)
    if args.worker_hold_mb and rank == args.worker_hold_rank:
        hold_host_memory(args.worker_hold_mb)
    send_lock = threading.Lock()

    def send(message):
        try:
            with send_lock:
                conn.send(message)
        except (OSError, EOFError, ValueError):
            pass  # the API process is gone; the main loop ends on its own

    send(("ready", rank, os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        threading.Thread(target=_worker_request, args=(engine, message, send), daemon=True).start()


def _worker_request(engine, message, send):
    ticket, rid, prompt, max_tokens, hold_mb = message
    out, error = None, None
    try:
        with _request(rid, len(prompt), max_tokens) as r:
            if hold_mb:
                hold_host_memory(hold_mb)
            seq = Sequence(rid, prompt, max_tokens)
            engine.submit(seq)
            seq.done.wait()
            if seq.error is not None:
                raise seq.error
            if r is not None:
                r.output_tokens = len(seq.out)
            leak_tensors(engine.args.worker_leak_mb_per_request)
        out = list(seq.out)
    except Exception as e:  # noqa: BLE001 - the API process answers the client
        text = str(e)
        error = (type(e).__name__, text, "out of memory" in text or isinstance(e, MemoryError))
    send(("done", ticket, out, error))


# --layout forked-api: main process, Manager, forked API process, spawned worker


def die_with_parent(sig, parent):
    """PR_SET_PDEATHSIG, as serving frameworks' processes ask for it: the
    kernel sends `sig` when the main process dies, however it dies (its
    own OOM kill included), so that no part of the server lives on alone."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before we asked
        os.kill(os.getpid(), sig)


def _name_manager(args, parent):
    """In the Manager's server process (forked, so with the main process's
    agent if it had one): names that agent by its role. Starts none. A
    SIGTERM ends it (not the main process's handler, inherited by the fork),
    and so does the main process's death."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    set_title("SyncManager")
    die_with_parent(signal.SIGTERM, parent)
    if oomscope is not None and oomscope.is_running():
        oomscope.start(collector=args.collector, name=agent_name(args), role="manager")


def api_main(args, conn, theirs, shared, parent):
    """The API process: forked from the main process (its code and imports,
    and a copy of its agent, if any, that its own start() names
    "api_server"). Serves HTTP and passes requests to the worker over `conn`
    until SIGTERM/SIGINT; then tells the worker to finish."""
    set_title("APIServer")
    die_with_parent(signal.SIGKILL, parent)
    # The worker's end, inherited by the fork: only the worker may hold it,
    # or its death would never read as the pipe's end here.
    theirs.close()
    if oomscope is not None:
        oomscope.start(collector=args.collector, name=agent_name(args), role="api_server")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    name = model_name(args)
    state, server = front_door(args, name)
    counted = threading.Lock()

    def count(outcome):
        # The Manager's dict: one writer (this process), many HTTP threads.
        with counted:
            shared[outcome] = shared.get(outcome, 0) + 1

    state["shared"], state["count"] = shared, count
    engine = RemoteEngine(args.device)
    worker = WorkerHandle(0, None, conn, name="InferWorker-0")
    engine.attach(worker)
    if engine.wait_ready(stop):
        state["engine"] = engine
        state["admission"].set_ready()
        announce(args, server.server_address[1], "%s, forked API process, 1 worker" % args.device, name)
        stop.wait()
    server.shutdown()
    worker.send(None)


def serve_forked_api(args):
    """--layout forked-api, the main process: starts the Manager, forks the
    API process, spawns the worker, then only watches them. Returns the exit
    status: 1 when the worker or the API process died (the other is
    SIGKILLed first, as serving frameworks kill their process tree), 0 after
    SIGTERM/SIGINT stopped everything cleanly."""
    stop = threading.Event()
    # Before any child starts: a stop during their start still stops them.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fork, spawn = multiprocessing.get_context("fork"), multiprocessing.get_context("spawn")
    manager = multiprocessing.managers.SyncManager(ctx=fork)
    manager.start(_name_manager, (args, os.getpid()))
    manager_pid = multiprocessing.active_children()[0].pid  # our only child yet
    shared = manager.dict(main_pid=os.getpid(), manager_pid=manager_pid, served=0, failed=0)
    api_end, worker_end = spawn.Pipe()
    api = fork.Process(target=api_main, args=(args, api_end, worker_end, shared, os.getpid()), name="APIServer",
                       daemon=True)
    api.start()
    worker = spawn.Process(target=worker_main, args=(0, args, worker_end), name="InferWorker-0", daemon=True)
    worker.start()
    # The pipe's ends are theirs: the worker sees EOF when the API process ends.
    api_end.close()
    worker_end.close()
    shared.update(api_pid=api.pid, worker_pid=worker.pid)
    if oomscope is not None:
        oomscope.start(collector=args.collector, name=agent_name(args), role="launcher")
    children = {worker.sentinel: worker, api.sentinel: api}
    died = None
    while died is None and not stop.is_set():
        # A timeout, so that the stop event is seen without a wakeup fd.
        ended = multiprocessing.connection.wait(list(children), timeout=0.1)
        died = children[ended[0]] if ended else None
    if died is not None:
        died.join(1)  # reaps it, so that exitcode is set
        print("%s (pid %d) died unexpectedly (exit code: %s); killing the rest" % (
            died.name, died.pid, died.exitcode), file=sys.stderr, flush=True)
        for p in (api, worker):
            if p is not died and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        manager.shutdown()
        return 1
    # The API process stops serving and tells the worker to finish.
    api.terminate()
    api.join(10)
    worker.join(10)
    for p in (api, worker):
        if p.is_alive():
            p.kill()
            p.join(5)
    manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
