"""Maps sequences to KV cache blocks (block tables), with automatic prefix caching. Torch-free.

The scheduler asks here whether a sequence's next tokens fit, and grows or frees block
tables; the model runner only reads `seq.block_table` to compute slots. With prefix caching
on, a sequence about to be admitted first takes the cached blocks of its longest known prefix
(`reuse_prefix`), so only the rest is prefilled. The prefix may run on into blocks other
sequences compute in the same step (a shared system prompt arriving in a burst): every layer
writes the whole step's K/V before any attention reads it, so a chunk may attend to a block
filled earlier in that very layer. After each step the engine reports computed
tokens (`cache_full_blocks`) and newly full blocks get their hash, generated tokens included,
so a conversation's next turn finds this turn's answer too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from engine.block_pool import BlockPool
from engine.prefix_hash import BlockHash, extend_hashes
from engine.types import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 idle_seconds: float = 0.0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.idle_seconds = idle_seconds  # > 0: cached blocks nobody held this long are forgotten
        self.num_query_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens found cached (not prefilled again)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` so the next `num_new_tokens` tokens have slots."""
        seq.block_table.extend(self.pool.allocate(self.blocks_needed(seq, num_new_tokens)))

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table, time.monotonic())
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    # ---- prefix caching ------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The hashes of `seq`'s full blocks within its first `num_tokens` tokens (memoised on
        the sequence: its tokens only ever grow)."""
        hashes = extend_hashes(seq.block_hashes, seq.token_ids, num_tokens, self.block_size, seq.cache_salt)
        return hashes[: num_tokens // self.block_size]

    def reuse_prefix(self, seq: Sequence, in_flight: Mapping[BlockHash, int] | None = None) -> int:
        """Give a sequence that holds no blocks the cached blocks of its longest cached prefix, then
        the blocks continuing it that this step computes for others (`in_flight`: hash -> block id);
        returns how many tokens they cover. The last token is always left to compute: its logits
        give the next sample, and its slot must not be written in a block others may read."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        hashes = self.block_hashes(seq, seq.num_tokens - 1)
        blocks = self.pool.lookup(hashes)
        computing = []
        for block_hash in hashes[len(blocks) :] if in_flight else ():
            block_id = in_flight.get(block_hash)
            if block_id is None:
                break
            computing.append(block_id)
        # a hit that ends inside a bidirectional span stops before it: the span's cached tokens saw the
        # rest of their span, which this prompt need not share (PaliGemma's prompt is one span)
        end = (len(blocks) + len(computing)) * self.block_size
        for a, b in seq.bidirectional_spans:
            if a < end < b:
                keep = a // self.block_size
                blocks, computing = blocks[:keep], computing[:max(0, keep - len(blocks))]
        self.pool.acquire(blocks)
        self.pool.share(computing)
        seq.block_table = blocks + computing
        seq.num_cached_blocks = len(seq.block_table)  # the block's computer registers it, not this one
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def count_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's lookup for the hit-rate metrics."""
        self.num_query_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens

    def pending_block_hashes(self, seq: Sequence, num_new_tokens: int) -> list[bytes]:
        """Hashes of the blocks `seq` fills this step with its next `num_new_tokens` tokens."""
        if not self.enable_prefix_caching:
            return []
        end = seq.num_computed_tokens + num_new_tokens
        return self.block_hashes(seq, end)[seq.num_computed_tokens // self.block_size :]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: register the blocks `seq` has now fully computed."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self.block_hashes(seq, seq.num_computed_tokens)
        for index in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_table[index], hashes[index])
        seq.num_cached_blocks = num_full

    def evict_idle(self) -> int:
        """Forget cached blocks idle past `idle_seconds` (called between steps); returns how many."""
        if self.idle_seconds <= 0:
            return 0
        return self.pool.evict_idle(time.monotonic() - self.idle_seconds)
