"""Admission, stops, aborts, queue timeouts and the outputs that report them."""

from __future__ import annotations

import pytest

from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from conveyor.request import FinishReason, RequestStatus
from core_builders import EOS, Driver, ManualClock, make_request, make_scheduler


def _run_with_tokens(tokens: list[int], **request_kwargs: object) -> tuple[FinishReason | None, list[int]]:
    """Feed `tokens` one per step to one request; return its finish reason and output ids."""
    scheduler = make_scheduler(max_model_len=32)
    driver = Driver(scheduler)
    request = make_request("a", num_prompt_tokens=4, **request_kwargs)
    scheduler.add_request(request)
    for token in tokens:
        finished = driver.step({"a": [token]}).finished
        if finished:
            return finished["a"].finish_reason, request.output_token_ids
    return None, request.output_token_ids


def test_eos_stops_and_is_kept_in_the_output_ids() -> None:
    assert _run_with_tokens([5, EOS, 6]) == (FinishReason.STOP, [5, EOS])


def test_ignore_eos_runs_to_max_tokens() -> None:
    assert _run_with_tokens([EOS, EOS, EOS], max_tokens=3, ignore_eos=True) == (FinishReason.LENGTH, [EOS] * 3)


def test_stop_token_ids_stop_with_their_id_as_reason() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", stop_token_ids=(9,)))
    driver.step({"a": [5]})
    output = driver.step({"a": [9]}).finished["a"]
    assert (output.finish_reason, output.stop_reason, output.new_token_ids) == (FinishReason.STOP, 9, [9])


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    assert _run_with_tokens([EOS, 9, EOS], min_tokens=3, stop_token_ids=(9,)) == (FinishReason.STOP, [EOS, 9, EOS])
    assert _run_with_tokens([EOS, 9, 7], min_tokens=2, stop_token_ids=(9,)) == (FinishReason.STOP, [EOS, 9])


def test_max_tokens_ends_as_length() -> None:
    assert _run_with_tokens([5, 6, 7, 8], max_tokens=2) == (FinishReason.LENGTH, [5, 6])


def test_max_model_len_ends_as_length_when_max_tokens_is_unset() -> None:
    scheduler = make_scheduler(max_model_len=8, max_num_batched_tokens=8)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=5, max_tokens=None))
    finished = driver.run_until_done()
    assert finished["a"].finish_reason is FinishReason.LENGTH
    assert scheduler.num_unfinished_requests == 0
    assert finished["a"].num_prompt_tokens == 5 and len(finished["a"].timings.token_times_s) == 3


def test_finishing_output_carries_timings_and_counts() -> None:
    clock = ManualClock(10.0)
    scheduler = make_scheduler(clock=clock)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=2, arrival_s=9.0))
    clock.advance(1.0)
    driver.step()
    clock.advance(1.0)
    output = driver.step().finished["a"]
    timings = output.timings
    assert timings is not None
    assert (timings.arrival_s, timings.first_scheduled_s, timings.first_token_s) == (9.0, 11.0, 11.0)
    assert timings.token_times_s == [11.0, 12.0] and timings.last_token_s == timings.finished_s == 12.0
    assert (output.num_prompt_tokens, output.num_cached_tokens, output.num_preemptions) == (4, 0, 0)


def test_abort_from_waiting_and_running_frees_blocks() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("run", num_prompt_tokens=8))
    scheduler.add_request(make_request("wait", num_prompt_tokens=8))
    driver.step()
    assert scheduler.kv_cache_usage > 0
    outputs = scheduler.finish_requests(["run", "wait", "unknown"], FinishReason.ABORT)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("run", FinishReason.ABORT),
                                                                  ("wait", FinishReason.ABORT)]
    assert scheduler.kv_cache_usage == 0 and not scheduler.has_unfinished_requests()
    scheduler.check_invariants()
    assert scheduler.finish_requests(["run"], FinishReason.ABORT) == []
    assert driver.step().scheduler_output.finished_req_ids == {"run"}  # the worker never held "wait"


def test_stop_string_finish_from_the_detokenizer() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a"))
    driver.step()
    [output] = scheduler.finish_requests(["a"], FinishReason.STOP)
    assert output.finish_reason is FinishReason.STOP and output.timings is not None


def test_tokens_for_a_request_aborted_mid_step_are_dropped() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    scheduler_output = scheduler.schedule()
    scheduler.finish_requests(["a"], FinishReason.ABORT)
    outputs, stats = scheduler.update_from_output(scheduler_output, ModelRunnerOutput({"a": [5]}))
    assert len(outputs) == 0 and list(outputs) == [] and stats.num_generation_tokens == 0


def test_queue_timeout_fires_for_never_scheduled_requests_even_when_idle() -> None:
    clock = ManualClock()
    scheduler = make_scheduler(clock=clock, max_num_seqs=1, queue_timeout_s=5.0)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("first", max_tokens=50, ignore_eos=True))
    scheduler.add_request(make_request("late"))
    driver.step()
    clock.advance(5.5)
    result = driver.step()
    assert result.finished["late"].finish_reason is FinishReason.QUEUE_TIMEOUT
    assert result.stats.num_queue_timeouts == 1
    assert "late" not in result.scheduler_output.finished_req_ids
    assert scheduler.requests["first"].status is RequestStatus.RUNNING  # a running one never times out


def test_queue_timeout_is_emitted_by_an_empty_update() -> None:
    clock = ManualClock()
    scheduler = make_scheduler(clock=clock, queue_timeout_s=1.0, max_num_seqs=1)
    scheduler.add_request(make_request("a", max_tokens=50))
    scheduler.add_request(make_request("b"))
    scheduler.schedule()
    clock.advance(2.0)
    scheduler.schedule()
    empty = SchedulerOutput([], CachedRequestData(), {}, 0)
    outputs, stats = scheduler.update_from_output(empty, ModelRunnerOutput({}))
    assert [o.finish_reason for o in outputs] == [FinishReason.QUEUE_TIMEOUT]
    assert stats.num_queue_timeouts == 1


def test_queue_full_is_rejected() -> None:
    scheduler = make_scheduler(max_num_queued_reqs=2)
    scheduler.add_request(make_request("a"))
    scheduler.add_request(make_request("b"))
    with pytest.raises(QueueFullError, match="max_num_queued_reqs=2"):
        scheduler.add_request(make_request("c"))


@pytest.mark.parametrize(("prompt_len", "max_tokens", "field"), [
    (65, 1, "prompt"),  # longer than max_model_len (64)
    (64, None, "prompt"),  # no room for any output
    (60, 5, "max_tokens"),  # prompt + max_tokens > max_model_len
    (32, 1, "prompt"),  # the KV pool holds 8 blocks x 4 = 32 slots: prompt + 1 never fits
    (20, 20, "max_tokens"),  # fits max_model_len but not the pool
])
def test_requests_that_can_never_finish_are_rejected(prompt_len: int, max_tokens: int | None, field: str) -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(AdmissionError) as info:
        scheduler.add_request(make_request(num_prompt_tokens=prompt_len, max_tokens=max_tokens))
    assert info.value.field == field and isinstance(info.value, ValueError)
    assert scheduler.num_waiting == 0


def test_unset_max_tokens_is_capped_by_the_pool() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=3, max_tokens=None))
    output = driver.run_until_done()["a"]
    assert output.finish_reason is FinishReason.LENGTH
    assert output.num_prompt_tokens + len(output.timings.token_times_s) == 9  # 8 slots + the last sample


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(AdmissionError) as info:
        scheduler.add_request(make_request("a"))
    assert info.value.field == "request_id"


def test_stop_token_ids_apply_even_under_ignore_eos() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", ignore_eos=True, stop_token_ids=(EOS,), max_tokens=5))
    output = driver.step({"a": [EOS]}).finished["a"]
    assert (output.finish_reason, output.stop_reason) == (FinishReason.STOP, EOS)


def test_eos_that_is_also_a_stop_id_reports_no_stop_reason() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", stop_token_ids=(EOS, 9)))
    output = driver.step({"a": [EOS]}).finished["a"]
    assert (output.finish_reason, output.stop_reason) == (FinishReason.STOP, None)
