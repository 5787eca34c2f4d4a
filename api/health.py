"""Liveness and readiness."""

from __future__ import annotations

from aiohttp import web

from api.errors import json_response
from api.openai.objects import Health
from api.routes import Route
from api.services import services


async def health(request: web.Request) -> web.Response:
    """Liveness: the process answers. Stays 200 while draining."""
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 once models are loaded; 503 while loading, while draining, while a device
    worker is stuck, and for a while after SQLite refused a write."""
    state = services(request).status.readiness()
    return json_response({"status": state}, status=200 if state == "ok" else 503)


ROUTES = [
    Route("GET", "/health", health, "Liveness", response=Health),
    Route("GET", "/ready", ready, "Readiness: 503 until models are loaded, while draining, while a device "
          "worker is stuck, and for 30 s after the database refused a write", response=Health, errors=(503,),
          error_body=Health),
]
