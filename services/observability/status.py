"""The server's state as operators see it: readiness (`GET /ready`) and the live summary the
admin page charts (`GET /admin/api/stats`), read from the router, the database, the metrics and
the alerts (`ServerStatus`)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry

from scheduling.router import Router, ServedModel
from services.observability.alerts import AlertManager, snapshot, total
from services.observability.metrics import queue_depths
from services.server_state import ServerState
from storage.db import Database

STORAGE_ERROR_HOLD_S = 30.0  # after SQLite refused a write, not ready this long (checkpoints may be failing)


class ServerStatus:
    def __init__(self, state: ServerState, router: Router, db: Database, registry: CollectorRegistry,
                 alerts: AlertManager, stats_window_s: float, auth_enabled: bool) -> None:
        self.state = state
        self.router = router
        self.db = db
        self.registry = registry
        self.alerts = alerts
        self.stats_window_s = stats_window_s
        self.auth_enabled = auth_enabled

    def readiness(self) -> str:
        return readiness(self.state, self.router, self.db)

    def stats(self) -> dict[str, Any]:
        return stats(self.router, self.registry, self.alerts, self.state, self.stats_window_s, self.auth_enabled)


def readiness(state: ServerState, router: Router, db: Database) -> str:
    """`ok`, or why this replica must take no traffic: draining, loading, stalled, storage_failing."""
    if state.draining:
        return "draining"
    if not state.ready:
        return "loading"
    if stalled_devices(router):
        return "stalled"
    if db.failed_within(STORAGE_ERROR_HOLD_S):
        return "storage_failing"
    return "ok"


def stalled_devices(router: Router) -> list[str]:
    """Devices whose worker thread (serving a loaded model) died or is stuck in one round of steps:
    its streams make no progress, so this replica must take no more traffic."""
    workers = {id(r.worker): r.worker for m in router.served_models() for r in m.replicas}
    workers |= {id(w): w for m in router.served_encoders() if (w := getattr(m.handle, "worker", None)) is not None}
    return sorted(w.device for w in workers.values() if not w.is_responsive())


def replica_json(replica, stats) -> dict[str, Any]:
    return {"device": replica.device, "running": stats.num_running, "waiting": stats.num_waiting,
            "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
            "weights_bytes": stats.weights_bytes, "kv_cache_bytes": stats.kv_cache_bytes,
            "device_memory_used_bytes": stats.device_memory_used_bytes, "steps": stats.num_steps,
            "batched_tokens": stats.num_batched_tokens, "preemptions": stats.num_preemptions,
            "prefix_cache_query_tokens": stats.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
            "prefix_cache_hit_rate": (stats.prefix_cache_hit_tokens / stats.prefix_cache_query_tokens
                                      if stats.prefix_cache_query_tokens else None),
            "spec_decode_draft_tokens": stats.spec_num_draft_tokens,
            "spec_decode_accepted_tokens": stats.spec_num_accepted_tokens,
            "spec_decode_acceptance_rate": (stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
                                            if stats.spec_num_draft_tokens else None)}


def models_json(router: Router) -> list[dict[str, Any]]:
    """Loaded generative versions with their engines' figures (encoders are in GET /admin/api/models)."""
    out = []
    for name, deployment in sorted(router.deployments.items()):
        for version, served in sorted(deployment.versions.items()):
            if not isinstance(served, ServedModel):
                continue
            replicas = [replica_json(r, r.worker.stats(r.engine_id)) for r in served.replicas]
            out.append({"name": name, "version": version, "label": router.label(served),
                        "traffic_percent": deployment.traffic.get(version, 0), "stable": version == deployment.stable,
                        "state": "draining" if served.draining else "ready", "in_flight": served.num_in_flight,
                        "max_model_len": served.max_model_len, "replicas": replicas})
    return out


def stats(router: Router, registry: CollectorRegistry, alerts: AlertManager, state: ServerState, window_s: float,
          auth_enabled: bool) -> dict[str, Any]:
    """The admin page's live summary: tokens, TTFT p50/p99 over `window_s`, queues, KV, models, alerts."""
    now = time.monotonic()
    current = snapshot(registry)
    p50, count = alerts.window.quantile(current, 0.5, window_s, now, "galley_time_to_first_token_seconds")
    p99, _ = alerts.window.quantile(current, 0.99, window_s, now, "galley_time_to_first_token_seconds")
    statuses: dict[str, float] = {}
    for (name, labels), value in current.items():
        if name == "galley_requests_total":
            status = dict(labels)["status"]
            statuses[status] = statuses.get(status, 0) + value
    by_priority: dict[str, int] = {}
    by_tenant: dict[str, int] = {}
    for totals in queue_depths(router).values():
        for (priority, tenant), n in totals.items():
            by_priority[priority] = by_priority.get(priority, 0) + n
            by_tenant[tenant] = by_tenant.get(tenant, 0) + n
    models = models_json(router)
    replicas = [r for m in models for r in m["replicas"]]
    kv_used = sum(r["kv_blocks_used"] for r in replicas)
    kv_total = sum(r["kv_blocks_total"] for r in replicas)
    return {
        "time": round(time.time(), 3), "uptime_s": round(now - state.started_s, 1) if state.started_s else None,
        "ready": state.ready, "draining": state.draining, "auth_enabled": auth_enabled,
        "requests": statuses,
        "generation_tokens": total(current, "galley_generation_tokens_total"),
        "prompt_tokens": total(current, "galley_prompt_tokens_total"),
        "preemptions": total(current, "galley_preemptions_total"),
        "engine_steps": total(current, "galley_engine_steps_total"),
        "batched_tokens": total(current, "galley_batched_tokens_total"),
        "ttft": {"p50": p50, "p99": p99, "count": count, "window_seconds": window_s},
        "running": sum(r["running"] for r in replicas), "waiting": sum(r["waiting"] for r in replicas),
        "queue": {"by_priority": by_priority, "by_tenant": by_tenant},
        "kv": {"used": kv_used, "total": kv_total, "usage": kv_used / kv_total if kv_total else 0.0},
        "models": models,
        "alerts_firing": [a.rule.name for a in alerts.states if a.state == "firing"],
    }
