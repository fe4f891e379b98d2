"""The one admission rule: lengths and token ids (400, naming the field), the in-flight and prefill-token
caps (503) with vLLM 0.32's comparisons, and the counts shared exactly by several front ends."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.config import SchedulerConfig
from conveyor.core.lifecycle import KVPoolSize
from conveyor.engine.admission import (
    AdmissionControl,
    QueueLimits,
    RequestLimits,
    check_request,
    make_shared_counts,
)
from conveyor.engine.types import EngineOverloadedError, OverloadReason, RequestRejectedError
from conveyor.sampling_params import GrammarKind, SamplingParams, StructuredOutput

LIMITS = RequestLimits(SchedulerConfig(max_model_len=10), KVPoolSize(num_blocks=64, block_size=16), vocab_size=100)


@pytest.mark.parametrize(("prompt_len", "max_tokens", "field"), [
    (0, 4, "prompt"), (11, 1, "prompt"), (10, None, "prompt"), (8, 3, "max_tokens")])
def test_length_rule_names_the_field(prompt_len: int, max_tokens: int | None, field: str) -> None:
    with pytest.raises(RequestRejectedError) as info:
        check_request([1] * prompt_len, SamplingParams(max_tokens=max_tokens), LIMITS)
    assert info.value.field == field
    if field == "max_tokens":
        assert "max_model_len (10)" in str(info.value)


def test_out_of_vocab_token_and_exact_fit() -> None:
    with pytest.raises(RequestRejectedError, match=r"token id 100 is out of range \[0, 100\)"):
        check_request([5, 100], SamplingParams(max_tokens=2), LIMITS)
    with pytest.raises(RequestRejectedError, match="token id -1"):
        check_request([-1], SamplingParams(max_tokens=2), LIMITS)
    check_request([1] * 8, SamplingParams(max_tokens=2), LIMITS)


def test_kv_capacity_is_part_of_the_rule() -> None:
    small = RequestLimits(SchedulerConfig(max_model_len=2048), KVPoolSize(num_blocks=2, block_size=16), 100)
    with pytest.raises(RequestRejectedError) as info:
        check_request([1] * 40, SamplingParams(max_tokens=1), small)
    assert info.value.field == "prompt" and "KV cache" in str(info.value)


def test_in_flight_cap_counts_until_release_and_n_counts_n() -> None:
    control = AdmissionControl(QueueLimits(max_num_queued_reqs=3, max_num_queued_tokens=None))
    control.admit("a", 5)
    control.admit("b", 5, num_seqs=2)
    with pytest.raises(EngineOverloadedError) as info:
        control.admit("c", 5)  # 3 + 1 > 3
    assert info.value.reason is OverloadReason.MAX_NUM_QUEUED_REQS
    control.prefill_done("a")  # running still counts
    with pytest.raises(EngineOverloadedError):
        control.admit("c", 5)
    control.release("a")
    control.release("a")  # idempotent
    control.admit("c", 5)
    assert control.num_in_flight == 3
    with pytest.raises(RequestRejectedError, match="already in flight"):
        control.admit("c", 5)


def test_prefill_token_cap_refuses_at_or_above_the_cap() -> None:
    control = AdmissionControl(QueueLimits(max_num_queued_reqs=None, max_num_queued_tokens=10))
    control.admit("a", 9)
    control.admit("b", 100)  # 9 < 10: admitted, its own prompt not counted (vLLM's >= rule)
    with pytest.raises(EngineOverloadedError) as info:
        control.admit("c", 1)
    assert info.value.reason is OverloadReason.MAX_NUM_QUEUED_TOKENS
    control.prefill_done("b")
    control.admit("c", 1)
    assert control.num_queued_tokens == 10


def test_shared_counts_make_the_cap_global_across_front_ends() -> None:
    shared = make_shared_counts(2)
    limits = QueueLimits(max_num_queued_reqs=3, max_num_queued_tokens=None)
    first, second = AdmissionControl(limits, shared, 0), AdmissionControl(limits, shared, 1)
    first.admit("a", 1)
    first.admit("b", 1)
    second.admit("c", 1)
    with pytest.raises(EngineOverloadedError):
        second.admit("d", 1)
    with pytest.raises(EngineOverloadedError):
        first.admit("d", 1)
    first.release("a")
    second.admit("d", 1)
    assert (first.num_in_flight, second.num_in_flight) == (1, 2)


@pytest.mark.parametrize(("flags", "says"), [({"speculative": True}, "speculative decoding"),
                                             ({"tensor_parallel": True}, "tensor parallelism")])
def test_structured_outputs_are_refused_where_the_runner_cannot_mask(flags: dict[str, bool], says: str) -> None:
    """A constraint the runner would not apply is a 400 naming the field, never free text."""
    limits = dataclasses.replace(LIMITS, **flags)
    params = SamplingParams(max_tokens=2, structured_output=StructuredOutput(GrammarKind.CHOICE, '["a", "b"]'))
    with pytest.raises(RequestRejectedError, match=f"structured_outputs: .*{says}") as error:
        check_request([1, 2], params, limits)
    assert error.value.field == "structured_outputs"
    check_request([1, 2], params, LIMITS)  # the same constraint is fine on a single-rank, non-speculative server
