"""The simulation counts preemptions as the engine does (issue 36 compares the two counts).

The server's `vllm:num_preemptions` is the sum of each engine step's `SchedulerStats.num_preemptions`
(server/metrics.py); the replay's `num_preemptions` the same sum over its steps. Both drive the one
scheduler, so on the same requests, all sent before the first step (no clock decides an arrival), the
engine core stepping a fake runner and the replay must preempt the same requests the same number of
times, and recompute the same prompt tokens. A replay that priced or counted a recompute differently (a
preemption counted per block freed, a resumed request's prefix hits counted as new prompt tokens) fails
here.
"""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import CacheConfig, EngineConfig, SchedulerConfig
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.policies import make_scheduler
from conveyor.core.simulate import StepTimeModel
from conveyor.core.trace_sim import COMPLETED, SimRequest, TraceSimConfig, simulate_trace
from conveyor.engine.engine_core import ModelLimits, make_engine_core
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

BLOCK = 4
SCHEDULER = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=96)
EOS = 0


def engine_counts(requests: list[SimRequest], num_blocks: int) -> tuple[int, int, dict[str, int]]:
    """(preemptions, prompt tokens computed, preemptions per finished request) of the engine core."""
    config = EngineConfig(scheduler=SCHEDULER, cache=CacheConfig(block_size=BLOCK))
    scheduler = make_scheduler(config.scheduler, config.cache, num_blocks, time.monotonic)
    core = make_engine_core(config, FakeModelRunner(BLOCK), scheduler,
                            ModelLimits(num_blocks, SCHEDULER.max_model_len, (EOS,), 1000))
    for r in requests:
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        core.add_request(Request(r.request_id, list(r.input_token_ids), params, arrival_s=0.0, eos_token_id=EOS))
    preemptions, prompt_tokens, per_request = 0, 0, {}
    while core.has_unfinished_requests():
        result = core.step()
        preemptions += result.stats.num_preemptions
        prompt_tokens += result.stats.num_prompt_tokens
        per_request.update({o.request_id: o.num_preemptions for o in result.outputs.finished_outputs})
    return preemptions, prompt_tokens, per_request


def replay(requests: list[SimRequest], num_blocks: int) -> tuple[int, int, dict[str, int]]:
    config = TraceSimConfig(SCHEDULER, CacheConfig(block_size=BLOCK), num_blocks,
                            StepTimeModel(step_time_base_s=0.01, step_time_per_token_s=1e-4))
    result = simulate_trace(requests, config)
    assert all(o.status == COMPLETED for o in result.outcomes)
    return (result.num_preemptions, result.prompt_tokens,
            {o.request.request_id: o.num_preemptions for o in result.outcomes})


lengths = st.tuples(st.integers(1, 40), st.integers(1, 48))
"""(prompt tokens, output tokens) of one request: at most 88 tokens, 22 blocks, within max_model_len."""


@settings(max_examples=60, deadline=None)
@given(st.lists(lengths, min_size=2, max_size=8), st.integers(22, 40), st.booleans())
def test_the_replay_preempts_as_the_engine_does(shapes: list[tuple[int, int]], num_blocks: int,
                                                shared_prefix: bool) -> None:
    # With a shared prefix, a resumed request finds its own and the others' blocks in the prefix cache.
    requests = [SimRequest(f"r{i}", "chat", tuple((7 if shared_prefix and j < 8 else 10 + i) for j in range(p)), o, 0.0)
                for i, (p, o) in enumerate(shapes)]
    assert replay(requests, num_blocks) == engine_counts(requests, num_blocks)


def test_a_tight_pool_really_preempts_in_both() -> None:
    requests = [SimRequest(f"r{i}", "chat", tuple([20 + i] * 30), 48, 0.0) for i in range(6)]
    counts = replay(requests, 24)
    assert counts[0] >= 3 and sum(counts[2].values()) == counts[0]
    assert engine_counts(requests, 24) == counts
