"""What is alive while the sampler runs: the LM head's logits are handed over, so the sampler's float32 copy
replaces them; the start-up profile calls the LM head a real step calls and takes the edited (float32 copy)
path, the heaviest a full staged batch can take (docs/performance.md, "The KV gap, component by component")."""

from __future__ import annotations

import pathlib
import weakref
from collections.abc import Callable

import pytest
import torch
from runner_harness import ToyScheduler, make_runner, write_tiny_llama
from test_sampler_chunks import LiveBytes, as_on_cuda

from conveyor.sampling_params import SamplingParams
from conveyor.worker import sampler as sampler_module
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.sampler import HandedLogits, Sampler, edits_logits, reads_lm_head_logits
from conveyor.worker.sampler_staged import STAGED_BYTES_PER_LOGIT
from conveyor.worker.sampling_metadata import SamplingBatch, VocabInfo, build_sampling_batch
from conveyor.worker.warmup import profile_sampling_requests

CPU = torch.device("cpu")
NUM_ROWS, VOCAB_SIZE = 64, 4096


def alive_at_staged_entry(monkeypatch: pytest.MonkeyPatch, watched: list[weakref.ref]) -> list[bool]:
    """Record, at each entry of the staged path, whether the newest watched tensor is still alive."""
    staged = sampler_module.staged_sample
    seen: list[bool] = []

    def recording(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        seen.append(watched[-1]() is not None)
        return staged(logits, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "staged_sample", recording)
    return seen


def profile_batch(num_rows: int = NUM_ROWS) -> SamplingBatch:
    return build_sampling_batch(profile_sampling_requests(num_rows), VocabInfo(VOCAB_SIZE, frozenset()), CPU)


def test_the_profiles_requests_take_the_float32_copy_path() -> None:
    # One edited row makes the float32 copy of the whole batch; the profile must reserve it (on CUDA too).
    batch = profile_batch()
    assert edits_logits(batch) and not reads_lm_head_logits(batch, fused_available=True)


@pytest.mark.parametrize("handed", [True, False])
def test_the_float32_copy_replaces_handed_logits(handed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = (torch.randn(NUM_ROWS, VOCAB_SIZE, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    expected = Sampler(torch.Generator().manual_seed(0)).sample(logits.clone(), profile_batch()).tolist()
    watched = [weakref.ref(logits)]
    seen = alive_at_staged_entry(monkeypatch, watched)
    as_on_cuda(monkeypatch)
    argument = HandedLogits(logits) if handed else logits
    del logits
    sampled = Sampler(torch.Generator().manual_seed(0)).sample(argument, profile_batch()).tolist()
    assert sampled == expected  # the same tokens, handed over or not
    assert seen == [not handed]  # a caller's reference keeps 2 B/logit alive beside the copy


def test_the_profile_step_holds_the_copy_the_noise_and_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    # As CUDA dispatches it: the float32 copy and the shared noise (8 B/logit) for the whole batch, the staged
    # temporaries of one chunk; the handed bf16 logits are gone before the noise is drawn.
    logits = (torch.randn(NUM_ROWS, VOCAB_SIZE) * 3).bfloat16()  # [N, V]
    watched = [weakref.ref(logits)]
    seen = alive_at_staged_entry(monkeypatch, watched)
    as_on_cuda(monkeypatch)
    chunk = 4 * VOCAB_SIZE * STAGED_BYTES_PER_LOGIT
    handed = HandedLogits(logits)
    del logits
    with LiveBytes() as live:
        Sampler(torch.Generator().manual_seed(0), chunk).sample(handed, profile_batch())
    whole_batch = NUM_ROWS * VOCAB_SIZE * 8
    assert whole_batch < live.peak <= whole_batch + chunk and seen == [False]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def bf16_lm_head(runner: ModelRunner, calls: list[str]) -> list[weakref.ref]:
    """Make the LM head return bf16 (a GPU's dtype) and watch each result; record compute_logits calls."""
    head, compute = runner.model.lm_head_logits, runner.model.compute_logits
    watched: list[weakref.ref] = []

    def lm_head_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden).bfloat16()
        watched.append(weakref.ref(logits))
        calls.append("lm_head_logits")
        return logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        calls.append("compute_logits")
        return compute(hidden)

    runner.model.lm_head_logits = lm_head_logits  # type: ignore[method-assign]
    runner.model.compute_logits = compute_logits  # type: ignore[method-assign]
    return watched


def one_step(runner: ModelRunner) -> None:
    scheduler = ToyScheduler()
    scheduler.add("a", [3, 4, 5], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=2))
    scheduler.step(runner)


@pytest.mark.parametrize("run", [ModelRunner.profile_run, one_step], ids=["profile", "step"])
def test_runner_hands_over_the_lm_heads_logits(run: Callable[[ModelRunner], object], model_dir: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The profile makes the call a real step makes (no compute_logits float32 copy beside the LM head's), and
    # neither keeps the bf16 logits alive once the sampler has its float32 copy (the CPU always copies).
    runner, calls = make_runner(model_dir), []
    watched = bf16_lm_head(runner, calls)
    seen = alive_at_staged_entry(monkeypatch, watched)
    run(runner)
    assert calls == ["lm_head_logits"] and seen == [False]
