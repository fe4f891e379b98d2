"""vLLM's `reset_prefix_cache`: refused while a request holds KV blocks; with `reset_running_requests`
the running requests are preempted first (between steps, sync or with a step in flight) and then finish
with exactly the tokens they would have produced without the reset."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_async_scheduler import _pipelined_step
from test_properties import MAX_STEPS, Arrival, Run, _arrive, _check_final, _collect, _step, arrivals, configs

from conveyor.config import Batching, CacheConfig, SchedulerConfig
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.core.policies import make_scheduler as make_policy
from conveyor.core.scheduler import Scheduler
from conveyor.request import FinishReason
from core_builders import Driver, make_request, make_scheduler


def test_refused_while_blocks_are_held_then_forgets_every_cached_block() -> None:
    scheduler = make_scheduler(block_size=4)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=10))
    driver.step()
    pool = scheduler.kv_cache_manager.block_pool
    num_cached = len(pool.cached_blocks)
    assert num_cached > 0 and not scheduler.reset_prefix_cache()  # "a" holds its blocks: nothing changes
    assert len(pool.cached_blocks) == num_cached
    driver.run_until_done()
    scheduler.add_request(make_request("b", num_prompt_tokens=10))
    assert driver.run_until_done()["b"].num_cached_tokens == 8  # the same prompt hits, as before
    assert scheduler.reset_prefix_cache() and not pool.cached_blocks
    scheduler.add_request(make_request("c", num_prompt_tokens=10))
    assert driver.run_until_done()["c"].num_cached_tokens == 0
    scheduler.check_invariants()


def _nothing_to_launch(output: SchedulerOutput) -> bool:
    return output.is_empty and not output.finished_req_ids and not output.preempted_req_ids


def _run(scheduler: Scheduler, reset_at: int | None, pipelined: bool) -> dict[str, list[int]]:
    """Three requests to the end, one step in flight if `pipelined` (as AsyncEngineCore); a
    reset_prefix_cache(reset_running_requests=True) between steps `reset_at` and `reset_at + 1`."""
    runner = FakeModelRunner(scheduler.block_size, check_kv=True)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", num_prompt_tokens=6 + 5 * index, max_tokens=7))
    tokens: dict[str, list[int]] = {f"r{index}": [] for index in range(3)}
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    for step in range(200):
        if step == reset_at:
            assert scheduler.reset_prefix_cache(reset_running_requests=True)
            assert not scheduler.kv_cache_manager.block_pool.cached_blocks and not scheduler.running
            scheduler.check_invariants()
        if not scheduler.has_unfinished_requests() and not in_flight:
            return tokens
        output = scheduler.schedule()
        scheduler.check_invariants()
        if not pipelined or not in_flight and _nothing_to_launch(output):
            in_flight.append((output, runner.execute(output)))
        elif not _nothing_to_launch(output):
            in_flight.append((output, runner.execute(output)))  # launched before the previous is applied
            if len(in_flight) == 1:
                continue
        outputs, _ = scheduler.update_from_output(*in_flight.pop(0))
        scheduler.check_invariants()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    raise AssertionError("requests still unfinished after 200 steps")


@settings(max_examples=40, deadline=None)
@given(reset_at=st.integers(0, 12), pipelined=st.booleans())
def test_reset_running_requests_preempts_and_changes_no_output(reset_at: int, pipelined: bool) -> None:
    def scheduler() -> Scheduler:
        config = {"batching": Batching.CONTINUOUS, "async_scheduling": pipelined} if pipelined else {}
        return make_scheduler(block_size=4, max_num_batched_tokens=8, **config)
    baseline = _run(scheduler(), None, pipelined)
    reset = scheduler()
    assert _run(reset, reset_at, pipelined) == baseline
    assert reset.kv_cache_manager.usage == 0.0


def _reset(run: Run, force: bool) -> None:
    """A reset between steps: it happens exactly when no block is held, or always when forced."""
    scheduler = run.scheduler
    idle = scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.reset_prefix_cache(reset_running_requests=force) == (idle or force)
    if idle or force:
        assert not scheduler.kv_cache_manager.block_pool.cached_blocks and not scheduler.running
    scheduler.check_invariants()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), workload=arrivals, resets=st.dictionaries(st.integers(0, 40), st.booleans(), max_size=4),
       pipelined=st.booleans())
def test_random_workloads_with_resets_keep_every_invariant_and_finish(
        config: tuple[SchedulerConfig, CacheConfig, int], workload: list[Arrival], resets: dict[int, bool],
        pipelined: bool) -> None:
    """test_properties' random workloads (every policy, chunking, salts, aborts), sync or one step in
    flight, with resets, forced or not, between random steps: every request still finishes with exactly
    the runner's tokens for its positions, and every block returns to the pool."""
    scheduler_config, cache_config, num_blocks = config
    if pipelined:
        scheduler_config = dataclasses.replace(scheduler_config, batching=Batching.CONTINUOUS, async_scheduling=True)
    scheduler = make_policy(scheduler_config, cache_config, num_blocks, clock=lambda: 0.0)
    run = Run(scheduler, FakeModelRunner(cache_config.block_size, check_kv=True), {}, {}, {})
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    for step in range(MAX_STEPS):
        for index, arrival in enumerate(workload):
            if arrival.step == step:
                _arrive(run, index, arrival)
        _collect(run, scheduler.finish_requests([f"r{i}" for i, a in enumerate(workload) if a.abort_step == step],
                                                FinishReason.ABORT))
        if step in resets:
            _reset(run, resets[step])
        if step > 40 and not scheduler.has_unfinished_requests() and not in_flight:
            break
        if pipelined:
            _pipelined_step(run, in_flight)
        else:
            _step(run)
    _check_final(run)
