"""The public API as a typed program uses it: `mypy --strict` checks this file
against the installed package's stubs (scripts/test), and the wheel's
clean-venv round trip runs it against a collector:

    python typed_example.py http://127.0.0.1:PORT NAME

Not a pytest module (no test_ prefix): it needs a collector of its own."""

from __future__ import annotations

import json
import sys

import oomscope
import oomscope.query


def serve(collector: str, name: str) -> str:
    """Starts an agent, serves two requests in a load phase's shadow, and
    returns the agent id once the collector acked everything."""
    started: bool = oomscope.start(collector=collector, name=name, interval_s=0.2,
                                   census_auto=False, spool_dir=None)
    assert started and oomscope.is_running()
    with oomscope.phase("load", model="tiny", dtype="float32"):
        weights = [0.0] * 1000
    for i in range(2):
        with oomscope.request(id="req-%d" % i, prompt_tokens=8, max_tokens=16) as r:
            r.output_tokens = len(weights) % 7
        oomscope.set_context(active_sequences=1, queued=0)
    oomscope.set_labels(example="typed")
    oomscope.record_request("late", started_s_ago=0.1, prompt_tokens=4, output_tokens=2)
    assert oomscope.snapshot() is None  # no CUDA here
    stats = oomscope.stats()
    assert stats is not None and stats["pid"] > 0
    assert oomscope.flush(10.0), "the collector did not ack"
    agent = oomscope.agent_id()
    assert agent is not None
    return agent


def _keyword_only() -> None:
    """Never called: the ignore below is needed only while start() refuses a
    positional argument (`--strict` reports an ignore that is not needed)."""
    oomscope.start("http://127.0.0.1:9")  # type: ignore[call-arg]


def main() -> None:
    collector, name = sys.argv[1], sys.argv[2]
    agent = serve(collector, name)
    listed = json.dumps(oomscope.query.agents(collector))
    assert agent in listed, (agent, listed)
    print("agent", agent, "stopped" if oomscope.stop() else "stopped (unacked)")


if __name__ == "__main__":
    main()
