"""Liveness, readiness and the OpenAPI document."""

from __future__ import annotations

from aiohttp import web

from api.context import STATE
from api.errors import json_response
from api.routes import Route
from api.schemas import Health


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
    return json_response({"status": "ok"})


ROUTES = [
    Route("GET", "/health", health, "Liveness", response=Health),
    Route("GET", "/ready", ready, "Readiness: 503 until models are loaded and while draining", response=Health,
          errors=(503,), error_body=Health),
]
