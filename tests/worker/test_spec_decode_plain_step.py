"""The speculative runner's plain step: a step in which no request verifies a draft samples like
speculation off, and gives exactly what the full verification path gives for it."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from runner_harness import write_tiny_llama
from spec_harness import SpecScheduler, make_spec_runner

from conveyor.config import SpeculativeConfig, SpeculativeMethod
from conveyor.core.outputs import TokenLogprobs
from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import HandedLogits
from conveyor.worker.sampling_metadata import SamplingBatch
from conveyor.worker.spec_decode.spec_decoder import SpecDecoder

# Distinct ids: n-gram lookup (min 2) finds nothing at first, drafts come once the output repeats.
PROMPTS = {"a": [(7 * i + 3) % 250 + 3 for i in range(23)], "b": [(11 * i + 5) % 250 + 3 for i in range(9)],
           "c": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}
NGRAM = SpeculativeConfig(SpeculativeMethod.NGRAM, 3, prompt_lookup_min=2, prompt_lookup_max=4)
PARAMS = [  # (params, whether some step verifies drafts: penalties keep the tiny model from repeating)
    (SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2), True),
    (SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=1), True),
    (SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, frequency_penalty=0.2, min_tokens=8,
                    max_tokens=20), False),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-plain-step"))


def generate(model_dir: pathlib.Path, config: SpeculativeConfig | None,
             params: SamplingParams) -> tuple[dict[str, list[int]], list[list[TokenLogprobs]], int]:
    """(outputs, the logprobs of each step's requests in id order, drafts verified)"""
    runner, scheduler = make_spec_runner(model_dir, config), SpecScheduler()
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, params)
    logprobs: list[list[TokenLogprobs]] = []
    while not all(request.done for request in scheduler.requests.values()):
        scheduler.step(runner)
        assert scheduler.last_output is not None
        logprobs.extend(scheduler.last_output.logprobs[r] for r in sorted(scheduler.last_output.logprobs))
    return {r: request.output for r, request in scheduler.requests.items()}, logprobs, scheduler.stats.num_drafts


@pytest.mark.parametrize(("params", "verifies"), PARAMS)
def test_plain_steps_give_what_verification_and_speculation_off_give(model_dir: pathlib.Path,
                                                                     params: SamplingParams, verifies: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"plain": 0}
    plain_step = SpecDecoder.plain_step

    def counted(self: SpecDecoder, *args: object) -> object:
        calls["plain"] += 1
        return plain_step(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SpecDecoder, "plain_step", counted)
    fast = generate(model_dir, NGRAM, params)
    assert calls["plain"] > 0 and (fast[2] > 0) == verifies
    monkeypatch.setattr(SpecDecoder, "plain_step",
                        lambda self, host, sampling: self.verify_step(host, sampling, {}))
    full = generate(model_dir, NGRAM, params)
    off = generate(model_dir, None, params)
    assert fast[0] == full[0] == off[0]
    assert _records(fast[1]) == _records(full[1])


def _records(logprobs: list[list[TokenLogprobs]]) -> list[tuple[int, float, list[int]]]:
    return [(lp.token_id, round(lp.logprob, 5), lp.top_token_ids) for entry in logprobs for lp in entry]


def test_the_sampler_gets_the_lm_heads_logits_as_the_plain_runner_hands_them(model_dir: pathlib.Path) -> None:
    """Plain and verification steps pass the LM head's logits in its own dtype (bf16 on a GPU, where
    the fused sampler reads them without a float32 copy), as the runner without speculation does."""
    runner, scheduler = make_spec_runner(model_dir, NGRAM), SpecScheduler()
    decoder = runner.spec_decoder
    assert decoder is not None
    head = decoder.target.lm_head_logits
    decoder.target = dataclasses.replace(decoder.target, lm_head_logits=lambda rows: head(rows).bfloat16())
    seen: list[torch.dtype] = []
    sample = runner.sampler.sample

    def recording(logits: torch.Tensor | HandedLogits, batch: SamplingBatch) -> torch.Tensor:
        seen.append((logits.peek() if isinstance(logits, HandedLogits) else logits).dtype)
        return sample(logits, batch)

    runner.sampler.sample = recording  # type: ignore[method-assign]
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while not all(request.done for request in scheduler.requests.values()):
        scheduler.step(runner)
    assert scheduler.stats.num_drafts > 0 and seen and set(seen) == {torch.bfloat16}
