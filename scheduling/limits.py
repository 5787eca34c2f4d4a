"""Token buckets for per-tenant request and token rates. Pure state with an injectable clock."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class TokenBucket:
    """Holds up to `capacity`, refilled at `capacity / period_s` per second.

    `take` may be settled later with `refund` (a request's cost is estimated up front and
    corrected with the real count), so the level can dip below zero: the debt is paid back
    by refill before the next take succeeds.
    """

    def __init__(self, capacity: float, period_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.period_s = period_s
        self.clock = clock
        self.capacity = capacity
        self.rate = capacity / period_s
        self.level = capacity
        self._updated = clock()

    def resize(self, capacity: float) -> None:
        """A new limit, in place: what was taken stays taken (a change never refills the bucket)."""
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._refill()
        self.capacity = capacity
        self.rate = capacity / self.period_s
        self.level = min(self.level, capacity)

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._updated) * self.rate)
        self._updated = now

    def try_take(self, amount: float) -> bool:
        self._refill()
        if self.level < min(amount, self.capacity):
            return False
        self.level -= amount
        return True

    def refund(self, amount: float) -> None:
        """Give back (amount > 0) or charge more (amount < 0) after the real cost is known."""
        self._refill()
        self.level = min(self.capacity, self.level + amount)

    def seconds_until(self, amount: float) -> float:
        self._refill()
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.rate)

    def retry_after_s(self, amount: float) -> int:
        return max(1, math.ceil(self.seconds_until(amount)))
