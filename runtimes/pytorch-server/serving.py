"""What a well-run inference server does at its front door, so that
`oomscope probe` has something real to pass (and, with each switched off,
something real to catch):

- admission caps on active sequences, queued requests and total tokens, with
  a clean 429 + Retry-After beyond them (a bounded queue, not an OOM);
- readiness: 503 until the model is loaded, so no traffic is admitted early;
- gradual restore: right after readiness the admission cap ramps up from a
  tenth to full over a few seconds, so retried work cannot stampede a cold
  server (the thundering herd after a restart);
- idempotency keys: a completed response is stored (in a file, so it survives
  a restart) and replayed for a retry with the same Idempotency-Key instead of
  processing it twice.
"""

import zlib
import json
import math
import os
import threading
import time


class Refusal(Exception):
    """A request refused at the door: HTTP status, Retry-After seconds, why."""

    def __init__(self, status, retry_after, message):
        super().__init__(message)
        self.status, self.retry_after, self.message = status, retry_after, message


class Admission:
    """Counts requests in flight (active + queued) and their tokens.

    `caps` off admits everything (an unbounded queue); `gradual` off admits
    at the full cap as soon as the server is ready."""

    #: A refused client should come back after about this long.
    RETRY_AFTER_S = 1

    def __init__(self, max_in_flight, max_total_tokens, caps=True, gradual=True, restore_s=5.0):
        self.max_in_flight = max_in_flight
        self.max_total_tokens = max_total_tokens
        self.caps, self.gradual, self.restore_s = caps, gradual, restore_s
        self.lock = threading.Lock()
        self.in_flight = 0
        self.tokens = 0
        self.ready_at = None

    def set_ready(self):
        with self.lock:
            self.ready_at = time.monotonic()

    def ready(self):
        return self.ready_at is not None

    def cap_now(self):
        """The in-flight cap at this moment: ramps from 10% to 100% over restore_s after readiness."""
        if not self.gradual or self.ready_at is None or self.restore_s <= 0:
            return self.max_in_flight
        frac = min(1.0, 0.1 + 0.9 * (time.monotonic() - self.ready_at) / self.restore_s)
        return max(1, int(math.floor(self.max_in_flight * frac)))

    def enter(self, tokens):
        """Admit a request of `tokens` total tokens, or raise Refusal."""
        with self.lock:
            if not self.caps:
                self.in_flight += 1
                self.tokens += tokens
                return
            cap = self.cap_now()
            if self.in_flight >= cap:
                restoring = cap < self.max_in_flight
                raise Refusal(503 if restoring else 429, self.RETRY_AFTER_S,
                              ("restoring after start: admitting %d in flight for now (full: %d)" % (cap, self.max_in_flight))
                              if restoring else "queue full: %d requests in flight (cap %d)" % (self.in_flight, cap))
            if self.max_total_tokens and self.tokens + tokens > self.max_total_tokens:
                raise Refusal(429, self.RETRY_AFTER_S, "token budget full: %d + %d > %d tokens in flight" % (
                    self.tokens, tokens, self.max_total_tokens))
            self.in_flight += 1
            self.tokens += tokens

    def leave(self, tokens):
        with self.lock:
            self.in_flight -= 1
            self.tokens -= tokens


class IdempotencyStore:
    """Completed responses by Idempotency-Key, appended to a JSON-lines file
    so that they survive a restart; a retry that arrives while the first
    attempt is still running waits for it."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()
        self.done = {}
        self.running = {}
        if path and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        self.done[rec["key"]] = rec["response"]
                    except (ValueError, KeyError):
                        continue  # a torn last line after a crash: skip it

    def begin(self, key):
        """(stored response, None) for a replay, or (None, event) for the
        caller to process the request and then call finish()."""
        while True:
            with self.lock:
                if key in self.done:
                    return self.done[key], None
                ev = self.running.get(key)
                if ev is None:
                    ev = self.running[key] = threading.Event()
                    return None, ev
            ev.wait(600)

    def finish(self, key, response):
        with self.lock:
            if response is not None:
                self.done[key] = response
                if self.path:
                    with open(self.path, "a") as f:
                        f.write(json.dumps({"key": key, "response": response}) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
            ev = self.running.pop(key, None)
        if ev is not None:
            ev.set()


def tokenize(prompt, vocab, per_word=1):
    """The server's token ids for a prompt: `per_word` ids for each word of a
    text (so a tokenizer of several tokens a word can be tried), or the ids
    given as a list. /tokenize, usage and the context check all count these.
    The ids are stable across runs (crc32, not Python's salted hash), so a
    prompt gets the same greedy answer from every launch: quality checks
    compare launches."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = " ".join(prompt)
    if isinstance(prompt, list):
        return [int(t) % vocab for t in prompt] or [0]
    return [zlib.crc32(b"%s\0%d" % (w.encode(), i)) % vocab
            for w in str(prompt).split() for i in range(per_word)] or [0]


def sse(chunks):
    """An event stream's bytes: one `data:` event per JSON chunk (or the literal [DONE])."""
    return b"".join(b"data: " + (c if isinstance(c, str) else json.dumps(c)).encode() + b"\n\n"
                    for c in chunks)


def completion_events(rid, model, created, text_tokens, usage, with_usage, done=True):
    """The chunks of a streamed completion as OpenAI sends them: one per
    token (the last with its finish reason), usage in a last chunk without
    choices when asked for (`stream_options.include_usage`), then [DONE]."""
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    chunks = [dict(base, choices=[{"index": 0, "text": t, "logprobs": None,
                                   "finish_reason": "length" if i == len(text_tokens) - 1 else None}])
              for i, t in enumerate(text_tokens)]
    if with_usage:
        chunks.append(dict(base, choices=[], usage=usage))
    if done:
        chunks.append("[DONE]")
    return chunks
