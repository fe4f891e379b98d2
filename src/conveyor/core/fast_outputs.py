"""A constructor for the per-request, per-step output type that skips the frozen-dataclass `__init__`.

Why: a frozen dataclass's generated `__init__` sets each field through `object.__setattr__`, which on
the shared 2-core CI machine costs 1-3 us for an `EngineCoreOutput`: more than the whole per-request
budget of a step (0.5 ms / 256 requests). It builds the same objects (equal, same fields, still
immutable) by filling `__dict__` directly. tests/core/test_fast_outputs.py checks it stays in sync with
the dataclass definitions in outputs.py.
"""

from __future__ import annotations

from conveyor.core.outputs import EngineCoreOutput, TokenLogprobs

_new = object.__new__
_set = object.__setattr__


def token_output(request_id: str, new_token_ids: list[int], new_logprobs: list[TokenLogprobs]) -> EngineCoreOutput:
    """== EngineCoreOutput(request_id, new_token_ids, new_logprobs): an unfinished request's news."""
    output = _new(EngineCoreOutput)
    _set(output, "__dict__", {
        "request_id": request_id, "new_token_ids": new_token_ids, "new_logprobs": new_logprobs,
        "finish_reason": None, "stop_reason": None, "timings": None, "num_prompt_tokens": 0,
        "num_cached_tokens": 0, "num_preemptions": 0})
    return output

