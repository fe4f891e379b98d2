"""The batched contract types: parallel lists stay aligned; per-request views match the batch."""

from __future__ import annotations

import pytest

from conveyor.core.outputs import (NO_NEW_BLOCKS, CachedRequestData, EngineCoreOutput, EngineCoreOutputs,
                                   ModelRunnerOutput, TokenLogprobs)
from conveyor.core.stats import SchedulerStats
from conveyor.request import FinishReason
from core_builders import Driver, make_request, make_scheduler


def test_cached_request_data_append_and_remove_keep_the_lists_parallel() -> None:
    cached = CachedRequestData()
    cached.append("a", NO_NEW_BLOCKS, 16)
    cached.append("b", [7], 32)
    cached.append("c", NO_NEW_BLOCKS, 48)
    cached.remove("b")
    cached.remove("unknown")
    assert (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens) == (["a", "c"], [(), ()], [16, 48])
    assert cached.num_reqs == 2


def test_engine_core_outputs_iterate_as_one_output_per_request() -> None:
    lp = TokenLogprobs(5, -0.1, 1, [5], [-0.1])
    done = EngineCoreOutput("c", [9], finish_reason=FinishReason.LENGTH)
    outputs = EngineCoreOutputs(["a", "b"], [[5], [6]], {"a": [lp]}, [done])
    assert len(outputs) == 3
    assert list(outputs) == [EngineCoreOutput("a", [5], new_logprobs=[lp]), EngineCoreOutput("b", [6]), done]


def test_decode_steps_report_tokens_batched_and_finishes_whole() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", max_tokens=3))
    scheduler.add_request(make_request("b", max_tokens=5))
    driver.step()  # prefill: first tokens (general path)
    second = driver.step()
    assert second.outputs.req_ids == ["a", "b"] and not second.outputs.finished_outputs
    third = driver.step()
    assert third.outputs.req_ids == ["b"]
    [finished] = third.outputs.finished_outputs
    assert finished.request_id == "a" and finished.finish_reason is FinishReason.LENGTH
    assert finished.timings is not None and len(finished.new_token_ids) == 1


def test_logprobs_travel_with_the_going_on_requests_only() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=4))
    scheduler.add_request(make_request("b", max_tokens=4))
    first = scheduler.schedule()
    scheduler.update_from_output(first, ModelRunnerOutput({"a": [5], "b": [5]}))
    lp = TokenLogprobs(6, -0.5, 2, [7, 6], [-0.2, -0.5])
    outputs, _ = scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput({"a": [6], "b": [6]},
                                                                                         {"a": [lp]}))
    assert outputs.req_ids == ["a", "b"] and outputs.new_logprobs == {"a": [lp]}


def test_wide_records_take_keywords_so_swapped_ints_cannot_pass() -> None:
    with pytest.raises(TypeError):
        SchedulerStats(1, 2, 0.5)  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineCoreOutput("a", [5], [], FinishReason.LENGTH)  # type: ignore[misc]
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.5)
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 2)
