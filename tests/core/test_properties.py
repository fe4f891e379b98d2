"""Property tests: random workloads on tiny KV pools and budgets, invariants checked after every step.

Each example draws a configuration (policy, batching, chunking, prefix caching, pool, budget) and a
workload (arrival step, prompt built from a few shared segments, length, priority, salt, abort step),
then drives schedule -> fake runner -> update until everything has finished. Checked after every step:
pool and request-state invariants (free + used = total, ref >= 0, nothing free and referenced, each
request in exactly one place, running <= max_num_seqs), scheduled tokens <= budget, prefix hits never
covering the last known token, and (the fake runner simulating KV contents) every context position a
request reads holds its own tokens' KV; at the end: every accepted request finished exactly once, its streamed
tokens are exactly the tokens the runner produced for its positions (nothing lost or repeated across
chunking, prefix hits and preemption), and all blocks are free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import Batching, CacheConfig, SchedulerConfig, SchedulingPolicy
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.fake_runner import FakeModelRunner, default_token_fn
from conveyor.core.outputs import EngineCoreOutput, SchedulerOutput
from conveyor.core.policies import make_scheduler
from conveyor.core.scheduler import Scheduler
from conveyor.request import FinishReason, Request
from conveyor.sampling_params import SamplingParams

MAX_STEPS = 3000


@dataclass(frozen=True)
class Arrival:
    step: int
    segments: tuple[int, ...]
    num_own: int
    max_tokens: int | None
    priority: int
    salt: str | None
    abort_step: int | None


@st.composite
def configs(draw: st.DrawFn) -> tuple[SchedulerConfig, CacheConfig, int]:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    max_num_seqs = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    low = max(max_num_seqs, 1 if chunked else max_model_len)
    budget = draw(st.integers(low, low + 40))
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
        enable_chunked_prefill=chunked, long_prefill_token_threshold=draw(st.one_of(st.none(), st.integers(1, 12))),
        policy=draw(st.sampled_from(list(SchedulingPolicy))), batching=draw(st.sampled_from(list(Batching))),
        max_num_queued_reqs=draw(st.one_of(st.none(), st.integers(1, 8))))
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=draw(st.booleans()))
    num_blocks = draw(st.integers(1, 24))
    return scheduler_config, cache_config, num_blocks


arrivals = st.lists(st.builds(
    Arrival, step=st.integers(0, 30), segments=st.lists(st.integers(0, 2), max_size=5).map(tuple),
    num_own=st.one_of(st.just(0), st.integers(0, 12)), max_tokens=st.one_of(st.none(), st.integers(1, 16)),
    priority=st.integers(-2, 2), salt=st.sampled_from([None, None, "t1"]),
    abort_step=st.one_of(st.none(), st.none(), st.integers(0, 40))), max_size=14)


def _prompt(index: int, arrival: Arrival) -> list[int]:
    """Segments of 4 tokens from a 3-letter alphabet (shared prefixes, and equal blocks behind different
    prefixes, which only the hash chain tells apart), then tokens of its own."""
    shared = [10_000 + 10 * segment + k for segment in arrival.segments for k in range(4)]
    own = [500 + index * 50 + k for k in range(arrival.num_own)]
    return (shared + own) or [7]


@dataclass
class Run:
    scheduler: Scheduler
    runner: FakeModelRunner
    streamed: dict[str, list[int]]
    finished: dict[str, EngineCoreOutput]
    accepted: dict[str, Request]


def _check_step(run: Run, output: SchedulerOutput) -> None:
    config = run.scheduler.scheduler_config
    assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(output.num_scheduled_tokens) <= config.max_num_seqs
    for new in output.scheduled_new_reqs:
        num_known = len(new.prompt_token_ids) + len(new.output_token_ids)
        assert new.num_computed_tokens < num_known, "a prefix hit covered the last known token"
        assert new.num_computed_tokens % run.scheduler.block_size == 0


def _step(run: Run) -> None:
    output = run.scheduler.schedule()
    run.scheduler.check_invariants()
    _check_step(run, output)
    outputs, stats = run.scheduler.update_from_output(output, run.runner.execute(output))
    run.scheduler.check_invariants()
    assert stats.num_scheduled_tokens == output.total_num_scheduled_tokens
    _collect(run, outputs)


def _collect(run: Run, outputs: Iterable[EngineCoreOutput]) -> None:
    for out in outputs:
        assert out.request_id not in run.finished, f"{out.request_id} reported after finishing"
        run.streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            run.finished[out.request_id] = out


def _arrive(run: Run, index: int, arrival: Arrival) -> None:
    request = Request(f"r{index}", _prompt(index, arrival),
                      SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True), arrival_s=float(arrival.step),
                      priority=arrival.priority, cache_salt=arrival.salt)
    try:
        run.scheduler.add_request(request)
    except (AdmissionError, QueueFullError):
        return
    run.accepted[request.request_id] = request


def _check_final(run: Run) -> None:
    assert set(run.finished) == set(run.accepted), "an accepted request never finished"
    assert run.scheduler.kv_cache_usage == 0.0
    for request_id, request in run.accepted.items():
        streamed = run.streamed.get(request_id, [])
        assert streamed == request.output_token_ids
        num_prompt = request.num_prompt_tokens
        expected = [default_token_fn(request_id, num_prompt + i) for i in range(len(streamed))]
        assert streamed == expected, "tokens lost or repeated across chunking/caching/preemption"
        if run.finished[request_id].finish_reason is FinishReason.LENGTH:
            assert request.max_tokens is None or request.num_output_tokens == request.max_tokens or \
                request.num_tokens == run.scheduler.scheduler_config.max_model_len or \
                request.num_tokens == run.scheduler.pool_size.num_blocks * run.scheduler.block_size + 1


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), workload=arrivals)
def test_random_workloads_keep_every_invariant_and_finish(
        config: tuple[SchedulerConfig, CacheConfig, int], workload: list[Arrival]) -> None:
    scheduler_config, cache_config, num_blocks = config
    scheduler = make_scheduler(scheduler_config, cache_config, num_blocks, clock=lambda: 0.0)
    run = Run(scheduler, FakeModelRunner(cache_config.block_size, check_kv=True), {}, {}, {})
    by_step: dict[int, list[int]] = {}
    for index, arrival in enumerate(workload):
        by_step.setdefault(arrival.step, []).append(index)
    for step in range(MAX_STEPS):
        for index in by_step.get(step, []):
            _arrive(run, index, workload[index])
        aborts = [f"r{i}" for i, a in enumerate(workload) if a.abort_step == step]
        _collect(run, scheduler.finish_requests(aborts, FinishReason.ABORT))
        if step > 30 and not scheduler.has_unfinished_requests():
            break
        _step(run)
    _check_final(run)
