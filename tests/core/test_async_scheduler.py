"""Async scheduling: the same random workloads as test_properties.py, pipelined one step deep.

The driver does what engine.AsyncEngineCore does: schedule and launch step N+1, then apply step N's
output. Everything test_properties checks must still hold (invariants after every step, every request
finished once, streamed tokens exactly the runner's tokens for their positions, all blocks free), plus:
a placeholder is never streamed, and a stop token sampled while the next step is in flight ends the
request exactly where the synchronous scheduler ends it.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_properties import MAX_STEPS, Arrival, Run, _arrive, _check_final, _check_step, _collect, arrivals, configs

from conveyor.config import Batching, CacheConfig, SchedulerConfig
from conveyor.core.async_scheduler import AsyncScheduler
from conveyor.core.fake_runner import FakeModelRunner, default_token_fn
from conveyor.core.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from conveyor.core.policies import make_scheduler
from conveyor.request import FinishReason, Request
from conveyor.sampling_params import SamplingParams


def _nothing_to_launch(output: SchedulerOutput) -> bool:
    return output.is_empty and not output.finished_req_ids and not output.preempted_req_ids


def _apply(run: Run, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
    outputs, stats = run.scheduler.update_from_output(output, runner_output)
    run.scheduler.check_invariants()
    assert stats.num_scheduled_tokens == output.total_num_scheduled_tokens
    assert all(PLACEHOLDER_TOKEN_ID not in out.new_token_ids for out in outputs)
    _collect(run, outputs)


def _pipelined_step(run: Run, in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]]) -> None:
    """One AsyncEngineCore.step: launch the next step, then apply the one in flight."""
    output = run.scheduler.schedule()
    run.scheduler.check_invariants()
    _check_step(run, output)
    if _nothing_to_launch(output):
        _apply(run, *(in_flight.pop() if in_flight else (output, ModelRunnerOutput({}))))
        return
    launched = (output, run.runner.launch(output))
    previous = in_flight.pop() if in_flight else None
    in_flight.append(launched)
    if previous is not None:
        _apply(run, *previous)


def _async(config: SchedulerConfig) -> SchedulerConfig:
    return dataclasses.replace(config, batching=Batching.CONTINUOUS, async_scheduling=True)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), workload=arrivals)
def test_pipelined_random_workloads_keep_every_invariant_and_finish(
        config: tuple[SchedulerConfig, CacheConfig, int], workload: list[Arrival]) -> None:
    scheduler_config, cache_config, num_blocks = config
    scheduler = make_scheduler(_async(scheduler_config), cache_config, num_blocks, clock=lambda: 0.0)
    assert isinstance(scheduler, AsyncScheduler)
    run = Run(scheduler, FakeModelRunner(cache_config.block_size, check_kv=True), {}, {}, {})
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    for step in range(MAX_STEPS):
        for index, arrival in enumerate(workload):
            if arrival.step == step:
                _arrive(run, index, arrival)
        aborts = [f"r{i}" for i, a in enumerate(workload) if a.abort_step == step]
        _collect(run, scheduler.finish_requests(aborts, FinishReason.ABORT))
        if step > 30 and not scheduler.has_unfinished_requests() and not in_flight:
            break
        _pipelined_step(run, in_flight)
    _check_final(run)


@given(stop_at=st.integers(0, 9), max_tokens=st.integers(1, 12), min_tokens=st.integers(0, 4))
@settings(max_examples=60, deadline=None)
def test_stop_tokens_end_requests_where_the_synchronous_scheduler_does(
        stop_at: int, max_tokens: int, min_tokens: int) -> None:
    stop_token = 7

    def token_fn(request_id: str, position: int) -> int:  # r0 samples the stop token from output stop_at on
        return stop_token if request_id == "r0" and position >= 5 + stop_at else default_token_fn(request_id, position)

    results = []
    for async_scheduling in (False, True):
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32,
                                 async_scheduling=async_scheduling)
        scheduler = make_scheduler(config, CacheConfig(block_size=4), 32, clock=lambda: 0.0)
        run = Run(scheduler, FakeModelRunner(4, token_fn=token_fn, check_kv=True), {}, {}, {})
        for index in range(3):
            request = Request(f"r{index}", list(range(10 + index, 15 + index)), SamplingParams(
                max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), stop_token_ids=[stop_token]), 0.0)
            scheduler.add_request(request)
            run.accepted[request.request_id] = request
        in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        while scheduler.has_unfinished_requests() or in_flight:
            if async_scheduling:
                _pipelined_step(run, in_flight)
            else:
                output = scheduler.schedule()
                _apply(run, output, run.runner.execute(output))
        assert scheduler.kv_cache_usage == 0.0
        results.append({rid: (run.streamed.get(rid, []), out.finish_reason) for rid, out in run.finished.items()})
    assert results[0] == results[1]


def _pipelined_driver(scheduler_config: SchedulerConfig, block_size: int = 4) -> tuple[Run, list[
        tuple[SchedulerOutput, ModelRunnerOutput]]]:
    scheduler = make_scheduler(scheduler_config, CacheConfig(block_size=block_size), 128 // block_size,
                               clock=lambda: 0.0)
    return Run(scheduler, FakeModelRunner(block_size, check_kv=True), {}, {}, {}), []


def test_in_flight_tokens_are_a_count_on_the_request_not_tokens_in_its_outputs() -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, async_scheduling=True)
    run, in_flight = _pipelined_driver(config)
    request = Request("r0", [10, 11, 12], SamplingParams(max_tokens=8, ignore_eos=True), 0.0)
    run.scheduler.add_request(request)
    run.accepted["r0"] = request
    _pipelined_step(run, in_flight)  # the prefill is launched; nothing is applied yet
    assert request.output_token_ids == [] and request.num_output_placeholders == 1
    assert request.num_computed_tokens == 3
    for _ in range(3):  # launch the next decode (it computes the in-flight position), apply the last
        _pipelined_step(run, in_flight)
        assert PLACEHOLDER_TOKEN_ID not in request.output_token_ids
        assert request.num_output_placeholders == 1  # one step in flight, one token of it
        assert request.num_computed_tokens == request.num_tokens
    while run.scheduler.has_unfinished_requests() or in_flight:
        _pipelined_step(run, in_flight)
    assert request.num_output_placeholders == 0 and len(request.output_token_ids) == 8
    _check_final(run)


@pytest.mark.parametrize("block_size", [1, 4])
def test_async_scheduling_caches_the_same_prefix_blocks_as_sync(block_size: int) -> None:
    """Step 2 computes position 3 (the prefill's sampled token, still in flight), which fills a block
    when block_size is 1: a block is indexed only under known tokens (it once was under the -1
    placeholder, breaking the hash chain), so a later prompt with the same tokens hits all 8 tokens'
    blocks, as without async scheduling."""
    results = []
    for async_scheduling in (False, True):
        config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32,
                                 async_scheduling=async_scheduling)
        run, in_flight = _pipelined_driver(config, block_size)
        first = Request("a", [10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True), 0.0)
        run.scheduler.add_request(first)
        run.accepted["a"] = first
        while run.scheduler.has_unfinished_requests() or in_flight:
            if async_scheduling:
                _pipelined_step(run, in_flight)
            else:
                output = run.scheduler.schedule()
                _apply(run, output, run.runner.execute(output))
        second = Request("b", first.prompt_token_ids + first.output_token_ids[:5] + [7],
                         SamplingParams(max_tokens=1, ignore_eos=True), 0.0)
        run.scheduler.add_request(second)
        output = run.scheduler.schedule()
        results.append(output.scheduled_new_reqs[0].num_computed_tokens)
    assert results == [8, 8]
