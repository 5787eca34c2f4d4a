"""The order in which waiting sequences are admitted.

The scheduler only talks to the `WaitingQueue` protocol; FIFO is the policy for now and the
tenancy work swaps in a priority / fair-share queue behind the same five methods.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine.types import Sequence


class WaitingQueue(Protocol):
    def push(self, seq: Sequence) -> None: ...
    def push_front(self, seq: Sequence) -> None: ...
    def peek(self) -> Sequence | None: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


class FifoQueue:
    """First come, first served; preempted sequences go back to the front."""

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._items.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._items.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._items[0] if self._items else None

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)
