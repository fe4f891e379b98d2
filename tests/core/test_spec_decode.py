"""Speculative decoding in the scheduler: drafts widen a decode's gap, rejected ones are taken back.

The fake runner verifies greedily against its own tokens (default_token_fn), so a test chooses the
acceptance by choosing how many of a request's drafts are right (`give_drafts`)."""

from __future__ import annotations

import pytest
from core_builders import Driver, make_request, make_scheduler

from conveyor.config import CacheConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from conveyor.core.fake_runner import FakeSpeculation, default_token_fn
from conveyor.core.outputs import ModelRunnerOutput
from conveyor.core.policies import make_scheduler as make_policy
from conveyor.core.scheduler import Scheduler
from conveyor.request import FinishReason, Request


def ngram(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method=SpeculativeMethod.NGRAM, num_speculative_tokens=k)


def draft_model(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, num_speculative_tokens=k, model="draft.gguf")


def spec_driver(k: int = 3, config: SpeculativeConfig | None = None, **scheduler_config: object) -> Driver:
    config = config or ngram(k)
    scheduler = make_scheduler(speculative_config=config, **scheduler_config)
    max_model_len = scheduler.scheduler_config.max_model_len
    return Driver(scheduler, FakeSpeculation(k, max_model_len, config.num_lookahead_tokens))


def prefilled(k: int = 3) -> tuple[Driver, Scheduler]:
    """A driver whose one request r0 (8 prompt tokens, max_tokens 10) has its first output."""
    driver = spec_driver(k=k)
    driver.scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=10))
    driver.step()
    return driver, driver.scheduler


def next_tokens(request: Request, num_tokens: int) -> list[int]:
    """The tokens the fake runner will produce at the request's next positions."""
    return [default_token_fn(request.request_id, request.num_tokens + i) for i in range(num_tokens)]


def give_drafts(scheduler: Scheduler, request_id: str, num_right: int, num_wrong: int = 0) -> list[int]:
    """Replace the request's drafts: `num_right` right ones, then `num_wrong` wrong ones."""
    request = scheduler.requests[request_id]
    right = next_tokens(request, num_right + num_wrong)
    drafts = right[:num_right] + [token + 1 for token in right[num_right:]]
    request.spec_token_ids = drafts
    return drafts


def test_a_decode_with_drafts_is_scheduled_one_plus_its_drafts_and_keeps_the_accepted_prefix() -> None:
    driver, scheduler = prefilled()
    request = scheduler.requests["r0"]
    drafts = give_drafts(scheduler, "r0", num_right=2, num_wrong=1)
    expected = next_tokens(request, 3)
    num_computed = request.num_computed_tokens
    result = driver.step()
    assert result.scheduler_output.num_scheduled_tokens == {"r0": 4}
    assert result.scheduler_output.scheduled_spec_decode_tokens == {"r0": drafts}
    assert [out.new_token_ids for out in result.outputs] == [expected]  # 2 accepted + the target's own
    assert request.num_computed_tokens == num_computed + 4 - 1 == request.num_tokens - 1
    spec = result.stats.spec_decoding
    assert spec is not None
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 2)
    assert spec.num_accepted_tokens_per_pos == [1, 1, 0]


def test_drafts_share_the_token_budget_and_are_trimmed_to_what_is_left() -> None:
    driver = spec_driver(k=3, max_num_batched_tokens=6, max_num_seqs=2)
    scheduler = driver.scheduler
    for request_id in ("r0", "r1"):
        scheduler.add_request(make_request(request_id, num_prompt_tokens=2, max_tokens=10))
    driver.step()
    give_drafts(scheduler, "r0", num_right=3)
    drafts = give_drafts(scheduler, "r1", num_right=3)
    result = driver.step()
    assert result.scheduler_output.num_scheduled_tokens == {"r0": 4, "r1": 2}
    assert result.scheduler_output.scheduled_spec_decode_tokens["r1"] == drafts[:1]
    assert result.scheduler_output.total_num_scheduled_tokens == 6


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_drafts_never_take_a_request_past_its_length_limit(limit: str) -> None:
    driver = spec_driver(k=4, max_model_len=11 if limit == "max_tokens" else 8 + 3)
    scheduler = driver.scheduler
    scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=3 if limit == "max_tokens" else None))
    driver.step()  # one output: two more allowed
    give_drafts(scheduler, "r0", num_right=4)
    result = driver.step()
    assert result.scheduler_output.num_scheduled_tokens == {"r0": 2}  # one draft + the target's token
    finished = result.finished["r0"]
    assert finished.finish_reason is FinishReason.LENGTH
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_a_stop_token_among_the_accepted_drafts_ends_the_request_there() -> None:
    driver = spec_driver(k=3)
    scheduler = driver.scheduler
    stop_id = default_token_fn("r0", 8 + 2)  # the second draft of the first decode
    scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=10, stop_token_ids=[stop_id]))
    driver.step()
    request = scheduler.requests["r0"]
    expected = next_tokens(request, 2)
    give_drafts(scheduler, "r0", num_right=3)
    result = driver.step()
    finished = result.finished["r0"]
    assert finished.finish_reason is FinishReason.STOP and finished.stop_reason == stop_id
    assert finished.new_token_ids == expected  # the third draft and the bonus token are dropped
    assert request.output_token_ids == [default_token_fn("r0", 8)] + expected
    assert result.stats.num_generation_tokens == 2
    assert result.stats.spec_decoding is not None and result.stats.spec_decoding.num_accepted_tokens == 3


def test_rejected_drafts_slots_are_reused_by_the_next_step_without_new_blocks() -> None:
    driver = spec_driver(k=3, block_size=4, num_blocks=16)
    scheduler = driver.scheduler
    manager = scheduler.kv_cache_manager
    scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=20))
    driver.step()  # 8 computed, 9 known
    give_drafts(scheduler, "r0", num_right=0, num_wrong=3)
    driver.step()  # positions 8..11 computed: a third block; all three drafts rejected
    request = scheduler.requests["r0"]
    assert request.num_computed_tokens == 9 and len(manager.req_to_blocks["r0"]) == 3
    num_free = manager.block_pool.num_free_blocks
    give_drafts(scheduler, "r0", num_right=2)
    result = driver.step()  # positions 9..11 again: the rejected drafts' slots
    assert result.scheduler_output.scheduled_cached_reqs.new_block_ids == [()]
    assert manager.block_pool.num_free_blocks == num_free
    driver.run_until_done()
    assert manager.block_pool.num_free_blocks == manager.num_blocks
    assert request.output_token_ids == [default_token_fn("r0", 8 + i) for i in range(20)]


def test_unverified_drafts_are_never_hashed_into_the_prefix_cache() -> None:
    driver = spec_driver(k=4, block_size=4, enable_prefix_caching=True)
    scheduler = driver.scheduler
    manager = scheduler.kv_cache_manager
    scheduler.add_request(make_request("r0", num_prompt_tokens=7, max_tokens=20))
    driver.step()  # 7 computed, 8 known: two full blocks of known tokens
    request = scheduler.requests["r0"]
    drafts = give_drafts(scheduler, "r0", num_right=0, num_wrong=4)
    prompt = request.all_token_ids + drafts
    driver.step()  # positions 7..11 computed: the third block holds only drafts, all rejected
    blocks = manager.req_to_blocks["r0"]
    assert len(blocks) == 3 and blocks[2].block_hash is None
    request.spec_token_ids = []
    scheduler.finish_requests(["r0"], FinishReason.ABORT)
    assert blocks[2].block_hash is None  # freeing indexes what was computed, and the drafts were taken back
    hit = manager.get_computed_blocks(make_request("r1", prompt=prompt + [5], max_tokens=1))
    assert hit.num_tokens == 8
    scheduler.check_invariants()


def test_a_preempted_request_drops_its_drafts_and_still_produces_the_sequential_tokens() -> None:
    driver = spec_driver(k=3, num_blocks=7, block_size=4, enable_prefix_caching=False)
    scheduler = driver.scheduler
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", num_prompt_tokens=8, max_tokens=8, arrival_s=float(index)))
    driver.step()  # 3 x 2 blocks of 7
    for request_id in ("r0", "r1", "r2"):
        give_drafts(scheduler, request_id, num_right=3)
    result = driver.step()  # r0 takes the last block, r1 needs one: r2 is preempted with its drafts
    assert result.scheduler_output.preempted_req_ids == {"r2"}
    assert "r2" not in result.scheduler_output.scheduled_spec_decode_tokens
    victim = next(request for request in scheduler.waiting if request.request_id == "r2")
    assert victim.spec_token_ids == [] and victim.num_computed_tokens == 0
    driver.run_until_done()
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_victim_scheduled_earlier_in_the_step_gives_its_drafts_back() -> None:
    driver = spec_driver(k=3, num_blocks=7, block_size=4, policy="priority", enable_prefix_caching=False)
    scheduler = driver.scheduler
    for index, priority in enumerate((0, 5, 1)):
        scheduler.add_request(make_request(f"r{index}", num_prompt_tokens=8, max_tokens=8, priority=priority,
                                           arrival_s=float(index)))
    driver.step()
    for request_id in ("r0", "r1", "r2"):
        give_drafts(scheduler, request_id, num_right=1)
    result = driver.step()
    assert result.scheduler_output.preempted_req_ids == {"r1"}
    assert set(result.scheduler_output.scheduled_spec_decode_tokens) == {"r0", "r2"}
    assert result.scheduler_output.total_num_scheduled_tokens == 4


def test_a_draft_model_gets_its_lookahead_slots_past_the_scheduled_tokens() -> None:
    driver = spec_driver(config=draft_model(3), k=3, block_size=4, num_blocks=32)
    scheduler = driver.scheduler
    manager = scheduler.kv_cache_manager
    scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=10))
    driver.step()
    assert manager.num_slots["r0"] >= 8 + 3  # the prompt, and slots for the draft's proposals
    request = scheduler.requests["r0"]
    give_drafts(scheduler, "r0", num_right=3)
    scheduler.schedule()  # 8 computed + 4 scheduled + 3 lookahead
    assert manager.num_slots["r0"] >= 8 + 4 + 3 and request.num_computed_tokens == 12


def test_lookahead_stops_at_the_length_limit_so_a_request_that_fills_the_pool_finishes() -> None:
    # prompt 8 + max_tokens 9: the last step needs 16 slots, the whole pool; lookahead past that
    # would make the request preempt itself forever.
    driver = spec_driver(config=draft_model(4), k=4, block_size=4, num_blocks=4, max_model_len=32)
    scheduler = driver.scheduler
    scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=9))
    finished = driver.run_until_done(max_steps=50)
    assert finished["r0"].finish_reason is FinishReason.LENGTH and finished["r0"].num_preemptions == 0


def test_a_request_aborted_between_schedule_and_update_ignores_its_verification() -> None:
    driver, scheduler = prefilled()
    give_drafts(scheduler, "r0", num_right=3)
    output = scheduler.schedule()
    runner_output = driver.runner.execute(output)
    scheduler.finish_requests(["r0"], FinishReason.ABORT)
    outputs, stats = scheduler.update_from_output(output, runner_output)
    assert len(outputs) == 0 and stats.spec_decoding is not None and stats.spec_decoding.num_drafts == 0
    scheduler.check_invariants()
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_verifying_request_that_sampled_nothing_recomputes_the_step() -> None:
    driver, scheduler = prefilled()
    give_drafts(scheduler, "r0", num_right=3)
    request = scheduler.requests["r0"]
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids={"r0": []}))
    assert request.num_computed_tokens == 8 and request.spec_token_ids == []
    scheduler.check_invariants()


def test_proposals_for_the_next_step_are_kept_on_the_request() -> None:
    driver = spec_driver(k=3)
    scheduler = driver.scheduler
    scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=10))
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"r0": [7]}, spec_token_ids={"r0": [1, 2]}))
    assert scheduler.requests["r0"].spec_token_ids == [1, 2]
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"r0": [1, 2]}


def test_speculation_is_refused_with_async_scheduling() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, async_scheduling=True)
    with pytest.raises(ValueError, match="async"):
        make_policy(config, CacheConfig(block_size=4), 16, speculative_config=ngram(2))


@pytest.mark.parametrize("config", [ngram(4), draft_model(4)], ids=["ngram", "draft_model"])
def test_under_pressure_random_acceptance_still_streams_the_sequential_tokens(config: SpeculativeConfig) -> None:
    """Chunked prefill, shared prefixes, preemption: every request's tokens are its sequential ones."""
    driver = spec_driver(config=config, k=4, num_blocks=14, block_size=4, enable_prefix_caching=True,
                         max_num_batched_tokens=16, long_prefill_token_threshold=6, max_num_seqs=4)
    scheduler = driver.scheduler
    shared = [9000 + i for i in range(8)]
    for index in range(8):
        prompt = shared + [500 + 10 * index + k for k in range(index % 3 + 1)]
        scheduler.add_request(make_request(f"r{index}", prompt=prompt, max_tokens=12, arrival_s=float(index)))
    finished = driver.run_until_done()
    for request_id, output in finished.items():
        streamed = [t for step in driver.history for out in step.outputs if out.request_id == request_id
                    for t in out.new_token_ids]
        num_prompt = output.num_prompt_tokens
        assert streamed == [default_token_fn(request_id, num_prompt + i) for i in range(12)]
    spec = [step.stats.spec_decoding for step in driver.history if step.stats.spec_decoding is not None]
    num_drafted = sum(s.num_draft_tokens for s in spec)
    num_accepted = sum(s.num_accepted_tokens for s in spec)
    assert 0 < num_accepted < num_drafted
    assert sum(step.stats.num_preemptions for step in driver.history) > 0
    assert sum(step.stats.prefix_cache_hits for step in driver.history) > 0
    assert scheduler.kv_cache_manager.usage == 0.0
