"""The engine core logs each step's batch and wall time when --step-log-size asks, and nothing otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from engine_fakes import FakeRunner, make_fake_core

from conveyor.config import CacheConfig, EngineConfig, SchedulerConfig
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.core.policies import make_scheduler
from conveyor.core.step_log import StepRecord, step_record
from conveyor.engine.engine_core import ModelLimits, make_engine_core
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams


def run_two_requests(config: EngineConfig):  # noqa: ANN201
    core = make_fake_core(config, runner=FakeRunner(delay_s=0.002))
    core.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=3), 0.0))
    core.add_request(Request("b", [5, 6], SamplingParams(max_tokens=3), 0.0))
    while core.has_unfinished_requests():
        core.step()
    return core


def test_each_step_is_logged_with_its_composition_and_time() -> None:
    core = run_two_requests(EngineConfig(step_log_size=100))
    records = core.drain_step_log()
    assert records is not None and len(records) == 3
    prefill, *decodes = records
    assert (prefill.num_prefill_tokens, prefill.num_prefill_reqs, prefill.num_decode_tokens) == (5, 2, 0)
    assert all((d.num_decode_tokens, d.num_decode_reqs, d.num_prefill_tokens) == (2, 2, 0) for d in decodes)
    assert [d.num_context_tokens for d in decodes] == [4 + 3, 5 + 4]
    assert all(r.step_time_s >= 0.002 for r in records)  # the runner sleeps 2 ms: the step's time includes it
    assert records[0].start_s < records[1].start_s < records[2].start_s
    assert core.drain_step_log() == []  # drained


def test_off_by_default_nothing_is_recorded() -> None:
    core = run_two_requests(EngineConfig())
    assert core.step_log is None and core.drain_step_log() is None


def test_the_offline_llm_accepts_the_size_by_name() -> None:
    from conveyor.engine.llm import engine_config_from_kwargs

    assert engine_config_from_kwargs(step_log_size=8).step_log_size == 8


def test_a_negative_size_is_refused_naming_the_flag() -> None:
    import argparse

    import pytest

    from conveyor.config import ConfigError
    from conveyor.engine.args import add_engine_arguments, build_engine_config

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(ConfigError, match="step.log.size"):
        build_engine_config(parser.parse_args(["--step-log-size", "-1"]))


# --- step timing on a clock the fakes move: each step pays a known host and device cost ---

HOST_PER_STEP_S, HOST_PER_PREFILL_TOKEN_S = 1e-3, 0.5e-3
DEVICE_PER_STEP_S, DEVICE_PER_TOKEN_S, COLLECT_S = 5e-3, 0.1e-3, 0.2e-3


class StepClock:
    """The engine's clock, moved only by the runner below: elapsed time is exactly the modelled costs."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def host_launch_s(output: SchedulerOutput) -> float:
    """Schedule + prepare + launch, dearer per prefill token (as a big prefill's input preparation is)."""
    if output.is_empty:
        return 0.0
    return HOST_PER_STEP_S + HOST_PER_PREFILL_TOKEN_S * step_record(output).num_prefill_tokens


@dataclass
class ClockedRunner(FakeModelRunner):
    """The fake runner, pipelined as a device is: a launch costs the host `host_launch_s`, the device then
    works after the step before it; a collect waits for the step's tokens, then copies them out. A step with
    nothing to compute does no device work (as the real runner's launch returns at once)."""

    clock: StepClock = field(default_factory=StepClock)
    device_free_s: float = 0.0

    def launch(self, output: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:  # type: ignore[override]
        self.clock.now_s += host_launch_s(output)
        result = super().execute(output)
        if output.is_empty:
            return result, self.clock.now_s
        self.device_free_s = max(self.clock.now_s, self.device_free_s) + DEVICE_PER_STEP_S \
            + DEVICE_PER_TOKEN_S * output.total_num_scheduled_tokens
        return result, self.device_free_s

    def collect(self, handle: tuple[ModelRunnerOutput, float]) -> ModelRunnerOutput:  # type: ignore[override]
        result, done_s = handle
        if result.sampled_token_ids:
            self.clock.now_s = max(self.clock.now_s, done_s) + COLLECT_S
        return result

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(output))


def run_clocked(async_scheduling: bool) -> tuple[list[StepRecord], float]:
    """A decoding request, then a 64-token prompt arriving mid-run; the records and the busy time."""
    config = EngineConfig(step_log_size=100, cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=128, max_num_seqs=4,
                                                    async_scheduling=async_scheduling))
    clock = StepClock()
    scheduler = make_scheduler(config.scheduler, config.cache, 64, clock)
    core = make_engine_core(config, ClockedRunner(4, clock=clock), scheduler, ModelLimits(64, 128, (2,), 1000), clock)
    core.add_request(Request("a", [5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True), 0.0, eos_token_id=2))
    for step in range(50):
        if step == 4:
            core.add_request(Request("b", list(range(10, 74)), SamplingParams(max_tokens=3, ignore_eos=True),
                                     clock(), eos_token_id=2))
        if not core.has_unfinished_requests():
            break
        core.step()
    records = core.drain_step_log()
    assert records is not None
    return records, clock.now_s


def prefill_and_the_step_before(records: list[StepRecord]) -> tuple[StepRecord, StepRecord]:
    index = next(i for i, r in enumerate(records) if r.num_prefill_tokens == 64)
    assert records[index - 1].num_prefill_tokens == 0  # a decode of "a" just before "b"'s prefill
    return records[index - 1], records[index]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_records_tile_the_busy_time(async_scheduling: bool) -> None:
    """The loop here never idles between steps, so the steps' times sum to the clock: none counted twice,
    none lost (the first step of a burst's launch included)."""
    records, busy_s = run_clocked(async_scheduling)
    assert sum(r.step_time_s for r in records) == pytest.approx(busy_s, abs=1e-12)
    assert [r.start_s for r in records] == sorted(r.start_s for r in records)
    assert all(r.end_s > r.start_s for r in records)


def test_an_async_step_carries_its_own_launch_not_the_next_ones() -> None:
    """Async: the prefill's launch runs before the decode before it is settled. It is the prefill's: the
    decode logs a decode's price and the prefill its launch and more (issue 36; the rule before this charged
    the 33 ms launch to the decode, and the prefill logged a few ms)."""
    records, _ = run_clocked(async_scheduling=True)
    decode, prefill = prefill_and_the_step_before(records)
    decode_device_s = DEVICE_PER_STEP_S + DEVICE_PER_TOKEN_S * decode.num_tokens
    assert decode.step_time_s <= HOST_PER_STEP_S + decode_device_s + COLLECT_S + 1e-12
    assert prefill.step_time_s >= host_launch_s_of(64) + COLLECT_S
    assert all(r.launch_time_s == pytest.approx(host_launch_s_of(r.num_prefill_tokens)) for r in records)


def test_a_sync_step_is_one_span_as_before() -> None:
    records, _ = run_clocked(async_scheduling=False)
    assert all(r.launch_time_s == 0.0 and r.step_time_s == pytest.approx(r.end_s - r.start_s) for r in records)
    _, prefill = prefill_and_the_step_before(records)
    assert prefill.step_time_s == pytest.approx(host_launch_s_of(64) + DEVICE_PER_STEP_S + DEVICE_PER_TOKEN_S * 65
                                                + COLLECT_S)


def host_launch_s_of(num_prefill_tokens: int) -> float:
    return HOST_PER_STEP_S + HOST_PER_PREFILL_TOKEN_S * num_prefill_tokens
