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
- In the process that holds a worker (a ``VLLM::Worker``, or the engine core
  itself with one GPU), :func:`register` wraps vLLM's hand-over of the KV
  cache config to the worker: that worker's pool (bytes per block from its
  own KV cache spec, blocks, layers) becomes its agent's context before the
  pool is allocated, so a failure on that GPU is diagnosed against the pool
  on that GPU. The API server knows no spec: its pool is an estimate from
  the model config for all workers together, and says so.

Nothing here raises into vLLM: every entry point catches and logs once. The
stat interfaces are "not stable" (vLLM's own docstring): on a vLLM whose
stats lack the fields read here, the logger says so once and does nothing.
"""

import functools
import logging
import os
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
        if oomscope.is_running():
            # Every role: with one GPU the worker lives in the engine core,
            # and offline (``LLM``) in the only process there is.
            install_worker_hook()
    except Exception as e:  # never into vLLM
        _warn_once("register", "the vLLM plugin could not tag its agent: %s", e)


#: Marks vLLM's method once wrapped: plugins load once per process, but a
#: second wrap would report twice.
_WRAPPED = "_oomscope_reports_kv_pool"


def install_worker_hook():
    """Wraps ``WorkerWrapperBase.initialize_from_config``, the one method by
    which every vLLM executor (in-process, multiprocessing, Ray) hands each
    worker its KV cache config, so that the process holding the worker
    reports that worker's pool (:func:`report_worker_pool`). The report comes
    first: the config says what is about to be allocated, and an allocation
    that fails is the failure the figures explain. vLLM's call itself is
    untouched, its exceptions included. False where this vLLM has no such
    method (the figures are then the API server's estimate only)."""
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except Exception:
        return False
    original = WorkerWrapperBase.__dict__.get("initialize_from_config")
    if original is None:
        return False
    if getattr(original, _WRAPPED, False):
        return True

    @functools.wraps(original)
    def initialize_from_config(self, kv_cache_configs, *args, **kwargs):
        report_worker_pool(self, kv_cache_configs)
        return original(self, kv_cache_configs, *args, **kwargs)

    setattr(initialize_from_config, _WRAPPED, True)
    WorkerWrapperBase.initialize_from_config = initialize_from_config
    return True


def report_worker_pool(wrapper, kv_cache_configs):
    """This worker's KV pool as its agent's context: the config meant for it
    (vLLM's wrapper takes the one at its global rank), read by
    :func:`worker_kv_pool`. Never raises."""
    try:
        import oomscope

        config = kv_cache_configs
        if isinstance(config, (list, tuple)):
            config = config[wrapper.global_rank]
        numbers, labels = worker_kv_pool(config, getattr(wrapper, "vllm_config", None))
        if numbers:
            oomscope.set_context(**numbers)
            oomscope.set_labels(**labels)
    except Exception as e:
        _warn_once("worker", "the vLLM plugin could not read this worker's KV pool: %s", e)


#: Where a worker's KV figures came from (the label ``vllm.kv_pool_from``).
FROM_SPEC = "kv_cache_spec"
ESTIMATE_WORKER = "estimate: model config, this worker"
ESTIMATE_ALL = "estimate: model config, all workers"


def worker_kv_pool(kv_cache_config, vllm_config=None):
    """One worker's KV pool as context numbers and labels: bytes per block,
    blocks, tokens per block and layers, from the KV cache config vLLM's
    engine core gives it, whose groups hold the worker's own KV cache spec
    per layer (``get_kv_cache_spec()`` as the engine merged it, projected on
    the layers this worker holds): under tensor parallelism its share of the
    KV heads, under pipeline parallelism its stage's layers, for MLA the
    latent vector. Without a spec that reads (another vLLM), an estimate from
    `vllm_config`'s model, labelled so. ({}, {}) where neither is known."""
    figures, source = None, FROM_SPEC
    try:
        figures = _pool_from_spec(kv_cache_config)
        if figures is None:  # a model without KV cache
            return {}, {}
    except Exception as e:
        _log.info("oomscope: no KV cache spec in this worker's config (%s): estimating", e)
    blocks = getattr(kv_cache_config, "num_blocks", None)
    if figures is None:
        cache = getattr(vllm_config, "cache_config", None)
        block_size = getattr(cache, "block_size", None) or 0
        blocks = blocks or getattr(cache, "num_gpu_blocks", None)
        per_block, layers = _estimated_kv_bytes_per_block(vllm_config, block_size, this_worker=True)
        figures, source = (per_block, block_size, layers), ESTIMATE_WORKER
    per_block, block_size, layers = figures
    if not per_block:
        return {}, {}
    numbers = {"vllm.kv_block_bytes": per_block, "vllm.block_size": block_size,
               "vllm.kv_layers": layers}
    if blocks:
        numbers["vllm.num_gpu_blocks"] = int(blocks)
        numbers["vllm.kv_pool_bytes"] = int(blocks) * per_block
    return numbers, {"vllm.kv_pool_from": source}


def _pool_from_spec(kv_cache_config):
    """(bytes per block, tokens per block, layers) as vLLM sizes one block of
    this worker's pool: each device group's layers' pages summed (a page
    padded to the spec's block stride alignment, as vLLM lays it out), the
    largest group's sum (a block ID belongs to one group at a time). None for
    a model without KV cache groups."""
    groups = [g for g in kv_cache_config.kv_cache_groups
              if g.layer_names and not getattr(g, "host_resident", False)]
    if not groups:
        return None
    sizes = []
    for g in groups:
        # A group of several spec types carries each layer's own.
        per_layer = getattr(g.kv_cache_spec, "kv_cache_specs", None)
        specs = [per_layer[name] for name in g.layer_names] if per_layer else \
            [g.kv_cache_spec] * len(g.layer_names)
        sizes.append((sum(_block_stride(s) for s in specs), g.kv_cache_spec.block_size))
    per_block, block_size = max(sizes)
    layers = len({name for g in groups for name in g.layer_names})
    return per_block, block_size, layers


def _block_stride(spec):
    """One layer's bytes per block: its page, rounded up to the spec's block
    stride alignment where this vLLM has one."""
    page = int(spec.page_size_bytes)
    align = getattr(spec, "get_block_stride_alignment", None)
    align = int(align()) if callable(align) else 1
    return -(-page // align) * align


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
    parallel = getattr(vllm_config, "parallel_config", None)
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
        ("tensor_parallel_size", parallel, "tensor_parallel_size"),
        ("pipeline_parallel_size", parallel, "pipeline_parallel_size"),
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


def _estimated_kv_bytes_per_block(vllm_config, block_size, this_worker):
    """(bytes per block, layers) from the model config where no KV cache spec
    was read: per layer and token K and V of the KV heads a tensor-parallel
    rank holds (its share, at least one: vLLM replicates heads when there are
    fewer than ranks), or for MLA one latent vector and its rotary part (the
    same on every rank), at the cache dtype. `this_worker`: the layers of
    this worker's pipeline stage on one rank; else all workers together
    (every layer on every rank). (0, 0) where the config does not say.
    Hybrid and sliding-window models are counted as full attention."""
    try:
        model = vllm_config.model_config
        hf = getattr(model, "hf_text_config", None) or model.hf_config
        parallel = getattr(vllm_config, "parallel_config", None)
        tp = int(getattr(parallel, "tensor_parallel_size", None) or 1)
        pp = int(getattr(parallel, "pipeline_parallel_size", None) or 1)
        layers = int(getattr(hf, "num_hidden_layers"))
        if getattr(model, "use_mla", False) and getattr(hf, "kv_lora_rank", None):
            token_elems = int(hf.kv_lora_rank) + int(hf.qk_rope_head_dim)
        else:
            heads = int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
            head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
            token_elems = 2 * max(1, heads // tp) * head_dim
        if this_worker:
            # vLLM's own split of the layers over the stages, where it has one.
            stage = getattr(model, "get_num_layers", None)
            layers = int(stage(parallel)) if callable(stage) and parallel is not None else -(-layers // pp)
            ranks = 1
        else:
            ranks = tp
        return ranks * layers * token_elems * block_size * _kv_element_size(vllm_config), layers
    except Exception:
        return 0, 0


def _kv_element_size(vllm_config):
    """Bytes of one KV cache element: the model's dtype unless the cache's
    dtype says otherwise (fp8: one byte)."""
    import torch

    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", None) or "auto")
    if cache_dtype.startswith("fp8"):
        return 1
    dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else cache_dtype
    if isinstance(dtype, str):  # "bfloat16" or "torch.bfloat16"
        dtype = getattr(torch, dtype.rsplit(".", 1)[-1])
    return torch.tensor([], dtype=dtype).element_size()


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
            # The whole instance's pool: each worker reports its own share.
            per_block, _ = _estimated_kv_bytes_per_block(vllm_config, block_size, this_worker=False)
            self._pool_bytes = blocks * per_block if blocks and per_block else 0
            if self._pool_bytes:
                labels["vllm.kv_pool_from"] = ESTIMATE_ALL
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
