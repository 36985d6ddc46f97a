"""A leak planted in a real vLLM's Worker for `test_vllm_deaths.py`: every
model step keeps WORKER_LEAK_BYTES (from the environment) in a module-level
list, as a per-step debug record that nobody drops would. On PYTHONPATH only
for the test that asks for it; every process of that vLLM imports this file.

Only the Worker runs the model, so the model runner's `execute_model` is
wrapped, when vLLM imports it: the API server and EngineCore keep nothing.
The bytes are written (not calloc'd zero pages) so that they are resident:
the kernel must see them."""

import importlib.abc
import os
import sys

KEPT = []
STEP_BYTES = int(os.environ.get("WORKER_LEAK_BYTES", "0"))
RUNNER = "vllm.v1.worker.gpu_model_runner"  # CPUModelRunner inherits execute_model


def _patch(module):
    cls = module.GPUModelRunner
    execute = cls.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        if scheduler_output.total_num_scheduled_tokens:  # a real step, not an idle call
            KEPT.append(b"\x5a" * STEP_BYTES)
        return execute(self, scheduler_output, *args, **kwargs)

    cls.execute_model = execute_model


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != RUNNER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if STEP_BYTES > 0:
    sys.meta_path.insert(0, _PatchOnImport())
