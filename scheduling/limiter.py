"""Per-tenant admission control on the event loop: concurrency, request rate, token rate.

Runs before a request reaches a model's queue, so overload is answered at once (429 with
Retry-After) instead of piling up. A request's token cost is estimated as prompt +
max_tokens and settled with the real count when it finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduling.limits import TokenBucket


@dataclass(frozen=True)
class TenantLimits:
    """What admission needs to know about a tenant (None: unlimited)."""

    name: str = "default"
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


class Rejected(Exception):
    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


RATE_LIMITS = ("requests_per_minute", "tokens_per_minute")  # the limits kept as token buckets


@dataclass
class TenantState:
    """One tenant's admission state: exactly one per tenant name, whatever its limits are now."""

    limits: TenantLimits
    in_flight: int = 0
    buckets: dict[str, TokenBucket] = field(default_factory=dict)  # by limit name; kept while a limit is off

    @property
    def requests(self) -> TokenBucket | None:
        return self.buckets.get("requests_per_minute") if self.limits.requests_per_minute else None

    @property
    def tokens(self) -> TokenBucket | None:
        return self.buckets.get("tokens_per_minute") if self.limits.tokens_per_minute else None

    def apply(self, limits: TenantLimits, clock: Callable[[], float]) -> None:
        """Take on edited limits in place: a bucket keeps its level when its capacity changes, and
        a removed limit's bucket is kept, so no edit ever hands out a full bucket."""
        self.limits = limits
        for name in RATE_LIMITS:
            capacity, bucket = getattr(limits, name), self.buckets.get(name)
            if capacity is not None and bucket is None:
                self.buckets[name] = TokenBucket(capacity, 60.0, clock)
            elif capacity is not None and bucket.capacity != capacity:
                bucket.resize(capacity)


@dataclass
class Ticket:
    """An admitted request's claim; hand it back with `TenantLimiter.release`."""

    tenant: str
    estimated_tokens: int
    released: bool = False


@dataclass
class TenantLimiter:
    """Limits are passed in on every call (read from the tenant directory at admission time);
    the state they are checked against lives here, one `TenantState` per tenant name."""

    clock: Callable[[], float] = time.monotonic
    tenants: dict[str, TenantState] = field(default_factory=dict)

    def _state(self, limits: TenantLimits) -> TenantState:
        state = self.tenants.get(limits.name)
        if state is None:
            state = self.tenants[limits.name] = TenantState(limits)
            state.apply(limits, self.clock)
        elif state.limits != limits:  # edited: the same state, resized
            state.apply(limits, self.clock)
        return state

    def admit(self, limits: TenantLimits, estimated_tokens: int) -> Ticket:
        """Claim a slot, a request and the estimated tokens, or raise `Rejected` changing nothing."""
        state = self._state(limits)
        if limits.max_concurrent is not None and state.in_flight >= limits.max_concurrent:
            raise Rejected("concurrency", f"tenant {limits.name!r} already has {state.in_flight} requests in "
                           f"flight, its max_concurrent", 1)
        if state.requests is not None and state.requests.seconds_until(1) > 0:
            raise Rejected("requests_per_minute", f"tenant {limits.name!r} is over its "
                           f"requests_per_minute of {limits.requests_per_minute}", state.requests.retry_after_s(1))
        if state.tokens is not None and state.tokens.seconds_until(estimated_tokens) > 0:
            raise Rejected("tokens_per_minute", f"tenant {limits.name!r} is over its tokens_per_minute of "
                           f"{limits.tokens_per_minute} (this request may use {estimated_tokens})",
                           state.tokens.retry_after_s(estimated_tokens))
        if state.requests is not None:
            state.requests.try_take(1)
        if state.tokens is not None:
            state.tokens.try_take(estimated_tokens)
        state.in_flight += 1
        return Ticket(limits.name, estimated_tokens)

    def count_request(self, limits: TenantLimits) -> None:
        """A request that holds no slot and runs nothing (creating a batch job or a conversation):
        it takes one from `requests_per_minute` only, or raises `Rejected` changing nothing."""
        state = self._state(limits)
        if state.requests is not None and not state.requests.try_take(1):
            raise Rejected("requests_per_minute", f"tenant {limits.name!r} is over its "
                           f"requests_per_minute of {limits.requests_per_minute}", state.requests.retry_after_s(1))

    def release(self, ticket: Ticket, used_tokens: int) -> None:
        """The request is over: free its slot and settle its token estimate with the real count."""
        if ticket.released:
            return
        ticket.released = True
        state = self.tenants.get(ticket.tenant)
        if state is None:
            return
        state.in_flight -= 1
        if state.tokens is not None:
            state.tokens.refund(ticket.estimated_tokens - used_tokens)
