"""Alerts evaluated in-process from the app's own Prometheus registry, every few seconds.

`MetricsWindow` keeps timestamped snapshots of the registry's samples so rules can take
deltas over a window (rates, histogram quantiles) the way Prometheus would. `AlertManager`
holds one state per `[[alerts]]` rule (inactive -> pending -> firing -> resolved), logs each
transition, and keeps a short history for `GET /admin/api/alerts` and the admin page.
The same rules, as PromQL, ship in deploy/prometheus/alerts.yml.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from services.observability.telemetry import FAILURE

log = structlog.get_logger("galley.alerts")

KINDS = ("ttft_p99", "error_rate", "queue_depth", "kv_usage", "model_load_failed")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class AlertRule:
    """One `[[alerts]]` entry: fires when `kind`'s value is above `threshold` for `for_seconds`."""

    name: str
    kind: str  # ttft_p99 (seconds) | error_rate (0-1) | queue_depth | kv_usage (0-1) | model_load_failed (versions)
    threshold: float = 0.0
    for_seconds: float = 0.0
    window_seconds: float = 300.0  # rates and quantiles look this far back
    model: str = ""  # only this model; "": all
    min_requests: int = 1  # ttft_p99, error_rate: fewer requests in the window never fire
    severity: str = "warning"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"alert {self.name!r}: kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.window_seconds <= 0 or self.for_seconds < 0:
            raise ValueError(f"alert {self.name!r}: window_seconds must be > 0 and for_seconds >= 0")


DEFAULT_ALERTS = (
    AlertRule("HighTimeToFirstToken", "ttft_p99", threshold=5.0, for_seconds=60.0, min_requests=10),
    AlertRule("HighErrorRate", "error_rate", threshold=0.05, for_seconds=60.0, min_requests=20),
    AlertRule("QueueBacklog", "queue_depth", threshold=100.0, for_seconds=30.0),
    AlertRule("KVCacheNearlyFull", "kv_usage", threshold=0.95, for_seconds=60.0),
    AlertRule("ModelLoadFailed", "model_load_failed", threshold=0.0, severity="critical"),
)


def snapshot(registry: CollectorRegistry) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def matching(samples: Samples, name: str, model: str = "", **labels: str) -> list[tuple[dict, float]]:
    out = []
    for (sample_name, key), value in samples.items():
        if sample_name != name:
            continue
        found = dict(key)
        if model and found.get("model") != model:
            continue
        if all(found.get(k) == v for k, v in labels.items()):
            out.append((found, value))
    return out


def total(samples: Samples, name: str, model: str = "", **labels: str) -> float:
    return sum(value for _, value in matching(samples, name, model, **labels))


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' estimate from cumulative bucket counts {le: count}; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # past the highest finite bucket: its bound is the best estimate
            span = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / span if span else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


class MetricsWindow:
    """Snapshots of a registry over time. Invariant: snapshots are in time order, the first is
    a zero baseline until older ones age out, and none is older than `keep_s` plus one."""

    def __init__(self, registry: CollectorRegistry, keep_s: float) -> None:
        self.registry = registry
        self.keep_s = keep_s
        self.snapshots: collections.deque[tuple[float, Samples]] = collections.deque([(time.monotonic(), {})])

    def record(self, now: float | None = None) -> Samples:
        now = time.monotonic() if now is None else now
        current = snapshot(self.registry)
        self.snapshots.append((now, current))
        while len(self.snapshots) > 2 and self.snapshots[1][0] <= now - self.keep_s:
            self.snapshots.popleft()
        return current

    def baseline(self, window_s: float, now: float) -> Samples:
        """The oldest snapshot inside the window (the zero baseline early on)."""
        for taken, samples in self.snapshots:
            if taken >= now - window_s:
                return samples
        return self.snapshots[-1][1]

    def delta(self, current: Samples, window_s: float, now: float, name: str, model: str = "",
              **labels: str) -> float:
        old = self.baseline(window_s, now)
        return total(current, name, model, **labels) - total(old, name, model, **labels)

    def quantile(self, current: Samples, q: float, window_s: float, now: float, name: str,
                 model: str = "") -> tuple[float | None, float]:
        """(quantile over the window, observations in the window) of histogram `name`."""
        old = self.baseline(window_s, now)
        buckets: dict[float, float] = {}
        for labels, value in matching(current, name + "_bucket", model):
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
        for labels, value in matching(old, name + "_bucket", model):
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) - value
        count = buckets.get(math.inf, 0.0)
        return histogram_quantile(q, buckets), count


def rule_value(rule: AlertRule, window: MetricsWindow, current: Samples, now: float) -> float | None:
    """The rule's current value; None when there is too little data to judge."""
    w, m = rule.window_seconds, rule.model
    if rule.kind == "ttft_p99":
        value, count = window.quantile(current, 0.99, w, now, "galley_time_to_first_token_seconds", m)
        return value if count >= rule.min_requests else None
    if rule.kind == "error_rate":
        requests = window.delta(current, w, now, "galley_requests_total", m)
        requests -= window.delta(current, w, now, "galley_requests_total", m, status="rejected")
        errors = sum(window.delta(current, w, now, "galley_requests_total", m, status=s) for s in FAILURE)
        return errors / requests if requests >= rule.min_requests else None
    if rule.kind == "queue_depth":
        return total(current, "galley_requests_waiting", m)
    if rule.kind == "kv_usage":
        usages = [used / blocks for labels, used in matching(current, "galley_kv_blocks_used", m)
                  if (blocks := current.get(("galley_kv_blocks_total", tuple(sorted(labels.items()))), 0))]
        return max(usages, default=0.0)
    return total(current, "galley_model_state", m, state="failed")  # versions whose last load failed


@dataclass
class AlertState:
    rule: AlertRule
    state: str = "inactive"  # inactive | pending | firing
    value: float | None = None
    since: float | None = None  # unix time it became pending or firing
    pending_since_s: float | None = None  # monotonic

    def to_dict(self) -> dict[str, Any]:
        r = self.rule
        return {"name": r.name, "kind": r.kind, "threshold": r.threshold, "for_seconds": r.for_seconds,
                "window_seconds": r.window_seconds, "model": r.model or None, "severity": r.severity,
                "state": self.state, "value": None if self.value is None else round(self.value, 6),
                "since": self.since}


@dataclass
class AlertManager:
    rules: tuple[AlertRule, ...]
    window: MetricsWindow
    states: list[AlertState] = field(default_factory=list)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))

    def __post_init__(self) -> None:
        self.states = [AlertState(rule) for rule in self.rules]

    def evaluate(self, now: float | None = None) -> Samples:
        """Snapshot the metrics and move every rule's state; returns the snapshot."""
        now = time.monotonic() if now is None else now
        current = self.window.record(now)
        for state in self.states:
            try:
                value = rule_value(state.rule, self.window, current, now)
            except Exception:
                log.exception("alert rule failed", alert=state.rule.name)
                continue
            self._move(state, value, now)
        return current

    def _move(self, state: AlertState, value: float | None, now: float) -> None:
        state.value = value
        breached = value is not None and value > state.rule.threshold
        if not breached:
            if state.state == "firing":
                self._transition(state, "resolved")
            state.state, state.since, state.pending_since_s = "inactive", None, None
            return
        if state.state == "inactive":
            state.state, state.since, state.pending_since_s = "pending", time.time(), now
        if state.state == "pending" and now - state.pending_since_s >= state.rule.for_seconds:
            state.state, state.since = "firing", time.time()
            self._transition(state, "firing")

    def _transition(self, state: AlertState, event: str) -> None:
        rule = state.rule
        entry = {"name": rule.name, "kind": rule.kind, "state": event, "value": state.value,
                 "threshold": rule.threshold, "severity": rule.severity, "at": round(time.time(), 3)}
        self.history.append(entry)
        level = "warning" if event == "firing" else "info"
        getattr(log, level)(f"alert {event}", alert=rule.name, kind=rule.kind, value=state.value,
                            threshold=rule.threshold, severity=rule.severity)

    def to_dict(self) -> dict[str, Any]:
        rules = [s.to_dict() for s in self.states]
        return {"firing": [r for r in rules if r["state"] == "firing"], "rules": rules,
                "history": list(reversed(self.history))}

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.evaluate()
            except Exception:
                log.exception("alert evaluation failed")
