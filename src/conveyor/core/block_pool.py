"""The pool of KV cache blocks: reference counts, a free queue, and the prefix-cache index.

Model: every block is either *used* (ref_cnt > 0, held by one or more running requests) or *free*
(ref_cnt == 0, linked into the free queue). A free block may still carry the hash of the full block of
tokens whose KV it holds; such a block stays findable through `cached_blocks` until it is handed out
again, so a later request with the same prefix can `touch` it back into use (an O(1) unlink from the
middle of the queue, hence the intrusive doubly linked list). The queue is ordered so that the front
holds unhashed blocks (nothing to lose by reusing them) and the back holds hashed blocks in the order
they were freed; allocation pops from the front, so cached blocks are evicted least recently freed
first. Invariant: in the free queue no hashed block precedes an unhashed one (blocks only gain a hash
while used, and free ones lose it only when popped).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """One block of `block_size` token slots in the KV cache tensors (which live in the worker)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # Links of the free queue; both None when the block is used (or the queue's only element).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) push at either end, pop front, unlink."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head: KVCacheBlock | None = None
        self.tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        block.prev_free, block.next_free = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next_free = block
        self.tail = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        block.prev_free, block.next_free = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev_free = block
        self.head = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        block = self.head
        if block is None:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None:
            self.head = next_block
        else:
            prev_block.next_free = next_block
        if next_block is None:
            self.tail = prev_block
        else:
            next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head
        while block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of one model: allocation, sharing by reference count, and prefix-cache lookup."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[int, KVCacheBlock] = {}  # block hash -> the block holding that KV

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request."""
        return 1.0 - self.free_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the front of the free queue, evicting their cached content."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.free_queue.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block, in the given order (callers pass tails first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)  # no content worth keeping: reuse first
                else:
                    self.free_queue.append(block)  # cached: evicted after everything freed before it

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Index a used, full block under its chained hash (first holder of a hash wins)."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a used block's hash (its content will not be what the hash promises)."""
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no block is used (False, changing nothing, otherwise)."""
        if self.free_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        self.free_queue = FreeBlockQueue(self.blocks)
        return True

    def check_invariants(self) -> None:
        """free + used == total; ref >= 0; free <=> ref 0; hash index consistent; queue order."""
        free_ids: set[int] = set()
        seen_hashed = False
        for block in self.free_queue:
            assert block.block_id not in free_ids, f"block {block.block_id} twice in the free queue"
            free_ids.add(block.block_id)
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert not (seen_hashed and block.block_hash is None), "unhashed block behind a cached one"
            seen_hashed = seen_hashed or block.block_hash is not None
        assert len(free_ids) == self.free_queue.num_free_blocks, "free counter out of sync"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"{block} free/used mismatch"
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, f"{block} not indexed"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"index maps {block_hash} to {block}"
