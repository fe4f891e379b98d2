"""core/trace_sim.py: a token-level trace through the real scheduler on a virtual clock."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from conveyor.config import Batching, CacheConfig, SchedulerConfig
from conveyor.core.simulate import StepTimeModel
from conveyor.core.step_time import CalibratedStepTime
from conveyor.core.trace_sim import (
    CANCELLED,
    COMPLETED,
    FAILED,
    SimRequest,
    TraceSimConfig,
    simulate_trace,
)

STEP = StepTimeModel(step_time_base_s=0.01, step_time_per_token_s=0.0)
CONFIG = TraceSimConfig(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512),
                        CacheConfig(block_size=16), num_blocks=256, step_time=STEP)


def request(name: str, due_s: float | None, tokens: list[int], output_len: int = 4, **kw: object) -> SimRequest:
    return SimRequest(name, "chat", tuple(tokens), output_len, due_s, **kw)  # type: ignore[arg-type]


def by_id(result: object) -> dict[str, object]:
    return {o.request.request_id: o for o in result.outcomes}  # type: ignore[attr-defined]


def test_one_request_streams_one_chunk_per_step() -> None:
    result = simulate_trace([request("a", 0.5, list(range(100, 132)), output_len=4)], CONFIG)
    (outcome,) = result.outcomes
    assert outcome.status == COMPLETED and outcome.output_tokens == 4 and outcome.prompt_tokens == 32
    assert outcome.chunk_times_s == pytest.approx((0.51, 0.52, 0.53, 0.54))  # prefill samples the first token
    assert outcome.end_s == pytest.approx(0.54) and outcome.scheduled_s == 0.5


def test_a_shared_prefix_hits_the_real_prefix_cache() -> None:
    shared = list(range(500, 564))  # four full blocks
    result = simulate_trace([request("a", 0.0, shared + [1, 2, 3]), request("b", 1.0, shared + [4, 5, 6])], CONFIG)
    outcomes = by_id(result)
    assert outcomes["a"].cached_tokens == 0 and outcomes["b"].cached_tokens == 64  # type: ignore[attr-defined]
    assert result.prefix_cache_hits == 64


def test_cancellations_end_streams_early() -> None:
    result = simulate_trace([request("t", 0.0, [7] * 20, output_len=50, cancel_after_tokens=3),
                             request("s", 0.0, [8] * 20, output_len=50, cancel_after_s=0.1)], CONFIG)
    outcomes = by_id(result)
    assert outcomes["t"].status == CANCELLED and outcomes["t"].output_tokens == 3  # type: ignore[attr-defined]
    assert outcomes["s"].status == CANCELLED and outcomes["s"].end_s == pytest.approx(0.1)  # type: ignore[attr-defined]


def test_a_later_turn_carries_the_history_and_waits_for_the_answer() -> None:
    turns = [request("s-0", 0.0, [9] * 40, output_len=5, session_id="s", turn=0),
             request("s-1", None, [3] * 10, output_len=2, session_id="s", turn=1, think_time_s=0.5)]
    outcomes = by_id(simulate_trace(turns, CONFIG))
    first, second = outcomes["s-0"], outcomes["s-1"]
    assert second.prompt_tokens == 40 + 5 + 10  # type: ignore[attr-defined]
    assert second.scheduled_s == pytest.approx(first.end_s + 0.5)  # type: ignore[attr-defined]
    assert second.cached_tokens == 32  # type: ignore[attr-defined]  # the first turn's two full blocks


def test_a_request_that_can_never_fit_fails_as_a_400() -> None:
    (outcome,) = simulate_trace([request("x", 0.0, [1] * 600)], CONFIG).outcomes
    assert outcome.status == FAILED and outcome.error == "http_4xx"


def test_a_small_pool_preempts_and_every_request_still_completes() -> None:
    tight = replace(CONFIG, num_blocks=12)
    requests = [request(f"r{i}", 0.01 * i, [100 + i] * 40, output_len=60) for i in range(6)]
    result = simulate_trace(requests, tight)
    assert result.num_preemptions > 0
    assert all(o.status == COMPLETED and o.output_tokens == 60 for o in result.outcomes)
    assert simulate_trace(requests, tight) == result  # deterministic


def test_a_stream_closed_during_the_last_step_is_cancelled_not_completed() -> None:
    slow = replace(CONFIG, step_time=StepTimeModel(step_time_base_s=0.5, step_time_per_token_s=0.0))
    (outcome,) = simulate_trace([request("c", 0.0, [5] * 20, output_len=2, cancel_after_s=0.7)], slow).outcomes
    assert outcome.status == CANCELLED and outcome.end_s == pytest.approx(0.7)
    assert outcome.output_tokens == 1  # the chunk at 0.5 s was read, the one at 1.0 s came after the close


def test_static_batching_replays_too() -> None:
    static = replace(CONFIG, scheduler=replace(CONFIG.scheduler, batching=Batching.STATIC))
    requests = [request(f"r{i}", 0.05 * i, [200 + i] * 30, output_len=5 + i) for i in range(10)]
    result = simulate_trace(requests, static)
    assert sorted(o.request.request_id for o in result.outcomes) == sorted(r.request_id for r in requests)
    assert all(o.status == COMPLETED for o in result.outcomes)


def test_a_concurrency_cap_sends_each_request_when_a_slot_frees() -> None:
    capped = replace(CONFIG, max_concurrency=1)
    requests = [request(f"r{i}", 0.0, [300 + i] * 20, output_len=3) for i in range(3)]
    outcomes = by_id(simulate_trace(requests, capped))
    r0, r1, r2 = (outcomes[f"r{i}"] for i in range(3))
    assert r0.sent_s == 0.0 and r1.sent_s == pytest.approx(r0.end_s)  # type: ignore[attr-defined]
    assert r2.sent_s == pytest.approx(r1.end_s) and r2.scheduled_s == 0.0  # type: ignore[attr-defined]
    assert r2.chunk_times_s[0] == pytest.approx(r2.sent_s + 0.01)  # type: ignore[attr-defined]
    open_loop = by_id(simulate_trace(requests, CONFIG))
    assert all(o.sent_s == 0.0 for o in open_loop.values())  # type: ignore[attr-defined]


def test_async_scheduling_admits_a_request_due_mid_step_one_step_later() -> None:
    # "a" keeps the engine busy with 10 ms steps from t=0; "b" is due at 0.025, during the step [0.02, 0.03].
    # Synchronous: the step from 0.03 is scheduled at 0.03 and takes b, first token at 0.04. Async: the step
    # from 0.03 was scheduled when [0.02, 0.03] started, so b waits for the one from 0.04: first token 0.05.
    trace = [request("a", 0.0, [5] * 20, output_len=20), request("b", 0.025, [6] * 20, output_len=2)]
    sync = by_id(simulate_trace(trace, CONFIG))
    async_config = replace(CONFIG, scheduler=replace(CONFIG.scheduler, async_scheduling=True))
    ahead = by_id(simulate_trace(trace, async_config))
    assert sync["b"].chunk_times_s[0] == pytest.approx(0.04)  # type: ignore[attr-defined]
    assert ahead["b"].chunk_times_s[0] == pytest.approx(0.05)  # type: ignore[attr-defined]
    # An idle engine has no step in flight: a lone request is scheduled at once either way.
    alone = [request("c", 0.5, [7] * 20, output_len=2)]
    assert by_id(simulate_trace(alone, async_config))["c"].chunk_times_s == pytest.approx((0.51, 0.52))  # type: ignore[attr-defined]


def test_async_scheduling_frees_a_finished_requests_slot_for_the_step_after_next() -> None:
    # Two seats (max_num_seqs 2): "a" decodes for long, "c" ends with the step [0.02, 0.03], "b" waits for
    # c's seat. Synchronous: c is applied at 0.03, then the step from 0.03 is scheduled and takes b (first
    # token 0.04). Async (engine_core.AsyncEngineCore): the step from 0.03 was scheduled at 0.02, while c's
    # last token was in flight and c still held its seat, so b waits for the step from 0.04 (first token
    # 0.05). A replay that applied each step before scheduling the next gave b its seat a step early; past
    # capacity every admission waits on a finish, and that step is one per admission (docs/decision.md).
    seats = replace(CONFIG.scheduler, max_num_seqs=2)
    trace = [request("a", 0.0, [5] * 20, output_len=20), request("c", 0.0, [6] * 20, output_len=3),
             request("b", 0.0, [7] * 20, output_len=2)]
    sync = by_id(simulate_trace(trace, replace(CONFIG, scheduler=seats)))
    ahead = by_id(simulate_trace(trace, replace(CONFIG, scheduler=replace(seats, async_scheduling=True))))
    assert sync["c"].end_s == pytest.approx(0.03) and ahead["c"].end_s == pytest.approx(0.03)  # type: ignore[attr-defined]
    assert sync["b"].chunk_times_s[0] == pytest.approx(0.04)  # type: ignore[attr-defined]
    assert ahead["b"].chunk_times_s[0] == pytest.approx(0.05)  # type: ignore[attr-defined]


def test_a_calibrated_replay_keeps_the_engines_cadence_between_steps() -> None:
    # 10 ms steps and 1 ms of the engine loop between them: each chunk 11 ms after the last, as measured.
    config = replace(CONFIG, step_time=CalibratedStepTime(0.01, 0.0, 0.0, 0.0, 0.0, between_steps_s=0.001))
    (outcome,) = simulate_trace([request("a", 0.5, list(range(100, 132)), output_len=4)], config).outcomes
    assert outcome.chunk_times_s == pytest.approx((0.511, 0.522, 0.533, 0.544))


def test_a_calibrated_spread_draws_like_steps_apart_around_the_fitted_price() -> None:
    # issue 36: every one-decode step priced alike puts ITL p50 at that price; the engine's vary (0.9-1.2x).
    spread = tuple(0.8 + 0.02 * i for i in range(21))  # 0.8 .. 1.2, mean 1
    model = CalibratedStepTime(0.01, 0.0, 0.0, 0.0, 0.0, between_steps_s=0.001, spread=spread)
    workload = [request("a", 0.0, list(range(100, 132)), output_len=200)]
    times = simulate_trace(workload, replace(CONFIG, step_time=model, seed=3)).outcomes[0].chunk_times_s
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert min(gaps) >= 0.001 + 0.008 - 1e-12 and max(gaps) <= 0.001 + 0.012 + 1e-12
    assert max(gaps) - min(gaps) > 0.003  # drawn apart, not one price
    assert sum(gaps) / len(gaps) == pytest.approx(0.011, rel=0.02)  # the fitted mean kept
    again = simulate_trace(workload, replace(CONFIG, step_time=model, seed=3)).outcomes[0].chunk_times_s
    other = simulate_trace(workload, replace(CONFIG, step_time=model, seed=4)).outcomes[0].chunk_times_s
    assert again == times and other != times  # one seed, one replay
    exact = replace(model, spread=())
    flat = simulate_trace(workload, replace(CONFIG, step_time=exact)).outcomes[0].chunk_times_s
    assert [b - a for a, b in itertools.pairwise(flat)] == pytest.approx([0.011] * 199)


def test_a_fitted_front_end_delays_the_way_in_and_every_chunk_out() -> None:
    # The same request as above (0.511, 0.522, ... without a front end). A way in of exactly 25 ms reaches
    # the scheduler at 0.525; a way out of 7 ms reaches the client 7 ms after each step's end.
    model = CalibratedStepTime(0.01, 0.0, 0.0, 0.0, 0.0, between_steps_s=0.001, front_end_in_s=(0.025, 0.025),
                               front_end_out_s=0.007)
    (outcome,) = simulate_trace([request("a", 0.5, list(range(100, 132)), output_len=4)],
                                replace(CONFIG, step_time=model)).outcomes
    assert outcome.chunk_times_s == pytest.approx((0.543, 0.554, 0.565, 0.576))
    assert outcome.sent_s == 0.5 and outcome.end_s == pytest.approx(0.576)  # sent when due: TTFT is 43 ms


def test_the_way_in_is_drawn_per_request_from_its_quantiles() -> None:
    # Way-in quantiles 0 .. 100 ms: ten requests each due 1 s apart (an idle engine) start 0-100 ms late,
    # not all alike; the step draws are untouched (no spread), and one seed gives one replay.
    model = CalibratedStepTime(0.01, 0.0, 0.0, 0.0, 0.0, front_end_in_s=(0.0, 0.05, 0.1))
    workload = [request(f"r{i}", float(i), list(range(100, 132)), output_len=1) for i in range(10)]
    firsts = [o.chunk_times_s[0] - o.sent_s for o in simulate_trace(workload, replace(CONFIG, step_time=model)).outcomes]
    assert all(0.01 - 1e-9 <= ttft <= 0.11 + 1e-9 for ttft in firsts)
    assert max(firsts) - min(firsts) > 0.02
    again = [o.chunk_times_s[0] - o.sent_s for o in simulate_trace(workload, replace(CONFIG, step_time=model)).outcomes]
    assert again == firsts
