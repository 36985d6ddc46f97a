"""The vLLM plugin's API over a real agent and collector, with vLLM's stats
objects built by hand (their fields as vLLM 0.32 names them): the real vLLM
runs in runtimes/vllm/tests. Each case runs in a fresh interpreter."""

import json
import subprocess
import sys
import textwrap

from conftest import wait_for

PLUGIN_RUN = textwrap.dedent('''
    import sys, time, types, oomscope
    from oomscope import vllm as plugin
    oomscope.start(collector=sys.argv[1], name="vllm-fake", interval_s=0.05, boundary_min_interval_s=0)
    plugin.register()  # tags the running agent; never starts a second
    assert oomscope.start() is False
    ns = types.SimpleNamespace
    config = ns(
        cache_config=ns(num_gpu_blocks=40, block_size=16, gpu_memory_utilization=0.9,
                        kv_cache_memory_bytes=None, cache_dtype="auto"),
        scheduler_config=ns(max_num_seqs=32, max_num_batched_tokens=2048),
        model_config=ns(max_model_len=2048, model="tiny", dtype="torch.bfloat16", enforce_eager=True,
                        hf_config=ns(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=4,
                                     hidden_size=256, head_dim=64)))
    plugin.MIN_RECORD_INTERVAL_S = 0
    log = plugin.OomscopeStatLogger(config, engine_index=0)
    log.log_engine_initialized()
    for step in range(5):
        sched = ns(num_running_reqs=5, num_waiting_reqs=150 + step, kv_cache_usage=1.0)
        it = ns(num_preempted_reqs=1, finished_requests=[
            ns(request_id="r%d" % step, e2e_latency=0.5, num_prompt_tokens=100,
               num_generation_tokens=20, max_tokens_param=32)])
        log.record(scheduler_stats=sched, iteration_stats=it, mm_cache_stats=None, engine_idx=0)
        time.sleep(0.1)
    # A vLLM whose stats lack these fields: logged once, no exception.
    log.record(scheduler_stats=object(), iteration_stats=None)
    print(oomscope.agent_id())
    time.sleep(0.3)
    oomscope.stop()
''')


def test_the_plugin_tags_the_agent_and_the_stats_become_context_and_requests(collector):
    r = subprocess.run([sys.executable, "-c", PLUGIN_RUN, collector.url], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    agent_id = r.stdout.strip().splitlines()[-1]
    agents = {a["hello"]["agent_id"]: a for a in collector.agents()}
    hello = agents[agent_id]["hello"]
    # Not a worker or engine process: the plugin names it the API server.
    assert hello["role"] == "api_server" and hello["labels"]["serving_runtime"] == "vllm", hello
    t = wait_for(lambda: (lambda t: t if len([e for e in t["events"] if e["kind"] == "request"]) >= 10
                          else None)(collector.timeline(agent_id)), 20)
    contexts = [s["context"] for s in t["samples"] if s.get("context")]
    last = [c for c in contexts if c["queued"] > 0][-1]
    assert last["active_sequences"] == 5 and last["queued"] == 154, last
    assert last["numbers"]["kv_cache_usage"] == 1.0 and last["numbers"]["preemptions"] == 5, last
    # 40 blocks x 16 tokens x (K+V x 4 layers x 2 heads x 64 dims x 2 bytes).
    assert last["kv_cache_capacity_bytes"] == 40 * 16 * 2 * 4 * 2 * 64 * 2, last
    assert last["kv_cache_bytes"] == last["kv_cache_capacity_bytes"]
    # The API server holds no worker's KV cache spec: its figure says it is an estimate.
    assert last["labels"]["vllm.kv_pool_from"] == "estimate: model config, all workers", last["labels"]
    assert last["labels"]["vllm.kv_cache_dtype"] == "auto", last["labels"]
    assert last["numbers"]["vllm.max_num_seqs"] == 32
    loads = [e["phase"] for e in t["events"] if e["kind"] == "phase" and e["phase"]["name"] == "load"]
    assert [p["start"] for p in loads] == [True, False], loads
    assert loads[1]["model"]["name"] == "tiny" and loads[1]["model"]["dtype"] == "torch.bfloat16", loads
    starts = {e["request"]["request_id"]: e["time_ns"] for e in t["events"]
              if e["kind"] == "request" and e["request"]["start"]}
    ends = {e["request"]["request_id"]: e["time_ns"] for e in t["events"]
            if e["kind"] == "request" and not e["request"]["start"]}
    assert sorted(starts) == ["r0", "r1", "r2", "r3", "r4"], starts
    # Each start is stamped its e2e latency (0.5 s) before its end.
    for rid in starts:
        assert 0.4e9 < ends[rid] - starts[rid] < 0.6e9, (rid, ends[rid] - starts[rid])
    assert "stats of this vLLM differ" in r.stderr or "stopped" in r.stderr, r.stderr


def logger_run(name, steps, boundary_min_interval_s=0):
    """A script: an agent named `name` (its samples at request ends only, at
    most one per `boundary_min_interval_s`), vLLM's stat logger at its
    default record interval over a minimal config, then `steps` (which
    drive `log`), then the agent id printed."""
    return textwrap.dedent('''
        import sys, time, types, oomscope
        from oomscope import vllm as plugin
        oomscope.start(collector=sys.argv[1], name=%r, interval_s=5, boundary_min_interval_s=%r)
        ns = types.SimpleNamespace
        config = ns(cache_config=ns(num_gpu_blocks=40, block_size=16), scheduler_config=ns(),
                    model_config=ns(hf_config=ns()))
        log = plugin.OomscopeStatLogger(config, engine_index=0)
    ''') % (name, boundary_min_interval_s) + textwrap.dedent(steps) + textwrap.dedent('''
        print(oomscope.agent_id())
        assert oomscope.flush(10)
        oomscope.stop()
    ''')


def request_end_contexts(collector, script):
    """Runs `script` (a logger_run) against `collector`: the contexts of its
    request-end samples, and its whole timeline."""
    r = subprocess.run([sys.executable, "-c", script, collector.url], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    t = collector.timeline(r.stdout.strip().splitlines()[-1])
    return [s["context"] for s in t["samples"]
            if s.get("context") and s["context"].get("phase") == "after_request"], t


ALONE_RUN = logger_run("vllm-alone", '''
    for step in range(3):
        # A request run alone: its decode steps, then the step that finishes
        # it, well within one record interval; vLLM counts the running
        # requests of that last step without the finished one.
        for _ in range(3):
            log.record(scheduler_stats=ns(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1),
                       iteration_stats=ns(num_preempted_reqs=0, finished_requests=[]))
        log.record(scheduler_stats=ns(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0),
                   iteration_stats=ns(num_preempted_reqs=0, finished_requests=[
                       ns(request_id="r%d" % step, e2e_latency=0.05, num_prompt_tokens=10,
                          num_generation_tokens=4, max_tokens_param=4)]))
        time.sleep(0.05)
''')


def test_a_request_run_alone_ends_between_requests(collector):
    # The analysis reads a host's growth from the samples taken between
    # requests; in a vLLM served one request at a time, each request's end is
    # the only such sample, so it must not carry the step before's context.
    from oomscope import vllm as plugin
    assert plugin.MIN_RECORD_INTERVAL_S > 0.05  # the steps below come within one interval
    ends, t = request_end_contexts(collector, ALONE_RUN)
    assert len(ends) == 3, [s.get("context") for s in t["samples"]]
    assert [c["active_sequences"] for c in ends] == [0, 0, 0], ends
    assert [c["requests_done"] for c in ends] == [1, 2, 3], ends


PEAK_RUN = logger_run("vllm-peak", '''
    done = ns(num_preempted_reqs=0, finished_requests=[
        ns(request_id="r0", e2e_latency=0.05, num_prompt_tokens=10, num_generation_tokens=4, max_tokens_param=4)])
    busy = ns(num_preempted_reqs=0, finished_requests=[])
    log.record(scheduler_stats=ns(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5), iteration_stats=done)
    # Within one record interval: the pool full and 7 waiting for one step, then less.
    for usage, waiting in [(0.8, 3), (1.0, 7), (0.6, 2)]:
        log.record(scheduler_stats=ns(num_running_reqs=2, num_waiting_reqs=waiting, kv_cache_usage=usage),
                   iteration_stats=busy)
    done.finished_requests[0].request_id = "r1"
    log.record(scheduler_stats=ns(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.3), iteration_stats=done)
    # The next record: only its own steps.
    time.sleep(plugin.MIN_RECORD_INTERVAL_S + 0.05)
    done.finished_requests[0].request_id = "r2"
    log.record(scheduler_stats=ns(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.1), iteration_stats=done)
''')


def test_a_full_pool_between_records_is_still_recorded(collector):
    """The logger records at most every MIN_RECORD_INTERVAL_S (or at a
    request's end); a step between records that filled the pool must still
    show: saturation is the evidence a KV-bound diagnosis rests on."""
    ends, _ = request_end_contexts(collector, PEAK_RUN)
    got = [(c["requests_done"], c["numbers"]["kv_cache_usage"], c["queued"], c["active_sequences"]) for c in ends]
    # The steps since each record: their highest usage and queue; the running count as of the last step.
    assert got == [(1, 0.5, 1, 2), (2, 1.0, 7, 1), (3, 0.1, 0, 0)], got


def finished(rid):
    return "ns(num_preempted_reqs=0, finished_requests=[ns(request_id=%r, e2e_latency=0.05, " \
        "num_prompt_tokens=10, num_generation_tokens=4, max_tokens_param=4)])" % rid


RECORDED_RUN = logger_run("vllm-recorded", '''
    busy = ns(num_preempted_reqs=0, finished_requests=[])
    # A record of its own (the interval has passed): 20 running fill the
    # pool and 12 wait. The next step finishes all 20: vLLM counts the pool
    # after freeing them, and the 12 are not yet scheduled.
    time.sleep(plugin.MIN_RECORD_INTERVAL_S + 0.05)
    log.record(scheduler_stats=ns(num_running_reqs=20, num_waiting_reqs=12, kv_cache_usage=1.0),
               iteration_stats=busy)
    log.record(scheduler_stats=ns(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0),
               iteration_stats=%s)
''' % finished("r0"))

FOLDED_RUN = logger_run("vllm-folded", '''
    # One end sent at once; the next two within the 1 s that follows go in
    # one message. The first of them saw the pool full.
    log.record(scheduler_stats=ns(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1),
               iteration_stats=%s)
    time.sleep(0.1)  # the sampler takes that end
    log.record(scheduler_stats=ns(num_running_reqs=20, num_waiting_reqs=12, kv_cache_usage=1.0),
               iteration_stats=ns(num_preempted_reqs=0, finished_requests=[]))
    log.record(scheduler_stats=ns(num_running_reqs=10, num_waiting_reqs=2, kv_cache_usage=0.5),
               iteration_stats=%s)
    log.record(scheduler_stats=ns(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0),
               iteration_stats=%s)
''' % (finished("r0"), finished("r1"), finished("r2")), boundary_min_interval_s=1)


def test_a_full_pool_recorded_between_samples_reaches_the_next_one(collector):
    """The agent samples at request ends (and every interval_s); what the
    logger set between two samples is overwritten by its next record before
    any sample reads it. A pool full then is the evidence of a saturation
    (vLLM's, for a few engine steps of a burst), so the next sample carries
    the peak usage and queue since the one before."""
    ends, t = request_end_contexts(collector, RECORDED_RUN)
    got = [(c["requests_done"], c["numbers"]["kv_cache_usage"], c["queued"], c["active_sequences"]) for c in ends]
    # The peaks since the last sample; the running count as of now.
    assert got == [(1, 1.0, 12, 0)], [s.get("context") for s in t["samples"]]


def test_request_ends_in_one_message_each_keep_their_own_pool(collector):
    """The two ends within the spacing go in one boundary message, and the
    collector gives each its own point: the first of them with the pool
    full and 12 waiting (the peaks since the end before), the newest with
    it drained."""
    ends, t = request_end_contexts(collector, FOLDED_RUN)
    got = [(c["requests_done"], c["numbers"]["kv_cache_usage"], c["queued"], c["active_sequences"]) for c in ends]
    assert got == [(1, 0.1, 0, 1), (2, 1.0, 12, 10), (3, 0.0, 0, 0)], [s.get("context") for s in t["samples"]]
    seqs = [s["seq"] for s in t["samples"] if (s.get("context") or {}).get("phase") == "after_request"]
    assert len(seqs) == 3 and seqs[1] == seqs[2] != seqs[0], seqs
