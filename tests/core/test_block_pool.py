from __future__ import annotations

import pytest

from conveyor.core.block_pool import BlockPool


def test_new_blocks_come_from_the_front_and_are_referenced() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.check_invariants()


def test_asking_for_more_than_free_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="2 free"):
        pool.get_new_blocks(3)


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    cached, plain = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.cache_full_block(cached[0], 111)
    pool.cache_full_block(cached[1], 222)
    pool.free_blocks(cached)
    pool.free_blocks(plain)
    pool.check_invariants()
    reused = pool.get_new_blocks(2)
    assert {b.block_id for b in reused} == {b.block_id for b in plain}
    assert pool.get_cached_block(111) is cached[0] and pool.get_cached_block(222) is cached[1]


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for block, block_hash in zip(blocks, (10, 20, 30)):
        pool.cache_full_block(block, block_hash)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])  # free order: 30, 10, 20
    first = pool.get_new_blocks(1)[0]
    assert first is blocks[2] and first.block_hash is None
    assert pool.get_cached_block(30) is None
    assert pool.get_cached_block(10) is blocks[0]
    assert pool.get_new_blocks(1)[0] is blocks[0]
    pool.check_invariants()


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_block(block, 7)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([block])  # a second sharer: still out of the queue
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.check_invariants()
    assert block not in pool.get_new_blocks(2)
    pool.free_blocks([block, block])
    assert block.ref_cnt == 0
    pool.check_invariants()


def test_first_holder_of_a_hash_keeps_it() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, 5)
    pool.cache_full_block(second, 5)
    assert pool.get_cached_block(5) is first and second.block_hash is None
    pool.check_invariants()


def test_invariant_check_catches_a_corrupted_ref_count() -> None:
    pool = BlockPool(2)
    pool.blocks[0].ref_cnt = 1  # referenced while still in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_reset_prefix_cache_only_when_nothing_is_used() -> None:
    pool = BlockPool(2)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_block(block, 9)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(9) is None and block.block_hash is None
    pool.check_invariants()
