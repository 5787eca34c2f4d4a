"""The order in which waiting sequences are admitted, and who is preempted first.

The scheduler talks only to the `WaitingQueue` protocol. `FifoQueue` is plain arrival order
(newest preempted first); `scheduling.fair_queue.FairQueue` adds priority classes and
per-tenant fair share behind the same methods.
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

    def charge(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Account service a sequence received this step."""

    def on_finish(self, seq: Sequence) -> None:
        """A sequence left the system (finished or aborted)."""

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        """Which running sequence to preempt when KV blocks run out."""

    def preempt_for(self, waiting: Sequence, running: list[Sequence]) -> Sequence | None:
        """A running sequence to preempt so `waiting` can be admitted now, if policy says so."""

    def depth_by_class(self) -> dict[tuple[str, str], int]:
        """Waiting sequences per (priority, tenant), for metrics."""


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

    def charge(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int) -> None:
        pass

    def on_finish(self, seq: Sequence) -> None:
        pass

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        return running[-1]  # the newest

    def preempt_for(self, waiting: Sequence, running: list[Sequence]) -> Sequence | None:
        return None  # FIFO never preempts to admit

    def depth_by_class(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for seq in self._items:
            key = (seq.priority.name.lower(), seq.tenant)
            counts[key] = counts.get(key, 0) + 1
        return counts
