"""Continuous-batching rules: budget, max_num_seqs, chunking, prefix hits, preemption, the output contract."""

from __future__ import annotations

from conveyor.core.scheduler import Scheduler
from conveyor.request import FinishReason
from core_builders import Driver, make_request, make_scheduler


def test_running_decodes_first_then_waiting_within_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=10))
    first = driver.step().scheduler_output
    assert first.num_scheduled_tokens == {"a": 10}
    scheduler.add_request(make_request("b", num_prompt_tokens=12))
    second = driver.step().scheduler_output
    assert list(second.num_scheduled_tokens.items()) == [("a", 1), ("b", 12)]
    assert second.total_num_scheduled_tokens == 13
    assert second.scheduled_cached_reqs.req_ids == ["a"]
    assert [n.request_id for n in second.scheduled_new_reqs] == ["b"]


def test_chunked_prefill_splits_a_prompt_over_steps() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=20))
    counts = [driver.step().scheduler_output.num_scheduled_tokens["a"] for _ in range(4)]
    assert counts == [8, 8, 4, 1]
    assert scheduler.requests["a"].num_output_tokens == 2  # only chunks that reach the end sample


def test_without_chunking_a_prompt_that_does_not_fit_waits_and_blocks_the_queue() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False,
                               enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=20, max_tokens=2))
    scheduler.add_request(make_request("b", num_prompt_tokens=20, max_tokens=2))
    scheduler.add_request(make_request("c", num_prompt_tokens=2, max_tokens=2))
    assert driver.step().scheduler_output.num_scheduled_tokens == {"a": 20}  # b needs 20 of 12; c is behind b
    assert driver.step().scheduler_output.num_scheduled_tokens == {"a": 1, "b": 20, "c": 2}


def test_fcfs_head_of_line_blocks_smaller_requests_without_chunking() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=24, max_model_len=24, enable_chunked_prefill=False,
                               enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=3))
    scheduler.add_request(make_request("b", num_prompt_tokens=20, max_tokens=3))
    scheduler.add_request(make_request("c", num_prompt_tokens=2, max_tokens=3))
    assert driver.step().scheduler_output.num_scheduled_tokens == {"a": 10}  # c is behind b


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    driver = Driver(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=4, max_tokens=2))
    assert set(driver.step().scheduler_output.num_scheduled_tokens) == {"r0", "r1"}
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1


def test_long_prefill_token_threshold_caps_each_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=15))
    scheduler.add_request(make_request("b", num_prompt_tokens=4))
    assert driver.step().scheduler_output.num_scheduled_tokens == {"a": 6, "b": 4}
    assert driver.step().scheduler_output.num_scheduled_tokens == {"a": 6, "b": 1}
    assert driver.step().scheduler_output.num_scheduled_tokens == {"a": 3, "b": 1}


def test_prefix_hit_skips_cached_blocks_and_reports_them() -> None:
    scheduler = make_scheduler(block_size=4)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=10))
    driver.step()
    scheduler.add_request(make_request("b", num_prompt_tokens=10))
    result = driver.step()
    new = result.scheduler_output.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and result.scheduler_output.num_scheduled_tokens["b"] == 2
    assert new.block_ids[:2] == scheduler.kv_cache_manager.get_block_ids("a")[:2]
    assert (result.stats.prefix_cache_queries, result.stats.prefix_cache_hits) == (10, 8)
    assert driver.run_until_done()["b"].num_cached_tokens == 8


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = make_scheduler(block_size=4)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=8))
    driver.run_until_done()
    scheduler.add_request(make_request("b", num_prompt_tokens=8))
    result = driver.step()
    assert result.scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 4
    assert result.scheduler_output.num_scheduled_tokens == {"b": 4}


def test_cache_salt_prevents_sharing() -> None:
    scheduler = make_scheduler(block_size=4)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, cache_salt="tenant-1"))
    driver.step()
    scheduler.add_request(make_request("b", num_prompt_tokens=10, cache_salt="tenant-2"))
    assert driver.step().scheduler_output.num_scheduled_tokens["b"] == 10


def test_prefix_caching_off_never_hits() -> None:
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=10))
    driver.step()
    scheduler.add_request(make_request("b", num_prompt_tokens=10))
    result = driver.step()
    assert result.scheduler_output.num_scheduled_tokens["b"] == 10
    assert result.stats.prefix_cache_queries == 0


def _fill_pool_then_grow(policy: str, priorities: tuple[int, int, int]) -> tuple[Driver, Scheduler]:
    """Three requests of 8 prompt tokens in a 7-block pool (block 4): the third decode block triggers
    preemption."""
    scheduler = make_scheduler(num_blocks=7, block_size=4, policy=policy, enable_prefix_caching=False)
    driver = Driver(scheduler)
    for i, priority in enumerate(priorities):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=8, max_tokens=8, priority=priority,
                                           arrival_s=float(i)))
    return driver, scheduler


def test_fcfs_preempts_the_most_recently_admitted() -> None:
    driver, scheduler = _fill_pool_then_grow("fcfs", (0, 0, 0))
    driver.step()  # 3 prompts x 2 blocks = 6 of 7 blocks
    result = driver.step()  # r0 takes block 7; r1 needs one more: r2 is preempted
    assert result.scheduler_output.preempted_req_ids == {"r2"}
    assert result.stats.num_preemptions == 1
    victim = scheduler.requests["r2"]
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert victim.num_output_tokens == 1  # outputs are kept
    assert list(scheduler.waiting)[0] is victim


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled() -> None:
    driver, scheduler = _fill_pool_then_grow("priority", (0, 5, 1))
    driver.step()
    result = driver.step()
    assert result.scheduler_output.preempted_req_ids == {"r1"}
    assert "r1" not in result.scheduler_output.num_scheduled_tokens
    assert set(result.scheduler_output.num_scheduled_tokens) == {"r0", "r2"}


def test_no_admissions_in_a_step_that_preempted() -> None:
    driver, scheduler = _fill_pool_then_grow("fcfs", (0, 0, 0))
    driver.step()
    scheduler.add_request(make_request("tiny", num_prompt_tokens=1, max_tokens=1))
    result = driver.step()
    assert result.scheduler_output.preempted_req_ids
    assert not result.scheduler_output.scheduled_new_reqs


def test_resumed_request_is_resent_whole_and_hits_its_surviving_cached_blocks() -> None:
    scheduler = make_scheduler(num_blocks=7, block_size=4)
    driver = Driver(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", prompt=[10 * i + k for k in range(8)], max_tokens=8))
    driver.step()
    first_block = scheduler.kv_cache_manager.get_block_ids("r2")[0]
    assert driver.step().scheduler_output.preempted_req_ids == {"r2"}  # r1 reuses r2's tail block
    scheduler.finish_requests(["r0"], FinishReason.ABORT)
    result = driver.step()
    resumed = result.scheduler_output.scheduled_new_reqs[0]
    assert resumed.request_id == "r2"
    assert resumed.output_token_ids == scheduler.requests["r2"].output_token_ids[:1]
    assert resumed.num_computed_tokens == 4 and resumed.block_ids[0] == first_block
    assert result.scheduler_output.num_scheduled_tokens["r2"] == 5  # the rest of the prompt + its output
    assert driver.run_until_done()["r2"].num_preemptions >= 1


def test_a_request_that_preempts_itself_stops_the_step() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=4))
    scheduler.add_request(make_request("b", num_prompt_tokens=4, max_tokens=4))
    driver.step()
    result = driver.step()  # each needs a second block; b (latest) is preempted for a
    assert result.scheduler_output.preempted_req_ids == {"b"}
    assert driver.run_until_done().keys() == {"a", "b"}


def test_finished_ids_reach_the_next_output_once() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=1))
    assert "a" in driver.step().finished
    assert driver.step().scheduler_output.finished_req_ids == {"a"}
    assert driver.step().scheduler_output.finished_req_ids == set()


def test_stats_split_prompt_and_generation_tokens() -> None:
    scheduler = make_scheduler(block_size=4)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=6, max_tokens=3))
    first = driver.step().stats
    assert (first.num_prompt_tokens, first.num_generation_tokens, first.num_scheduled_tokens) == (6, 1, 6)
    second = driver.step().stats
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (0, 1)
    assert second.num_running_reqs == 1 and 0 < second.kv_cache_usage <= 1


def test_blocks_indexed_for_an_unscheduled_victim_are_not_served_as_hits() -> None:
    """Priority: V (low priority, admitted first) is scheduled, taking two blocks it would fill this
    step, then preempted within the same step for A. Those blocks never get their KV, so a later
    request with V's prompt must not hit them (the fake runner checks the KV it reads)."""
    scheduler = make_scheduler(num_blocks=9, block_size=4, policy="priority", long_prefill_token_threshold=8)
    driver = Driver(scheduler)
    v_prompt = [900 + k for k in range(24)]
    scheduler.add_request(make_request("V", prompt=v_prompt, max_tokens=4, priority=5))
    scheduler.add_request(make_request("B", prompt=[700 + k for k in range(4)], max_tokens=3, priority=0))
    driver.step()  # V [0, 8), B prefill
    scheduler.add_request(make_request("A", prompt=[800 + k for k in range(4)], max_tokens=8, priority=0,
                                       arrival_s=1.0))
    driver.step()  # V [8, 16), B decode, A prefill
    result = driver.step()  # V [16, 24) takes the last 2 blocks; A needs one: V is preempted
    assert result.scheduler_output.preempted_req_ids == {"V"} and "B" in result.finished
    scheduler.add_request(make_request("W", prompt=v_prompt[:20] + [1], max_tokens=2, priority=0,
                                       arrival_s=2.0))
    new = driver.step().scheduler_output.scheduled_new_reqs
    assert new[0].request_id == "W"  # ahead of V (priority), which resumes behind it
    assert new[0].num_computed_tokens == 16  # blocks 0-3 hold V's computed KV; block 4 never did
    driver.run_until_done()


def test_blocks_filled_during_decode_are_cached_for_the_next_turn() -> None:
    """A chat's next turn (prompt = previous prompt + answer + more) reuses the answer's blocks too."""
    scheduler = make_scheduler(block_size=4, max_model_len=64)
    driver = Driver(scheduler)
    first = make_request("turn1", num_prompt_tokens=6, max_tokens=9, ignore_eos=True)
    scheduler.add_request(first)
    driver.run_until_done()
    history = first.prompt_token_ids + first.output_token_ids  # 15 tokens: 3 full blocks computed
    scheduler.add_request(make_request("turn2", prompt=history + [7, 8, 9], max_tokens=2))
    new = driver.step().scheduler_output.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12
    driver.run_until_done()


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back_to_the_budget() -> None:
    """Priority: "b" (lowest) runs first in admission order; "a" needs a block, so "b" is preempted after
    it was scheduled this step. Its token returns to the budget, and "c"'s chunk gets it."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, policy="priority", max_num_batched_tokens=6, max_num_seqs=4,
                               max_model_len=32, enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("b", num_prompt_tokens=4, priority=5))
    driver.step()
    scheduler.add_request(make_request("a", num_prompt_tokens=4, priority=0, arrival_s=1.0))
    scheduler.add_request(make_request("c", num_prompt_tokens=12, priority=1, arrival_s=1.0))
    assert driver.step().scheduler_output.num_scheduled_tokens == {"b": 1, "a": 4, "c": 1}
    result = driver.step()
    assert result.scheduler_output.preempted_req_ids == {"b"}
    assert result.scheduler_output.num_scheduled_tokens == {"a": 1, "c": 5}
    assert result.scheduler_output.total_num_scheduled_tokens == 6
