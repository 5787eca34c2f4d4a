"""Canary health: each version's recent outcomes and latencies (`HealthWindow`), and the judgement
of a model's canary versions against its stable version, which starts an automatic rollback."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

from scheduling.rollout import DeploymentsConfig, HealthWindow, rollback_reason
from scheduling.router import Router, Served
from services.background import BackgroundTasks

CANARY_CHECK_INTERVAL_S = 0.1


class Canaries:
    def __init__(self, router: Router, cfg: DeploymentsConfig, roll_back: Callable[[str, str], Awaitable[object]],
                 background: BackgroundTasks) -> None:
        self.router = router
        self.cfg = cfg
        self.roll_back = roll_back  # (model name, reason): the automatic rollback
        self._background = background
        self.health: dict[str, HealthWindow] = {}  # name@version -> recent outcomes
        self._rolling_back: set[str] = set()  # model names with an automatic rollback under way
        self._checked_s: dict[str, float] = {}  # model name -> when its canaries were last judged

    def record(self, served: Served, ok: bool, latency_s: float, now: float) -> None:
        """A finished request of `served`; its model's canaries are judged again."""
        self.health.setdefault(served.ref, HealthWindow()).record(now, ok, latency_s)
        self.check(served.name)

    def forget(self, ref: str) -> None:
        """A canary rolled back: a later canary of the same version starts clean."""
        self.health.pop(ref, None)

    def check(self, name: str, force: bool = False) -> None:
        """Judge `name`'s canaries against its stable version: error rates on every call, p99
        latencies (which sort the windows, too much for every request) at most every
        CANARY_CHECK_INTERVAL_S per model unless `force`."""
        deployment = self.router.deployments.get(name)
        if deployment is None or name in self._rolling_back:
            return
        now, window_s = time.monotonic(), self.cfg.window_seconds
        latency = force or now - self._checked_s.get(name, -math.inf) >= CANARY_CHECK_INTERVAL_S
        if latency:
            self._checked_s[name] = now
        stable = self.health.setdefault(f"{name}@{deployment.stable}", HealthWindow())
        stable.trim(now, window_s)
        for version, percent in deployment.traffic.items():
            if version == deployment.stable or percent == 0:
                continue
            canary = self.health.setdefault(f"{name}@{version}", HealthWindow())
            canary.trim(now, window_s)
            reason = rollback_reason(canary, stable, self.cfg, latency)
            if reason is not None:
                self._rolling_back.add(name)
                task = self._background.spawn(self.roll_back(name, f"canary {version}: {reason}"))
                task.add_done_callback(lambda _: self._rolling_back.discard(name))
                return
