"""Prefix-aware replica choice: send a request where its longest prefix is likely cached.

With several replicas of a model (several devices), each keeps its own KV prefix cache, so a
conversation's next turn is cheap only on the replica that served the last one. The router
cannot see the engines' caches (they live on worker threads), so each replica keeps an
approximate copy here: the block hashes of the prompts it was sent, least recently used
dropped beyond the replica's KV capacity (the SGLang router's approximate tree, flat). A
request goes to the replica holding its longest known prefix unless that replica is
overloaded, then to the least loaded one. Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from engine.prefix_hash import BlockHash

# The prefix replica wins unless it has this many more requests in flight than the least loaded
# one: past that, queueing behind it costs more than prefilling the prefix again.
AFFINITY_SLACK = 8


class Loaded(Protocol):
    num_in_flight: int
    prefixes: PrefixIndex


class PrefixIndex:
    """The block hashes recently routed to one replica, at most `capacity` of them."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` this replica was sent."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count

    def remember(self, hashes: list[BlockHash], capacity: int | None = None) -> None:
        if capacity:
            self.capacity = capacity
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


def pick(replicas: list[Loaded], hashes: list[BlockHash]) -> Loaded:
    """The replica with the longest known prefix of `hashes`, unless it is overloaded (more than
    `AFFINITY_SLACK` requests above the least loaded); else the least loaded."""
    least = min(replicas, key=lambda r: r.num_in_flight)
    if len(replicas) == 1 or not hashes:
        return least
    best = max(replicas, key=lambda r: (r.prefixes.matched(hashes), -r.num_in_flight))
    if best.prefixes.matched(hashes) and best.num_in_flight <= least.num_in_flight + AFFINITY_SLACK:
        return best
    return least
