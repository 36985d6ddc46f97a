"""A leak planted in a real vLLM's API server for `test_vllm.py`: every
completion keeps its request, its response and a 256 KiB buffer in a
module-level list, as a response log written by a newcomer would. On
PYTHONPATH only for the test that asks for it; every process of that vLLM
imports it, and only `vllm serve` itself (the API server) is patched.

vLLM freezes its start-up heap after start (`freeze_gc_heap`), this list
with it, so the list that holds the leak is in no generation gc lists."""

import sys

KEPT = []
KEPT_BYTES = 256 * 1024

if sys.argv[1:2] == ["serve"]:
    from vllm.entrypoints.openai.completion import serving

    _create = serving.OpenAIServingCompletion.create_completion

    async def create_completion(self, request, raw_request=None):
        response = await _create(self, request, raw_request)
        KEPT.append((request, response, bytes(KEPT_BYTES)))
        return response

    serving.OpenAIServingCompletion.create_completion = create_completion
