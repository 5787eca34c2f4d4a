"""The pool of KV cache block ids: which are free and how many holders each one has.

Owns ids and reference counts only; the KV tensors live in the model runner. Reference
counts let several sequences hold one block, which is what prefix caching builds on.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    """Invariant: a block id is in `_free` exactly when its reference count is zero."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(count)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add one holder to blocks that are already in use."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} is free"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block nobody holds goes back to the pool."""
        for block_id in reversed(block_ids):
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
