"""Hashes that name a full KV block by everything before it: automatic prefix caching. Torch-free.

A block's hash covers its parent's hash, its own token ids and the cache salt, so equal hashes
mean an equal prefix up to and including the block (the vLLM scheme). The salt keeps tenants
apart: a prefix hit is visible as timing, so one tenant must not learn another's prompts by
probing them. SHA-256 rather than Python's `hash`: a collision would serve one prompt's KV to
another, and the 64-bit `hash` of a tuple is not collision resistant.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes


def root_hash(salt: str) -> BlockHash:
    """The parent of a sequence's first block."""
    return hashlib.sha256(b"galley-prefix\x00" + salt.encode()).digest()


def extend_hashes(hashes: list[BlockHash], token_ids: list[int], num_tokens: int, block_size: int,
                  salt: str) -> list[BlockHash]:
    """Append to `hashes` the hashes of the full blocks within the first `num_tokens` tokens
    that it does not hold yet; returns `hashes`."""
    parent = hashes[-1] if hashes else root_hash(salt)
    for start in range(len(hashes) * block_size, num_tokens - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


def prefix_hashes(token_ids: list[int], block_size: int, salt: str) -> list[BlockHash]:
    """The hashes of every full block of `token_ids`."""
    return extend_hashes([], token_ids, len(token_ids), block_size, salt)
