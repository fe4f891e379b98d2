"""The step log records each step's batch composition from the real scheduler's output."""

from __future__ import annotations

from core_builders import make_request, make_scheduler

from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.core.stats import SchedulerStats
from conveyor.core.step_log import StepLog, StepRecord, StepTiming, step_record
from conveyor.sampling_params import SamplingParams

STATS = SchedulerStats(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0)


def test_chunked_prefill_then_decode_on_the_real_scheduler() -> None:
    # budget 8: r0's 12-token prompt takes two steps (8 then 4), r1's 4 tokens join in the second
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=True)
    runner = FakeModelRunner(block_size=4)
    scheduler.add_request(make_request("r0", num_prompt_tokens=12, max_tokens=3))
    scheduler.add_request(make_request("r1", num_prompt_tokens=4, max_tokens=3))
    log = StepLog(capacity=16)
    for step in range(3):
        output = scheduler.schedule()
        _, stats = scheduler.update_from_output(output, runner.execute(output))
        log.record(output, stats, start_s=float(step), end_s=step + 0.5)
    first, second, third = log.drain()
    assert (first.num_prefill_tokens, first.num_decode_tokens, first.num_prefill_reqs) == (8, 0, 1)
    assert first.num_context_tokens == 8 and first.step_time_s == 0.5 and first.start_s == 0.0
    assert (second.num_prefill_tokens, second.num_prefill_reqs, second.num_decode_reqs) == (8, 2, 0)
    assert second.num_context_tokens == 12 + 4
    assert (third.num_prefill_tokens, third.num_decode_tokens, third.num_decode_reqs) == (0, 2, 2)
    assert third.num_context_tokens == 13 + 5  # each decode attends over its prompt and its first token
    assert len(log) == 0


def test_drafts_count_as_decode_tokens_and_preemptions_come_from_the_stats() -> None:
    cached = CachedRequestData(["a", "b"], [(), ()], [20, 30])
    output = SchedulerOutput([], cached, {"a": 4, "b": 1}, 5, scheduled_spec_decode_tokens={"a": [7, 8, 9]})
    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.1, num_preemptions=1)
    record = step_record(output, stats, 1.0, 1.25)
    assert record == StepRecord(num_prefill_tokens=0, num_decode_tokens=5, num_prefill_reqs=0, num_decode_reqs=2,
                                num_context_tokens=24 + 31, num_draft_tokens=3, num_preemptions=1,
                                step_time_s=0.25, start_s=1.0, end_s=1.25)


def test_prefix_cache_hits_are_context_but_not_computed_tokens() -> None:
    new = NewRequestData("n", list(range(16)), [], SamplingParams(), [0, 1, 2, 3], num_computed_tokens=12)
    output = SchedulerOutput([new], CachedRequestData(), {"n": 4}, 4)
    record = step_record(output, STATS, 0.0, 0.1)
    assert (record.num_prefill_tokens, record.num_prefill_reqs, record.num_context_tokens) == (4, 1, 16)


def test_the_ring_keeps_the_newest_and_skips_empty_steps() -> None:
    log = StepLog(capacity=2)
    empty = SchedulerOutput([], CachedRequestData(), {}, 0)
    log.record(empty, STATS, 0.0, 0.1)
    assert len(log) == 0
    for step in range(3):
        output = SchedulerOutput([], CachedRequestData(["a"], [()], [step]), {"a": 1}, 1)
        log.record(output, STATS, float(step), step + 0.1)
    assert [r.start_s for r in log.drain()] == [1.0, 2.0]


def test_json_round_trip_ignores_unknown_keys() -> None:
    record = StepRecord(num_prefill_tokens=3, num_decode_tokens=2, num_prefill_reqs=1, num_decode_reqs=2,
                        num_context_tokens=40, num_draft_tokens=0, num_preemptions=0, step_time_s=0.01, start_s=5.0)
    assert StepRecord.from_json({**record.to_json(), "future_field": 1}) == record


def test_an_async_step_is_timed_by_its_launch_plus_its_settle() -> None:
    """Launched from 1.0 for 0.25 s; the next step's launch ran until 1.5, then this one settled until 1.75:
    0.5 s, the next launch's 0.25 s not included. A synchronous step is one span."""
    output = SchedulerOutput([], CachedRequestData(["a"], [()], [4]), {"a": 1}, 1)
    record = step_record(output, STATS, timing=StepTiming(1.0, 1.75, launch_time_s=0.25, settle_start_s=1.5))
    assert (record.step_time_s, record.launch_time_s, record.start_s, record.end_s) == (0.5, 0.25, 1.0, 1.75)
    sync = step_record(output, STATS, 1.0, 1.75)
    assert (sync.step_time_s, sync.launch_time_s, sync.end_s) == (0.75, 0.0, 1.75)
    assert StepRecord.from_json(record.to_json()) == record
