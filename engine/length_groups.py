"""Cutting a batch of inputs into groups of similar lengths, where padding costs more than a split."""

from __future__ import annotations

import math
from collections.abc import Callable

GroupCost = Callable[[int, int], float]  # (inputs, longest length) -> the cost of one group


def length_groups(lengths: list[int], group_cost: GroupCost) -> list[list[int]]:
    """Indexes into `lengths` split into runs of the sorted order, minimising the summed
    `group_cost` of the runs (exact, by dynamic programming over the cut points)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = [0] + [math.inf] * len(order)  # best[j]: cost of the first j inputs in sorted order
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        width = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + group_cost(j - i, width)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
