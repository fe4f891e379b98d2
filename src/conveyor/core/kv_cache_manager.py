"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing.

Model: a running request holds `req_to_blocks[id]`, enough blocks for the tokens it has computed plus
those scheduled this step, and a reservation past them: for the static policy its whole life, for a
draft model its lookahead slots (never hashed: they hold no known token). Blocks are
only ever appended while the request runs and all released together on finish or preemption, tail
first, so the tail blocks (the least likely to be shared) are the first evicted. With prefix caching on,
the blocks full of computed or scheduled tokens are indexed under their chained hashes whenever the
request allocates (admission, each new block) and when it frees; a block that fills during decode is
thus indexed when the next one is taken, which keeps the per-step path free of hashing. The hash is
computed then, once per block (`Request.block_hashes` grows lazily here), and only over known tokens:
a position scheduled for a token still being sampled (async scheduling) is indexed at a later
allocation or at the free. A later request, or the same one after preemption, can then reuse the
indexed blocks. A prefix hit never covers a request's last known token: the model must compute at
least that one to sample the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.arith import cdiv
from conveyor.core.block_pool import BlockPool, KVCacheBlock
from conveyor.core.prefix_hash import extend_block_hashes
from conveyor.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last `take_prefix_cache_stats()`, in tokens (vLLM's units)."""

    num_queries: int = 0
    """Tokens of admitted requests that were looked up."""
    num_hits: int = 0
    """Of those, tokens found in the cache."""


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a request being admitted (`KVCacheManager.get_computed_blocks`)."""

    blocks: Sequence[KVCacheBlock]
    """The cached blocks, in order from block 0 (to pass to `allocate_slots`)."""
    num_tokens: int
    """Tokens whose KV those blocks hold: len(blocks) * block_size."""


NO_PREFIX_HIT = PrefixHit(blocks=(), num_tokens=0)


class KVCacheManager:
    """Allocates and frees KV blocks for requests; finds their cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of the table already indexed
        # Token slots each running request's blocks hold (len(table) * block_size): a step that stays
        # within them needs no allocation. Read by the scheduler's running pass before append_slots.
        self.num_slots: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of the request's full blocks, leaving its last token to compute."""
        if not self.enable_prefix_caching:
            return NO_PREFIX_HIT
        extend_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        get_cached = self.block_pool.get_cached_block
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            computed.append(block)
        return PrefixHit(blocks=computed, num_tokens=len(computed) * self.block_size)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (lookups of requests left waiting are not counted)."""
        if self.enable_prefix_caching:
            self.prefix_cache_stats.num_queries += num_query_tokens
            self.prefix_cache_stats.num_hits += num_hit_tokens

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Give the request slots for `num_new_tokens` more tokens (plus a lookahead reservation).

        `new_computed_blocks` are the blocks of a `PrefixHit` for a request being admitted;
        `request.num_computed_tokens` must not include them yet. Returns the ids of the blocks newly
        taken from the free queue (hits excluded), or None, changing nothing, if too few are free.
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens_after = num_computed_tokens + num_new_tokens
        num_required = self.num_blocks_for(num_tokens_after + num_lookahead_tokens)
        num_held = 0 if req_blocks is None else len(req_blocks)
        num_new_blocks = num_required - num_held - len(new_computed_blocks)
        return self._allocate(request, num_new_blocks, new_computed_blocks, num_tokens_after)

    def append_slots(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> list[int] | None:
        """New blocks for a running request whose next `num_new_tokens` (plus the draft model's
        lookahead slots past them) do not fit its `num_slots` (1/block_size of decodes per step): taken
        from the pool directly, as a running request already has its table and no hits to account.
        Returns their ids, or None, changing nothing, if too few are free."""
        request_id = request.request_id
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens_after + num_lookahead_tokens, self.block_size) - len(req_blocks)
        pool = self.block_pool
        if num_new_blocks > pool.num_free_blocks:
            return None
        new_blocks = pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, req_blocks, num_tokens_after)
        self.num_slots[request_id] = len(req_blocks) * self.block_size
        return [block.block_id for block in new_blocks]

    def _allocate(self, request: Request, num_new_blocks: int,
                  new_computed_blocks: Sequence[KVCacheBlock], num_tokens_after: int) -> list[int] | None:
        pool = self.block_pool
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if max(num_new_blocks, 0) > pool.num_free_blocks - num_free_hits:
            return None
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if not req_blocks:
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, req_blocks, num_tokens_after)
        self.num_slots[request.request_id] = len(req_blocks) * self.block_size
        return [block.block_id for block in new_blocks]

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Index the blocks that the first `num_tokens` tokens fill, hashing those not hashed yet; a block
        holding a position whose token is still being sampled waits for a later call."""
        request_id = request.request_id
        start = self.num_cached_blocks[request_id]
        end = num_tokens // self.block_size
        hashes = request.block_hashes
        if len(hashes) < end:
            extend_block_hashes(request, self.block_size)  # hashed lazily, once per block, when it fills
            end = min(end, len(hashes))
        for index in range(start, end):
            self.block_pool.cache_full_block(req_blocks[index], hashes[index])
        self.num_cached_blocks[request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first (tails are evicted before shared heads)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and self.enable_prefix_caching:
            self._settle_cached_blocks(request, blocks)
        self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_slots.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def _settle_cached_blocks(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Before freeing: index the blocks its computed tokens filled since the last allocation, and
        un-index blocks indexed for tokens that will now never be computed (a preemption victim
        unscheduled in the step that allocated them). No one else can hold those: hits are only taken
        by admissions, which never happen in a step that preempted."""
        num_computed_blocks = request.num_computed_tokens // self.block_size
        self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        for block in blocks[num_computed_blocks:self.num_cached_blocks[request.request_id]]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.uncache_block(block)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached block hash, only if no request holds a block (False otherwise:
        a held block's hash may be shared, and its holder indexes more blocks as it runs)."""
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def check_invariants(self) -> None:
        """Pool invariants, and every block's ref count equals the number of tables holding it."""
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] += 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} is held by {holders[block.block_id]} requests")
