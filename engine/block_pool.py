"""The pool of KV cache block ids: which are free, how many holders each one has, and which
hold a cached prefix.

Owns ids, reference counts and the prefix cache's index; the KV tensors live in the model
runner. Reference counts let several sequences hold one block (a shared system prompt, `n`
choices of one prompt). A full block can carry a hash (`engine.prefix_hash`); when its last
holder frees it, it keeps its content and hash and stays findable until the pool needs the
room (least recently freed first) or it has been idle too long: that is how a conversation's
next turn finds its history.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.prefix_hash import BlockHash


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    """Invariants: a block is free (in `_empty` or `_evictable`) exactly when its reference count
    is zero; `_cached[h] == b` exactly when `_hash_of[b] == h`; `_evictable` holds exactly the
    free blocks that carry a hash, in the order they were freed (evicted first to last)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._empty: deque[int] = deque(range(num_blocks))  # free, no cached content: used first
        self._evictable: OrderedDict[int, float] = OrderedDict()  # free, cached -> when it was freed
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones and cached ones nobody holds."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content a later request may reuse (held or not)."""
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one holder each: empty ones first, then the least recently freed
        cached ones (which lose their hash)."""
        if count > self.num_free_blocks:
            raise OutOfBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(count):
            if self._empty:
                block_id = self._empty.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._forget(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add one holder to blocks that are already in use."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} is free"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int], now: float = 0.0) -> None:
        """Drop one holder from each block; a block nobody holds goes back to the pool. Tail
        blocks go first, so under pressure a sequence's last blocks are evicted before its prefix
        (which more requests share)."""
        for block_id in reversed(block_ids):
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hash_of[block_id] is None:
                    self._empty.append(block_id)
                else:
                    self._evictable[block_id] = now

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---- the prefix cache ----------------------------------------------------------------

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks of the longest cached run of `hashes`, from the first (not acquired)."""
        found = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def acquire(self, block_ids: list[int]) -> None:
        """Add one holder to cached blocks, taking free ones out of eviction's reach."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Mark a held, fully computed block as holding the prefix `block_hash`. A block computed
        twice (two requests prefilled the same prefix at once) stays uncached: the first copy is
        the one later requests find."""
        assert self._ref_counts[block_id] > 0, f"block {block_id} is free"
        if self._hash_of[block_id] is None and block_hash not in self._cached:
            self._hash_of[block_id] = block_hash
            self._cached[block_hash] = block_id

    def evict_idle(self, freed_before: float) -> int:
        """Forget cached blocks nobody has held since `freed_before`; returns how many."""
        count = 0
        while self._evictable:
            block_id, freed_at = next(iter(self._evictable.items()))
            if freed_at >= freed_before:
                break
            del self._evictable[block_id]
            self._forget(block_id)
            self._empty.append(block_id)
            count += 1
        return count

    def _forget(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash_of[block_id] = None
