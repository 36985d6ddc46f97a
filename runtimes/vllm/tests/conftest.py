"""A real vLLM (its CPU build, in .venv-vllm; `scripts/setup-vllm` makes it)
serving a tiny random-weight Llama under `oomscope run`, against a real
collector. The collector and CLI helpers are agent-python's test harness."""

import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_spec = importlib.util.spec_from_file_location(
    "agent_harness", os.path.join(ROOT, "agent-python", "tests", "conftest.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
