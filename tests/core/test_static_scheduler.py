"""The fixed-batch baseline: a batch runs until its longest member finishes, then the next is admitted."""

from __future__ import annotations

from conveyor.core.policies import make_scheduler
from conveyor.core.scheduler import Scheduler
from conveyor.core.static_scheduler import StaticScheduler
from core_builders import Driver, make_request
from core_builders import make_scheduler as build


def test_factory_picks_the_policy() -> None:
    assert isinstance(build(batching="static"), StaticScheduler)
    assert isinstance(build(batching="continuous"), Scheduler)
    assert make_scheduler is not None


def test_static_batch_waits_for_its_longest_member() -> None:
    scheduler = build(batching="static", max_num_seqs=2, enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("short", num_prompt_tokens=4, max_tokens=1))
    scheduler.add_request(make_request("long", num_prompt_tokens=4, max_tokens=5))
    scheduler.add_request(make_request("next", num_prompt_tokens=4, max_tokens=1))
    finished_at: dict[str, int] = {}
    started_at: dict[str, int] = {}
    for step in range(12):
        result = driver.step()
        for new in result.scheduler_output.scheduled_new_reqs:
            started_at.setdefault(new.request_id, step)
        for request_id in result.finished:
            finished_at[request_id] = step
    assert finished_at["short"] == 0 and finished_at["long"] == 4
    assert started_at["next"] == 5  # not at step 1, when a seat became free


def test_continuous_refills_the_free_seat_at_once() -> None:
    scheduler = build(max_num_seqs=2, enable_prefix_caching=False)
    driver = Driver(scheduler)
    for request_id, max_tokens in (("short", 1), ("long", 5), ("next", 1)):
        scheduler.add_request(make_request(request_id, num_prompt_tokens=4, max_tokens=max_tokens))
    driver.step()
    assert [n.request_id for n in driver.step().scheduler_output.scheduled_new_reqs] == ["next"]


def test_static_reserves_blocks_for_the_whole_life_up_front() -> None:
    scheduler = build(batching="static", num_blocks=6, block_size=4, max_num_seqs=4, enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=9))  # 12 slots: 3 blocks
    scheduler.add_request(make_request("b", num_prompt_tokens=4, max_tokens=9))
    scheduler.add_request(make_request("c", num_prompt_tokens=4, max_tokens=1))  # 1 block: no room left
    first = driver.step()
    assert [n.request_id for n in first.scheduler_output.scheduled_new_reqs] == ["a", "b"]
    assert [len(n.block_ids) for n in first.scheduler_output.scheduled_new_reqs] == [3, 3]
    finished = driver.run_until_done()
    assert set(finished) == {"a", "b", "c"}
    assert all(step.stats.num_preemptions == 0 for step in driver.history)


def test_static_chunks_prefill_only_when_the_budget_forces_it() -> None:
    scheduler = build(batching="static", max_num_batched_tokens=16, max_model_len=16, enable_prefix_caching=False)
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=2))
    scheduler.add_request(make_request("b", num_prompt_tokens=10, max_tokens=2))
    first = driver.step().scheduler_output
    assert first.num_scheduled_tokens == {"a": 10, "b": 6}
    assert [n.request_id for n in first.scheduled_new_reqs] == ["a", "b"]
    assert driver.step().scheduler_output.num_scheduled_tokens == {"a": 1, "b": 4}
