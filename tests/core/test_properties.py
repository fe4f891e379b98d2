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

The same workloads run again with speculative decoding (ngram, or a draft model's lookahead slots):
the fake runner proposes random drafts and accepts a random prefix of them, so acceptance counts,
rollbacks and slot reuse are random while the tokens must still equal sequential decoding. Checked
also: a verifying request is scheduled 1 + len(drafts) tokens, its drafts never take it past its length
limit, a draft model's lookahead slots are reserved, and the per-step spec statistics add up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.config import (Batching, CacheConfig, SchedulerConfig, SchedulingPolicy, SpeculativeConfig,
                             SpeculativeMethod)
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.fake_runner import FakeModelRunner, FakeSpeculation, default_token_fn
from conveyor.core.outputs import EngineCoreOutput, SchedulerOutput
from conveyor.core.policies import make_scheduler
from conveyor.core.scheduler import Scheduler
from conveyor.core.stats import SchedulerStats
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
    num_draft_tokens: int = 0
    """Speculative decoding: drafts verified by requests still running when their step came back."""


def _check_step(run: Run, output: SchedulerOutput) -> None:
    _check_spec_step(run, output)
    config = run.scheduler.scheduler_config
    assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(output.num_scheduled_tokens) <= config.max_num_seqs
    for new in output.scheduled_new_reqs:
        num_known = len(new.prompt_token_ids) + len(new.output_token_ids)
        assert new.num_computed_tokens < num_known, "a prefix hit covered the last known token"
        assert new.num_computed_tokens % run.scheduler.block_size == 0


def _check_spec_step(run: Run, output: SchedulerOutput) -> None:
    """Drafts are part of a decode, within the length limit; a draft model's lookahead is reserved."""
    scheduler = run.scheduler
    for request_id, drafts in output.scheduled_spec_decode_tokens.items():
        request = scheduler.requests[request_id]
        assert 0 < len(drafts) <= scheduler.num_spec_tokens
        assert output.num_scheduled_tokens[request_id] == 1 + len(drafts)
        limit = scheduler.stop_specs[request_id].max_num_output_tokens
        assert request.num_output_tokens + len(drafts) + 1 <= limit, "drafts past the length limit"
    if scheduler.num_lookahead_tokens == 0:
        return
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        last_slot = request.num_prompt_tokens + scheduler.stop_specs[request_id].max_num_output_tokens - 1
        wanted = min(request.num_computed_tokens + scheduler.num_lookahead_tokens, last_slot)
        assert scheduler.kv_cache_manager.num_slots[request_id] >= wanted, "lookahead slots not reserved"


def _check_spec_stats(run: Run, output: SchedulerOutput, stats: SchedulerStats) -> None:
    spec = stats.spec_decoding
    if not output.scheduled_spec_decode_tokens:
        assert spec is None
        return
    assert spec is not None
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    assert spec.num_drafts <= len(output.scheduled_spec_decode_tokens)
    run.num_draft_tokens += spec.num_draft_tokens


def _step(run: Run) -> None:
    output = run.scheduler.schedule()
    run.scheduler.check_invariants()
    _check_step(run, output)
    outputs, stats = run.scheduler.update_from_output(output, run.runner.execute(output))
    run.scheduler.check_invariants()
    assert stats.num_scheduled_tokens == output.total_num_scheduled_tokens
    _check_spec_stats(run, output, stats)
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
        assert request.max_tokens is None or request.num_output_tokens <= request.max_tokens
        if run.finished[request_id].finish_reason is FinishReason.LENGTH:
            assert request.max_tokens is None or request.num_output_tokens == request.max_tokens or \
                request.num_tokens == run.scheduler.scheduler_config.max_model_len or \
                request.num_tokens == run.scheduler.pool_size.num_blocks * run.scheduler.block_size + 1


def _drive(run: Run, workload: list[Arrival]) -> None:
    """Arrivals and aborts at their steps, one scheduler step at a time, until everything finished."""
    scheduler = run.scheduler
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


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), workload=arrivals)
def test_random_workloads_keep_every_invariant_and_finish(
        config: tuple[SchedulerConfig, CacheConfig, int], workload: list[Arrival]) -> None:
    scheduler_config, cache_config, num_blocks = config
    scheduler = make_scheduler(scheduler_config, cache_config, num_blocks, clock=lambda: 0.0)
    _drive(Run(scheduler, FakeModelRunner(cache_config.block_size, check_kv=True), {}, {}, {}), workload)


speculative_configs = st.builds(
    lambda method, k: SpeculativeConfig(method=method, num_speculative_tokens=k,
                                        model="draft.gguf" if method is SpeculativeMethod.DRAFT_MODEL else None),
    method=st.sampled_from(list(SpeculativeMethod)), k=st.integers(1, 5))


decoding_arrivals = arrivals.filter(lambda workload: any(a.max_tokens is None or a.max_tokens > 2 for a in workload))
"""Workloads with at least one request long enough to verify drafts."""


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(config=configs(), workload=decoding_arrivals, speculative_config=speculative_configs,
       seed=st.integers(0, 2**16))
def test_random_workloads_with_random_acceptance_keep_every_invariant_and_finish(
        config: tuple[SchedulerConfig, CacheConfig, int], workload: list[Arrival],
        speculative_config: SpeculativeConfig, seed: int) -> None:
    scheduler_config, cache_config, num_blocks = config
    scheduler = make_scheduler(scheduler_config, cache_config, num_blocks, clock=lambda: 0.0,
                               speculative_config=speculative_config)
    speculation = FakeSpeculation(num_speculative_tokens=speculative_config.num_speculative_tokens,
                                  max_model_len=scheduler_config.max_model_len,
                                  num_lookahead_tokens=speculative_config.num_lookahead_tokens, seed=seed)
    runner = FakeModelRunner(cache_config.block_size, check_kv=True, speculation=speculation)
    run = Run(scheduler, runner, {}, {}, {})
    _drive(run, workload)
    event(f"draft tokens verified: {'some' if run.num_draft_tokens else 'none'}")
