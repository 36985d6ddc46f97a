"""A real `transformers serve` (PyPI transformers 5.x, in .venv-tf;
`scripts/setup-transformers` makes it) serving a tiny random Llama under
`oomscope run`, against a real collector. The collector and CLI helpers are
agent-python's test harness; the memory cgroup and prompt helpers are the
vLLM suite's."""

import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _load(name, *path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = _load("agent_harness", "agent-python", "tests", "conftest.py")
# test_vllm imports ROOT and harness from "conftest": this module, by then.
vllm_tests = _load("vllm_tests", "runtimes", "vllm", "tests", "test_vllm.py")
