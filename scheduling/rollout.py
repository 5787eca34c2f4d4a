"""Version choice and canary health: pure policy, no I/O, no asyncio.

`pick_version` maps a routing key (user, conversation or request id) onto a traffic split by
consistent hashing: the key hashes to one of 10,000 buckets and the versions own contiguous
ranges, canaries first and the stable version last, so one key keeps its version while the
split is unchanged, and raising a canary's share only moves keys onto the canary.
`HealthWindow` keeps each version's recent outcomes; `rollback_reason` compares a canary
with its stable version against the `[deployments]` thresholds.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass

NUM_BUCKETS = 10_000


@dataclass(frozen=True)
class DeploymentsConfig:
    window_seconds: float = 60.0  # canary health is judged over this trailing window
    max_error_rate: float = 0.2  # canary error rate above this (and above stable's) rolls back
    max_p99_ratio: float = 3.0  # canary p99 latency above this multiple of stable's rolls back
    min_requests: int = 10  # canary requests in the window before it is judged


def parse_model_ref(ref: str) -> tuple[str, str | None]:
    """`name` or `name@version` -> (name, version or None)."""
    name, sep, version = ref.partition("@")
    return name, (version if sep else None)


def bucket(key: str) -> int:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % NUM_BUCKETS


def ordered_versions(traffic: dict[str, int], stable: str) -> list[str]:
    return sorted(v for v in traffic if v != stable) + [stable]


def pick_version(traffic: dict[str, int], stable: str, key: str) -> str:
    """The version `key` lands on under `traffic` (percents summing to 100)."""
    point = bucket(key) * 100 / NUM_BUCKETS
    edge = 0.0
    for version in ordered_versions(traffic, stable):
        edge += traffic.get(version, 0)
        if point < edge:
            return version
    return stable


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass
class HealthSample:
    at_s: float
    ok: bool
    latency_s: float


class HealthWindow:
    """Finished requests of one model version within the trailing window. Invariant: in time order."""

    def __init__(self) -> None:
        self.outcomes: deque[HealthSample] = deque()
        self.num_errors = 0  # kept with the outcomes: the error rate costs nothing to read

    def record(self, at_s: float, ok: bool, latency_s: float) -> None:
        self.outcomes.append(HealthSample(at_s, ok, latency_s))
        self.num_errors += not ok

    def trim(self, now_s: float, window_s: float) -> None:
        while self.outcomes and self.outcomes[0].at_s < now_s - window_s:
            self.num_errors -= not self.outcomes.popleft().ok

    @property
    def num_requests(self) -> int:
        return len(self.outcomes)

    @property
    def error_rate(self) -> float:
        return self.num_errors / len(self.outcomes) if self.outcomes else 0.0

    @property
    def p99_latency_s(self) -> float | None:
        ok = [o.latency_s for o in self.outcomes if o.ok]
        return p99(ok) if ok else None


def rollback_reason(canary: HealthWindow, stable: HealthWindow, cfg: DeploymentsConfig,
                    latency: bool = True) -> str | None:
    """Why the canary should be rolled back, or None while it looks healthy (or is not yet judged).
    The error rate is O(1); `latency=False` skips the p99s, which sort both windows."""
    if canary.num_requests < cfg.min_requests:
        return None
    if canary.error_rate > cfg.max_error_rate and canary.error_rate > stable.error_rate:
        return (f"error rate {canary.error_rate:.0%} over {canary.num_requests} requests "
                f"(stable {stable.error_rate:.0%}, limit {cfg.max_error_rate:.0%})")
    if not latency:
        return None
    canary_p99, stable_p99 = canary.p99_latency_s, stable.p99_latency_s
    if canary_p99 is not None and stable_p99 and canary_p99 > cfg.max_p99_ratio * stable_p99:
        return f"p99 latency {canary_p99:.3f}s is over {cfg.max_p99_ratio:g}x stable's {stable_p99:.3f}s"
    return None
