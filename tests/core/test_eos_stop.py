"""EOS as vLLM stops on it: the primary (the tokenizer's EOS) ends a request with no stop_reason, every
other EOS id of the model as a stop token id with its id as the stop_reason; ignore_eos drops them all and
min_tokens suppresses them all (the scheduler's stop check and the worker's logits mask alike)."""

from __future__ import annotations

import torch
from core_builders import Driver, make_request, make_scheduler

from conveyor.core.lifecycle import EosTokenIds, with_eos_stop_ids
from conveyor.request import FinishReason
from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampling_metadata import (
    SamplingRequest,
    VocabInfo,
    build_sampling_batch,
)

LLAMA31 = EosTokenIds.resolve(128009, (128001, 128008, 128009))
"""Llama-3.1-8B-Instruct: tokenizer EOS <|eot_id|>, config.json eos [128001, 128008, 128009]."""


def _run(tokens: list[int], eos: EosTokenIds = LLAMA31, **params: object) -> tuple[FinishReason | None, object]:
    """Feed `tokens` one per step to one request made as the engine makes it; (finish reason, stop_reason)."""
    scheduler = make_scheduler(max_model_len=32)
    driver = Driver(scheduler)
    request = make_request("a", num_prompt_tokens=4, eos_token_id=eos.primary, **params)
    request.sampling_params = with_eos_stop_ids(request.sampling_params, eos)
    scheduler.add_request(request)
    for token in tokens:
        finished = driver.step({"a": [token]}).finished
        if finished:
            return finished["a"].finish_reason, finished["a"].stop_reason
    return None, None


def test_the_primary_eos_is_the_tokenizers_else_the_models_first() -> None:
    assert LLAMA31.primary == 128009 and LLAMA31.all == (128009, 128001, 128008)
    assert EosTokenIds.resolve(None, (151645, 151643)) == EosTokenIds(151645, (151645, 151643))
    assert EosTokenIds.resolve(2, (128001,)).all == (2, 128001)  # a foreign tokenizer's EOS stops too
    assert EosTokenIds.resolve(None, ()).all == ()


def test_the_primary_eos_stops_with_no_stop_reason() -> None:
    assert _run([5, 128009, 6]) == (FinishReason.STOP, None)


def test_every_other_model_eos_stops_with_its_id_as_reason() -> None:
    assert _run([5, 128001]) == (FinishReason.STOP, 128001)
    assert _run([128008]) == (FinishReason.STOP, 128008)


def test_ignore_eos_stops_on_none_of_them() -> None:
    assert _run([128009, 128001, 128008, 5], max_tokens=4, ignore_eos=True) == (FinishReason.LENGTH, None)
    params = SamplingParams(ignore_eos=True, stop_token_ids=(7,))
    assert with_eos_stop_ids(params, LLAMA31) is params


def test_user_stop_token_ids_stay_first_and_unrepeated() -> None:
    params = with_eos_stop_ids(SamplingParams(stop_token_ids=(7, 128001)), LLAMA31)
    assert params.stop_token_ids == (7, 128001, 128009, 128008)


def test_min_tokens_suppresses_every_eos_in_the_stop_check() -> None:
    assert _run([128009, 128001, 128008, 128001], min_tokens=4) == (FinishReason.STOP, 128001)


def test_min_tokens_masks_every_eos_in_the_sampler() -> None:
    """The worker's mask reads the request's params (on every tensor-parallel rank): all EOS ids are in it."""
    vocab = VocabInfo(vocab_size=128256, eos_token_ids=frozenset({128001}))  # the runner knows config's only
    params = with_eos_stop_ids(SamplingParams(min_tokens=2), EosTokenIds.resolve(2, (128001, 128008)))
    batch = build_sampling_batch([SamplingRequest(params, [5, 6], 2)], vocab, torch.device("cpu"))
    assert batch.masked_token_ids is not None
    assert sorted(batch.masked_token_ids.tolist()) == [2, 128001, 128008]
