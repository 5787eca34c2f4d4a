"""Liveness, readiness and the OpenAPI document."""

from __future__ import annotations

from aiohttp import web

from api.auth import DATABASE
from api.context import ROUTER, STATE
from api.errors import json_response
from api.openai.schemas import Health
from api.routes import Route
from scheduling.router import Router

STORAGE_ERROR_HOLD_S = 30.0  # after SQLite refused a write, not ready this long (checkpoints may be failing)


async def health(request: web.Request) -> web.Response:
    """Liveness: the process answers. Stays 200 while draining."""
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 once models are loaded; 503 while loading and while draining."""
    state = request.app[STATE]
    if state.draining:
        return json_response({"status": "draining"}, status=503)
    if not state.ready:
        return json_response({"status": "loading"}, status=503)
    if stalled_devices(request.app[ROUTER]):
        return json_response({"status": "stalled"}, status=503)
    if request.app[DATABASE].failed_within(STORAGE_ERROR_HOLD_S):
        return json_response({"status": "storage_failing"}, status=503)
    return json_response({"status": "ok"})


def stalled_devices(router: Router) -> list[str]:
    """Devices whose worker thread (serving a loaded model) died or is stuck in one round of steps:
    its streams make no progress, so this replica must take no more traffic."""
    workers = {id(r.worker): r.worker for m in router.served_models() for r in m.replicas}
    workers |= {id(w): w for m in router.served_encoders() if (w := getattr(m.handle, "worker", None)) is not None}
    return sorted(w.device for w in workers.values() if not w.is_responsive())


ROUTES = [
    Route("GET", "/health", health, "Liveness", response=Health),
    Route("GET", "/ready", ready, "Readiness: 503 until models are loaded, while draining, while a device "
          "worker is stuck, and for 30 s after the database refused a write", response=Health, errors=(503,),
          error_body=Health),
]
