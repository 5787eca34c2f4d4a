"""The admin page (`GET /admin`, files in static/) and the `/admin/api/*` JSON it reads:
stats for the live charts, recent requests, alerts, conversations across tenants, profiling.

Also wires the observability parts into the app (`setup`): the request-record sinks (log
line, recent-requests ring, spans), the alert loop, and a collector of model states. The
page itself only calls JSON endpoints; each is useful on its own (see the README). The admin
key is checked by api/auth.py for every `/admin/api/` path; `/admin` and its static files
are public (they hold no data; the page asks for the key).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, Field

from api.auth import AUTH
from api.context import METRICS, ROUTER, STATE
from api.conversations import CONVERSATIONS
from api.errors import json_response
from api.routes import Route
from api.validation import parse_params
from scheduling.router import ServedModel
from services.conversations import Conversation
from services.deployments.manager import MODELS
from services.errors import ConflictError, NotFoundError, NotImplementedFeatureError
from services.observability.alerts import AlertManager, AlertRule, MetricsWindow, snapshot, total
from services.observability.metrics import queue_depths
from services.observability.telemetry import (
    ObservabilityConfig,
    RecentRequests,
    Tracing,
    TracingConfig,
    build_tracing,
    log_request,
)

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"

RECENT = web.AppKey("recent_requests", RecentRequests)
ALERTS = web.AppKey("alerts", AlertManager)
OBSERVABILITY = web.AppKey("observability", ObservabilityConfig)
TRACING = web.AppKey("tracing", object)
PROFILING = web.AppKey("profiling", asyncio.Lock)


class ModelStateCollector:
    """`galley_model_state{model,version,state} 1` for each registered version (the lifecycle's view)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def collect(self):
        family = GaugeMetricFamily("galley_model_state", "1 for each model version's state "
                                   "(unloaded, loading, ready, failed)", labels=["model", "version", "state"])
        for name, version, state in model_states(self.app):
            family.add_metric([name, version, state], 1)
        yield family


def model_states(app: web.Application) -> list[tuple[str, str, str]]:
    """(name, version, state) per version: the lifecycle manager's registry when there is one, else the router's."""
    manager = app.get(MODELS)  # the model lifecycle owns version states; models attached without it are ready
    states = {(vs.spec.name, vs.spec.version): vs.state for vs in manager.versions.values()} if manager else {}
    router = app[ROUTER]
    for served in [*router.served_models(), *router.served_encoders()]:  # attached without the registry (tests)
        states.setdefault((served.name, served.version), "ready")
    return sorted((name, version, state) for (name, version), state in states.items())


def setup(app: web.Application, observability: ObservabilityConfig, tracing: TracingConfig,
          alert_rules: tuple[AlertRule, ...], span_exporter: Any = None) -> None:
    metrics = app[METRICS]
    app[OBSERVABILITY] = observability
    app[RECENT] = RecentRequests(observability.recent_requests)
    metrics.log_prompts = observability.log_prompts
    metrics.sinks += [log_request, app[RECENT]]
    app[TRACING] = build_tracing(tracing, span_exporter)
    if app[TRACING] is not None:
        metrics.sinks.append(app[TRACING])
    metrics.registry.register(ModelStateCollector(app))
    keep_s = max([observability.stats_window_seconds, *(r.window_seconds for r in alert_rules)])
    window = MetricsWindow(metrics.registry, keep_s + observability.alert_interval_seconds)
    app[ALERTS] = AlertManager(alert_rules, window)
    app[PROFILING] = asyncio.Lock()
    app.cleanup_ctx.append(run_alerts)
    app.router.add_static("/admin/static/", STATIC_DIR, append_version=False)


async def run_alerts(app: web.Application):
    task = asyncio.get_running_loop().create_task(app[ALERTS].run(app[OBSERVABILITY].alert_interval_seconds))
    yield
    task.cancel()
    tracing = app[TRACING]
    if isinstance(tracing, Tracing):
        tracing.shutdown()


# ---- the page --------------------------------------------------------------------------


async def admin_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "admin.html", headers={"Cache-Control": "no-cache"})


# ---- stats for the charts --------------------------------------------------------------


def replica_json(replica, stats) -> dict[str, Any]:
    return {"device": replica.device, "running": stats.num_running, "waiting": stats.num_waiting,
            "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
            "weights_bytes": stats.weights_bytes, "kv_cache_bytes": stats.kv_cache_bytes,
            "device_memory_used_bytes": stats.device_memory_used_bytes, "steps": stats.num_steps,
            "batched_tokens": stats.num_batched_tokens, "preemptions": stats.num_preemptions}


def models_json(app: web.Application) -> list[dict[str, Any]]:
    """Loaded generative versions with their engines' figures (encoders are in GET /admin/api/models)."""
    router, out = app[ROUTER], []
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


def stats_json(app: web.Application) -> dict[str, Any]:
    alerts, state, cfg = app[ALERTS], app[STATE], app[OBSERVABILITY]
    now = time.monotonic()
    current = snapshot(app[METRICS].registry)
    window_s = cfg.stats_window_seconds
    p50, count = alerts.window.quantile(current, 0.5, window_s, now, "galley_time_to_first_token_seconds")
    p99, _ = alerts.window.quantile(current, 0.99, window_s, now, "galley_time_to_first_token_seconds")
    statuses: dict[str, float] = {}
    for (name, labels), value in current.items():
        if name == "galley_requests_total":
            status = dict(labels)["status"]
            statuses[status] = statuses.get(status, 0) + value
    by_priority: dict[str, int] = {}
    by_tenant: dict[str, int] = {}
    for totals in queue_depths(app[ROUTER]).values():
        for (priority, tenant), n in totals.items():
            by_priority[priority] = by_priority.get(priority, 0) + n
            by_tenant[tenant] = by_tenant.get(tenant, 0) + n
    models = models_json(app)
    replicas = [r for m in models for r in m["replicas"]]
    kv_used = sum(r["kv_blocks_used"] for r in replicas)
    kv_total = sum(r["kv_blocks_total"] for r in replicas)
    return {
        "time": round(time.time(), 3), "uptime_s": round(now - state.started_s, 1) if state.started_s else None,
        "ready": state.ready, "draining": state.draining, "auth_enabled": app[AUTH].enabled,
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


async def admin_stats(request: web.Request) -> web.Response:
    return json_response(stats_json(request.app))


# ---- recent requests, alerts -----------------------------------------------------------


class RequestsQuery(BaseModel):
    limit: int = Field(100, ge=1, le=10_000)
    tenant: str = Field(None, description="Only this tenant's requests.")
    status: str = Field(None, description="Only requests that ended so (ok, error, rejected, cancelled, ...).")


async def admin_requests(request: web.Request) -> web.Response:
    query = parse_params(request.query, RequestsQuery)
    data = request.app[RECENT].latest(query.limit, query.tenant, query.status)
    return json_response({"object": "list", "data": data})


async def admin_alerts(request: web.Request) -> web.Response:
    return json_response(request.app[ALERTS].to_dict())


# ---- conversations across tenants ------------------------------------------------------


def conversation_json(c: Conversation, num_messages: int | None = None) -> dict[str, Any]:
    out = {"id": c.id, "tenant": c.tenant, "model": c.model, "model_version": c.model_version, "title": c.title,
           "created_at": c.created_at, "updated_at": c.updated_at}
    return out if num_messages is None else {**out, "num_messages": num_messages}


class ConversationsQuery(BaseModel):
    limit: int = Field(100, ge=1, le=1000)
    tenant: str = Field(None, description="Only this tenant's conversations.")


async def admin_list_conversations(request: web.Request) -> web.Response:
    params = parse_params(request.query, ConversationsQuery)
    rows = await request.app[CONVERSATIONS].across_tenants(params.limit, params.tenant or None)
    return json_response({"object": "list", "data": [conversation_json(c, n) for c, n in rows]})


async def admin_get_conversation(request: web.Request) -> web.Response:
    found, messages = await request.app[CONVERSATIONS].find(request.match_info["conversation_id"])
    body = conversation_json(found, len(messages))
    body["messages"] = [{"role": m.role, "content": m.content, "prompt_tokens": m.prompt_tokens,
                         "completion_tokens": m.completion_tokens, "stream_id": m.stream_id,
                         "created_at": m.created_at} for m in messages]
    return json_response(body)


# ---- profiling -------------------------------------------------------------------------


def workers_by_device(app: web.Application) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in app[ROUTER].served_models():
        for replica in model.replicas:
            out.setdefault(replica.device, replica.worker)
    return out


class ProfileQuery(BaseModel):
    seconds: float = Field(5.0, gt=0, allow_inf_nan=False,
                           description="How long to record; at most [observability] max_profile_seconds (longer "
                           "asks record that long).")
    device: str = Field(None, description="A device worker (`cpu#0`, `cuda:0#0`); default: the first.")


async def admin_profile(request: web.Request) -> web.Response:
    """Record a torch profiler trace of one device worker's engine steps for N seconds."""
    query = parse_params(request.query, ProfileQuery)
    seconds = min(query.seconds, request.app[OBSERVABILITY].max_profile_seconds)
    workers = workers_by_device(request.app)
    device = query.device or next(iter(workers), None)
    worker = workers.get(device) if device else None
    if worker is None:
        raise NotFoundError(f"no device worker {device!r}; loaded: {sorted(workers)}", param="device")
    if not hasattr(worker, "profile"):
        raise NotImplementedFeatureError(f"the worker of {device!r} cannot record a profile")
    lock = request.app[PROFILING]
    if lock.locked():
        raise ConflictError("a profile is already being recorded; try again when it ends", code="profile_running")
    async with lock:
        trace = await asyncio.wrap_future(worker.profile(seconds))
    filename = f"galley-profile-{device.replace(':', '_').replace('#', '-')}-{int(time.time())}.json"
    return web.Response(body=trace, content_type="application/json",
                        headers={"Content-Disposition": f'attachment; filename="{filename}"',
                                 "Cache-Control": "no-store"})


ROUTES = [
    Route("GET", "/admin", admin_page, "The admin page (HTML; it asks for the admin key)", content_type="text/html"),
    Route("GET", "/admin/api/stats", admin_stats,
          "Live summary for the charts: tokens, TTFT p50/p99, queues, KV, models (admin key)"),
    Route("GET", "/admin/api/requests", admin_requests, "Recent generation requests, newest first (admin key)",
          query=RequestsQuery),
    Route("GET", "/admin/api/alerts", admin_alerts, "Alert rules, their state, firing alerts and recent transitions "
          "(admin key)"),
    Route("GET", "/admin/api/conversations", admin_list_conversations,
          "Conversations across tenants, most recent first (admin key)", query=ConversationsQuery),
    Route("GET", "/admin/api/conversations/{conversation_id}", admin_get_conversation,
          "A conversation of any tenant with its messages (admin key)"),
    Route("POST", "/admin/api/profile", admin_profile, "Record a torch profiler trace of the engine for ?seconds=N; "
          "returns Chrome-trace JSON (admin key)", query=ProfileQuery, errors=(404, 409)),
]
