"""The vLLM plugin's KV pool per worker against vLLM's own KV cache spec
(vLLM 0.32's CPU build, in .venv-vllm): each worker's attention specs built
as vLLM's model runner reports them (its pipeline stage's layers, its tensor-
parallel share of the KV heads, MLA's latent on every rank), turned into each
worker's KV cache config by vLLM's engine-core code (`get_kv_cache_configs`),
then read by the plugin as the worker that holds the pool reads it. The
configs are a tiny Llama's (4 layers, 2 KV heads of 64) and DeepSeek-V2-Lite's
shape (27 MLA layers, kv_lora_rank 512 + qk_rope_head_dim 64)."""

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from conftest import ROOT, harness

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.distributed.utils import get_pp_indices
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from oomscope import vllm as plugin

BLOCK = 16
BF16 = 2

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2000, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}

# DeepSeek-V2-Lite's shape; its MoE fields only so that the config loads.
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "norm_topk_prob": False, "vocab_size": 102400,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


@pytest.fixture(autouse=True)
def _environ_left_as_found():
    """Building a VllmConfig in this process sets process-wide environment
    (LD_PRELOAD of torch's libgomp, LOCAL_WORLD_SIZE,
    VLLM_WORKER_MULTIPROC_METHOD, ...); left in place it reaches every vLLM
    server the later tests launch with a copy of os.environ, whose worker then
    never took its VLLM::Worker title."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def engine_config(tmp_path, hf, tp=1, pp=1):
    """vLLM's config for the model `hf` on tp x pp workers."""
    model_dir = tmp_path / hf["model_type"]
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=2048)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))


def worker_spec(vc, rank):
    """What the model runner of the worker at global rank `rank` reports
    (`get_kv_cache_spec()`): one spec per attention layer of its pipeline
    stage, as vLLM's Attention and MLAAttention layers build theirs."""
    model, parallel = vc.model_config, vc.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    start, end = get_pp_indices(model.get_total_num_hidden_layers(), rank // tp % pp, pp)
    if model.use_mla:
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, max_tp_shards=1,
                                head_size=model.get_head_size(), dtype=model.dtype, cache_dtype_str="auto")
    else:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=model.get_num_kv_heads(parallel),
                                 head_size=model.get_head_size(), dtype=model.dtype)
    return {"model.layers.%d.self_attn.attn" % i: spec for i in range(start, end)}


def engine_kv_configs(vc, memory=1 << 28):
    """Each worker's spec and the KV cache config vLLM's engine core makes
    for it from all of them (`EngineCore._initialize_kv_caches`' steps)."""
    specs = [worker_spec(vc, r) for r in range(vc.parallel_config.world_size)]
    resolve_kv_cache_layout(vc, [["LBNHC"]] * len(specs), [s for w in specs for s in w.values()])
    configs = get_kv_cache_configs(vc, specs, [memory] * len(specs))
    vc.cache_config.num_gpu_blocks = min(c.num_blocks for c in configs)
    return specs, configs


def all_heads_all_layers(hf):
    """The plugin's old figure: K and V of every KV head of every layer."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * BLOCK * BF16


# (model, tp, pp, each worker's bytes per block worked out by hand, layers per worker)
CASES = {
    # 1 of the 2 KV heads per rank: 4 layers x K+V x 64 dims x 2 bytes x 16 tokens.
    "llama_tp2": (LLAMA, 2, 1, [4 * 1 * 2 * 64 * BF16 * BLOCK] * 2, [4, 4]),
    # Both heads, but each stage holds 2 of the 4 layers.
    "llama_pp2": (LLAMA, 1, 2, [2 * 2 * 2 * 64 * BF16 * BLOCK] * 2, [2, 2]),
    # 4 workers: half the heads and half the layers each.
    "llama_tp2_pp2": (LLAMA, 2, 2, [2 * 1 * 2 * 64 * BF16 * BLOCK] * 4, [2, 2, 2, 2]),
    # MLA: one latent of 512 + 64 per token and layer, the same on both ranks.
    "mla_tp2": (DEEPSEEK_V2_LITE, 2, 1, [27 * 576 * BF16 * BLOCK] * 2, [27, 27]),
    # MLA over two stages: vLLM splits 27 layers 14 + 13.
    "mla_pp2": (DEEPSEEK_V2_LITE, 1, 2, [14 * 576 * BF16 * BLOCK, 13 * 576 * BF16 * BLOCK], [14, 13]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_workers_block_bytes_are_vllms_page_sizes_of_its_layers(tmp_path, case):
    hf, tp, pp, by_hand, layers = CASES[case]
    vc = engine_config(tmp_path, hf, tp, pp)
    specs, configs = engine_kv_configs(vc)
    old = all_heads_all_layers(hf)
    for rank, (spec, config) in enumerate(zip(specs, configs)):
        numbers, labels = plugin.worker_kv_pool(config, vc)
        per_block = numbers["vllm.kv_block_bytes"]
        # vLLM's own page sizes of the layers this worker holds.
        assert per_block == sum(s.page_size_bytes for s in spec.values()) == by_hand[rank], (rank, numbers)
        assert numbers["vllm.kv_layers"] == layers[rank] == len(spec)
        assert labels == {"vllm.kv_pool_from": plugin.FROM_SPEC}
        # The pool is the memory vLLM allocates for this worker.
        assert numbers["vllm.num_gpu_blocks"] == config.num_blocks > 0
        assert numbers["vllm.kv_pool_bytes"] == config.num_blocks * per_block
        assert numbers["vllm.kv_pool_bytes"] == max(t.size for t in config.kv_cache_tensors)
        assert numbers["vllm.block_size"] == BLOCK
        # The old all-heads-all-layers figure was wrong for every one of these workers.
        assert per_block < old, (per_block, old)


def test_the_old_figure_was_n_times_too_large(tmp_path):
    """Tensor parallel 2 halves a worker's KV heads, pipeline parallel 2 its
    layers; MLA stores a 576-wide latent per layer, not 2 x 16 heads x 128."""
    tp2 = engine_config(tmp_path, LLAMA, tp=2)
    _, configs = engine_kv_configs(tp2)
    assert plugin.worker_kv_pool(configs[1], tp2)[0]["vllm.kv_block_bytes"] * 2 == all_heads_all_layers(LLAMA)
    mla = engine_config(tmp_path, DEEPSEEK_V2_LITE)
    _, configs = engine_kv_configs(mla)
    got = plugin.worker_kv_pool(configs[0], mla)[0]["vllm.kv_block_bytes"]
    assert got == 27 * 576 * BF16 * BLOCK
    assert all_heads_all_layers(DEEPSEEK_V2_LITE) == 2 * 27 * 16 * 128 * BF16 * BLOCK != got


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_a_spec_the_worker_estimates_and_says_so(tmp_path, case):
    """A vLLM whose KV cache config carries no spec: the worker's figure
    comes from the model config, for its own stage and share of heads, and
    is labelled an estimate (for these plain models it is exact)."""
    hf, tp, pp, by_hand, layers = CASES[case]
    vc = engine_config(tmp_path, hf, tp, pp)
    _, configs = engine_kv_configs(vc)
    for rank, config in enumerate(configs):
        vc.parallel_config.rank = rank  # as vLLM's worker sets it
        numbers, labels = plugin.worker_kv_pool(types.SimpleNamespace(num_blocks=config.num_blocks), vc)
        assert labels == {"vllm.kv_pool_from": plugin.ESTIMATE_WORKER}
        assert numbers["vllm.kv_block_bytes"] == by_hand[rank], (rank, numbers)
        assert numbers["vllm.kv_layers"] == layers[rank]
        assert numbers["vllm.kv_pool_bytes"] == config.num_blocks * by_hand[rank]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_api_servers_pool_is_all_workers_pools_and_marked_an_estimate(tmp_path, case):
    """The stat logger in the API server has no worker's spec: its capacity
    is the model config's estimate of every worker's pool together."""
    hf, tp, pp, _, _ = CASES[case]
    vc = engine_config(tmp_path, hf, tp, pp)
    _, configs = engine_kv_configs(vc)
    logger = plugin.OomscopeStatLogger(vc)
    pools = [plugin.worker_kv_pool(c, vc)[0]["vllm.kv_pool_bytes"] for c in configs]
    assert logger._pool_bytes == sum(pools), (logger._pool_bytes, pools)
    assert logger._labels["vllm.kv_pool_from"] == plugin.ESTIMATE_ALL
    assert logger._numbers["vllm.tensor_parallel_size"] == tp
    assert logger._numbers["vllm.pipeline_parallel_size"] == pp


HOOK_RUN = textwrap.dedent('''
    import json, sys, time, oomscope
    sys.path.insert(0, sys.argv[2])
    from oomscope import vllm as plugin
    from test_kv_spec import LLAMA, engine_config, engine_kv_configs
    import pathlib
    oomscope.start(collector=sys.argv[1], name="vllm-kv-worker", interval_s=0.05)
    plugin.register()  # a process of vLLM's: tags the agent, wraps the hand-over
    plugin.register()  # loaded again: still one report
    from vllm.v1.worker.worker_base import WorkerWrapperBase
    vc = engine_config(pathlib.Path(sys.argv[3]), LLAMA, tp=1, pp=2)
    specs, configs = engine_kv_configs(vc)

    class Worker:
        """The GPU worker the CPU build cannot run: it takes its config."""
        def initialize_from_config(self, config):
            self.config = config

    reports = []
    set_context = oomscope.set_context
    oomscope.set_context = lambda **kw: (reports.append(kw), set_context(**kw))
    wrapper = WorkerWrapperBase(rpc_rank=0, global_rank=1)  # the second stage
    wrapper.vllm_config, wrapper.worker = vc, Worker()
    wrapper.initialize_from_config(configs)
    assert wrapper.worker.config is configs[1]
    assert len(reports) == 1, reports
    print(json.dumps({"agent": oomscope.agent_id(), "blocks": configs[1].num_blocks,
                      "page_sizes": sum(s.page_size_bytes for s in specs[1].values())}))
    time.sleep(0.3)  # samples after the report
    assert oomscope.flush(10)
    oomscope.stop()
''')


def test_the_worker_that_holds_the_pool_reports_it_to_its_agent(tmp_path):
    """Through vLLM's own WorkerWrapperBase (the hand-over every executor
    uses): the process of the second pipeline stage sends its own pool,
    before vLLM allocates it, to the collector as its agent's context."""
    collector = harness.Collector(tmp_path).start()
    try:
        tests = os.path.dirname(os.path.abspath(__file__))
        r = subprocess.run([sys.executable, "-c", HOOK_RUN, collector.url, tests, str(tmp_path)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-4000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        t = collector.timeline(out["agent"])
        numbers = [s["context"]["numbers"] for s in t["samples"]
                   if "vllm.kv_block_bytes" in (s.get("context") or {}).get("numbers", {})]
        assert numbers, t["samples"][-1:]
        last = numbers[-1]
        # Layers 2 and 3 of 4, both KV heads: half the old figure.
        assert last["vllm.kv_block_bytes"] == out["page_sizes"] == 2 * 2 * 2 * 64 * BF16 * BLOCK, last
        assert last["vllm.kv_pool_bytes"] == out["blocks"] * out["page_sizes"], last
        assert last["vllm.kv_layers"] == 2
        labels = [s["context"]["labels"] for s in t["samples"] if (s.get("context") or {}).get("labels")]
        assert labels[-1]["vllm.kv_pool_from"] == plugin.FROM_SPEC, labels[-1]
    finally:
        collector.stop()
