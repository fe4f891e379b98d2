from __future__ import annotations

from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.prefix_hash import extend_block_hashes
from conveyor.request import Request
from core_builders import make_request


def _admit(manager: KVCacheManager, request: Request) -> int:
    """Look up, allocate the rest of the prompt, mark it computed; returns the hit in tokens."""
    extend_block_hashes(request, manager.block_size)
    hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit.blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return hit.num_tokens


def test_allocation_rounds_up_to_blocks_and_fails_cleanly() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    request = make_request(num_prompt_tokens=9)
    assert manager.allocate_slots(request, 9) == [0, 1, 2]
    request.num_computed_tokens = 9
    assert manager.allocate_slots(request, 3) == []  # slots 9..11 are in block 2
    assert manager.allocate_slots(request, 8) is None  # would need 2 more, 1 free
    assert manager.get_block_ids(request.request_id) == [0, 1, 2]
    manager.check_invariants()
    manager.free(request)
    assert manager.usage == 0.0
    manager.check_invariants()


def test_prefix_hit_never_covers_the_last_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert _admit(manager, make_request("a", num_prompt_tokens=8)) == 0
    assert _admit(manager, make_request("b", num_prompt_tokens=8)) == 4  # not 8: the last token computes
    assert _admit(manager, make_request("c", num_prompt_tokens=9)) == 8
    manager.check_invariants()


def test_cache_salt_separates_hits() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    _admit(manager, make_request("a", num_prompt_tokens=9, cache_salt="x"))
    assert _admit(manager, make_request("b", num_prompt_tokens=9, cache_salt="y")) == 0
    assert _admit(manager, make_request("c", num_prompt_tokens=9, cache_salt="x")) == 8


def test_freed_blocks_stay_cached_and_tails_are_evicted_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = make_request("a", num_prompt_tokens=16)
    _admit(manager, first)
    manager.free(first)
    assert manager.usage == 0.0
    filler = make_request("f", prompt=[7] * 3)
    assert manager.allocate_slots(filler, 3) == [3]  # the tail block of "a" goes first
    manager.free(filler)
    again = make_request("b", num_prompt_tokens=16)
    assert _admit(manager, again) == 12
    manager.check_invariants()


def test_prefix_stats_count_tokens() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    manager.record_prefix_lookup(9, 8)
    stats = manager.take_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (9, 8)
    assert manager.take_prefix_cache_stats().num_queries == 0


def test_hits_on_free_blocks_count_against_free_space() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    first = make_request("a", num_prompt_tokens=9)
    _admit(manager, first)
    manager.free(first)
    second = make_request("b", num_prompt_tokens=12)
    extend_block_hashes(second, 4)
    hit = manager.get_computed_blocks(second)
    assert hit.num_tokens == 8
    # 2 free hit blocks + 1 new block = all 3; asking for a lookahead of 1 more block must fail.
    assert manager.allocate_slots(second, 4, hit.blocks, num_lookahead_tokens=4) is None
    manager.check_invariants()
    assert manager.allocate_slots(second, 4, hit.blocks) is not None
    manager.check_invariants()
