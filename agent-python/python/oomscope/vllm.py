"""oomscope's vLLM plugin: context that vLLM never hands to ``oomscope.request()``.

vLLM loads two kinds of plugin through entry points that this wheel declares:

- ``vllm.general_plugins`` -> :func:`register`, run in every vLLM process (the
  API server, the engine core, each worker). It gives the process's agent its
  role and rank, so that the collector shows one instance with named parts.
  The ``.pth`` autostart has usually started the agent already; the plugin
  tags it, or starts one when none runs, and never starts a second.
- ``vllm.stat_logger_plugins`` -> :class:`OomscopeStatLogger`, run in the API
  server. Each engine step's ``SchedulerStats`` (KV usage, running and
  waiting requests) and ``IterationStats`` (preemptions, tokens, finished
  requests) become the instance's context and request events, and at start
  it records the KV pool and the memory settings as the load phase.

Nothing here raises into vLLM: every entry point catches and logs once. The
stat interfaces are "not stable" (vLLM's own docstring): on a vLLM whose
stats lack the fields read here, the logger says so once and does nothing.
"""

import logging
import os
import sys
import time

_log = logging.getLogger("oomscope.vllm")

#: vLLM's stat logger runs about once per engine step (20 ms apart while
#: busy); the context is updated at most this often, like a sample. The KV
#: usage and the queue it records are the highest of the steps since the
#: last record: a pool full for one step between records is still seen.
MIN_RECORD_INTERVAL_S = 0.2

_warned = set()


def _warn_once(key, msg, *args):
    if key not in _warned:
        _warned.add(key)
        _log.warning("oomscope: " + msg, *args)


def _role_and_rank():
    """What this vLLM process is, from its process title (vLLM sets
    ``VLLM::EngineCore``, ``VLLM::Worker``...) or its multiprocessing name."""
    title = ""
    try:
        with open("/proc/self/comm") as f:
            title = f.read().strip()
    except OSError:
        pass
    name = ""
    try:
        import multiprocessing

        name = multiprocessing.current_process().name or ""
    except Exception:
        pass
    text = (title + " " + name).lower()
    rank = 0
    for part in name.replace("-", "_").split("_"):
        if part.isdigit():
            rank = int(part)
        elif part[-1:].isdigit() and part.rstrip("0123456789") in ("dp", "tp", "rank", "worker"):
            rank = int(part[len(part.rstrip("0123456789")):])
    if "worker" in text:
        return "worker", rank
    if "enginecore" in text or "engine_core" in text or "engine" in text:
        return "engine_core", rank
    return "api_server", 0


def register():
    """The general plugin: tag this process's agent with its vLLM role."""
    try:
        import oomscope

        role, rank = _role_and_rank()
        if oomscope.is_running():
            oomscope.set_identity(role=role, rank=rank, runtime_name="vllm")
        elif os.environ.get("OOMSCOPE_COLLECTOR"):
            oomscope.start(role=role, rank=rank)
            oomscope.set_identity(role=role, rank=rank, runtime_name="vllm")
    except Exception as e:  # never into vLLM
        _warn_once("register", "the vLLM plugin could not tag its agent: %s", e)


def _base():
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase

        return StatLoggerBase
    except Exception:
        return object


def _config_facts(vllm_config):
    """The memory settings vLLM resolved, as context labels and numbers."""
    labels, numbers = {}, {}
    cache = getattr(vllm_config, "cache_config", None)
    sched = getattr(vllm_config, "scheduler_config", None)
    model = getattr(vllm_config, "model_config", None)
    blocks = getattr(cache, "num_gpu_blocks", None) or 0
    block_size = getattr(cache, "block_size", None) or 0
    for key, obj, attr in [
        ("gpu_memory_utilization", cache, "gpu_memory_utilization"),
        ("kv_cache_memory_bytes", cache, "kv_cache_memory_bytes"),
        ("num_gpu_blocks", cache, "num_gpu_blocks"),
        ("block_size", cache, "block_size"),
        ("max_num_seqs", sched, "max_num_seqs"),
        ("max_num_batched_tokens", sched, "max_num_batched_tokens"),
        ("max_model_len", model, "max_model_len"),
    ]:
        v = getattr(obj, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            numbers["vllm." + key] = float(v)
    for key, obj, attr in [
        ("model", model, "model"),
        ("dtype", model, "dtype"),
        ("kv_cache_dtype", cache, "cache_dtype"),
        ("enforce_eager", model, "enforce_eager"),
    ]:
        v = getattr(obj, attr, None)
        if v is not None:
            labels["vllm." + key] = str(v)
    return labels, numbers, blocks, block_size


def _kv_bytes_per_block(vllm_config, block_size):
    """Bytes one KV block holds: 2 (K and V) x layers x KV heads x head dim x
    block size x element size, where the model config says so."""
    try:
        model = vllm_config.model_config
        hf = model.hf_config
        layers = int(getattr(hf, "num_hidden_layers"))
        heads = int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        import torch

        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        dtype = model.dtype if cache_dtype in (None, "auto") else torch.float8_e4m3fn
        if isinstance(dtype, str):  # "bfloat16" or "torch.bfloat16"
            dtype = getattr(torch, dtype.rsplit(".", 1)[-1])
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * layers * heads * head_dim * block_size * elem
    except Exception:
        return 0


class OomscopeStatLogger(_base()):
    """vLLM's engine stats as oomscope context (see the module's doc)."""

    def __init__(self, vllm_config, engine_index=0):
        self._ok = True
        self._last = 0.0
        self._preemptions = 0
        self._steps = 0
        self._peak_usage = 0.0  # since the last record
        self._peak_waiting = 0
        self._engine = engine_index
        try:
            labels, numbers, blocks, block_size = _config_facts(vllm_config)
            per_block = _kv_bytes_per_block(vllm_config, block_size)
            self._pool_bytes = blocks * per_block if blocks and per_block else 0
            self._labels, self._numbers = labels, numbers
        except Exception as e:
            self._ok = False
            _warn_once("init", "the vLLM stat logger cannot read this vLLM's config: %s", e)

    def log_engine_initialized(self):
        """The load phase: the KV pool and the memory settings, once."""
        if not self._ok:
            return
        try:
            import oomscope

            numbers = dict(self._numbers)
            if self._pool_bytes:
                numbers["kv_cache_capacity_bytes"] = float(self._pool_bytes)
            oomscope.set_context(**{k: v for k, v in numbers.items()})
            oomscope.set_labels(**self._labels)
            # The engine is loaded (weights, KV pool, warm-up): the load phase
            # on record, with the model, as the agent sees memory now.
            with oomscope.phase("load", model=self._labels.get("vllm.model"),
                                dtype=self._labels.get("vllm.dtype")):
                pass
        except Exception as e:
            _warn_once("engine", "the vLLM stat logger could not record the load: %s", e)

    def record(self, scheduler_stats=None, iteration_stats=None, mm_cache_stats=None, engine_idx=0):
        if not self._ok:
            return
        try:
            self._record(scheduler_stats, iteration_stats)
        except Exception as e:
            _warn_once("record", "the vLLM stat logger stopped: %s (stats of this vLLM differ?)", e)
            self._ok = False

    def _record(self, sched, it):
        import oomscope

        # The fields this logger reads, read strictly: on a vLLM whose stats
        # lack one, the AttributeError stops the logger (with one warning)
        # rather than recording zeros as if they were measured.
        finished = []
        if it is not None:
            # One record with iteration stats per engine step: the count is
            # what a worker's growth per model step is measured against.
            self._steps += 1
            self._preemptions += int(it.num_preempted_reqs or 0)
            finished = list(it.finished_requests or [])
        now = time.monotonic()
        if sched is not None:
            self._peak_usage = max(self._peak_usage, float(sched.kv_cache_usage or 0.0))
            self._peak_waiting = max(self._peak_waiting, int(sched.num_waiting_reqs or 0))
        # A step that finished requests updates the context whatever its age:
        # each end is a boundary sample, and vLLM counts this step's running
        # requests after removing the finished ones. A context up to
        # MIN_RECORD_INTERVAL_S old would still show the request running, so
        # no end of a request run alone would read as between requests.
        if sched is not None and (finished or now - self._last >= MIN_RECORD_INTERVAL_S):
            self._last = now
            usage, waiting = self._peak_usage, self._peak_waiting
            self._peak_usage, self._peak_waiting = 0.0, 0
            context = {
                "active_sequences": int(sched.num_running_reqs or 0),
                "queued": waiting,
                "kv_cache_usage": usage,
                "preemptions": self._preemptions,
                "engine_steps": self._steps,
            }
            if self._pool_bytes:
                context["kv_cache_bytes"] = int(usage * self._pool_bytes)
                context["kv_cache_capacity_bytes"] = self._pool_bytes
            oomscope.set_context(**context)
        for fin in finished:
            latency = float(getattr(fin, "e2e_latency", 0.0) or 0.0)
            oomscope.record_request(
                id=str(getattr(fin, "request_id", "") or ""),
                started_s_ago=latency,
                prompt_tokens=int(getattr(fin, "num_prompt_tokens", 0) or 0),
                output_tokens=int(getattr(fin, "num_generation_tokens", 0) or 0),
                max_tokens=int(getattr(fin, "max_tokens_param", 0) or 0),
            )

    def log(self):
        pass
