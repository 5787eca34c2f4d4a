"""Maps sequences to KV cache blocks (block tables). Torch-free.

The scheduler asks here whether a sequence's next tokens fit, and grows or frees block
tables; the model runner only reads `seq.block_table` to compute slots.
"""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.types import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

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
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
