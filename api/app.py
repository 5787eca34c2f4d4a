"""The aiohttp application factory: routes, middlewares, request ids, OpenAPI."""

from __future__ import annotations

import time
import uuid

import structlog
from aiohttp import web

from api import health, openai
from api.context import ROUTER, STATE, ServerState
from api.errors import error_middleware, json_response
from api.metrics import METRICS, Metrics, metrics_endpoint
from api.openapi import build_spec
from api.routes import Route
from scheduling.router import Router

log = structlog.get_logger(__name__)

VERSION = "0.1.0"
MAX_BODY_BYTES = 8 * 1024 * 1024


@web.middleware
async def request_context(request: web.Request, handler):
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    request["request_id"] = request_id
    started = time.monotonic()
    structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        response = await handler(request)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    if not response.prepared:
        response.headers.setdefault("X-Request-Id", request_id)
    log.info("request", method=request.method, path=request.path, status=response.status,
             duration_s=round(time.monotonic() - started, 4))
    return response


def all_routes() -> list[Route]:
    return [*health.ROUTES, *openai.ROUTES]


def create_app(router: Router, state: ServerState | None = None) -> web.Application:
    app = web.Application(middlewares=[request_context, error_middleware], client_max_size=MAX_BODY_BYTES)
    app[ROUTER] = router
    app[STATE] = state or ServerState(ready=True)
    app[METRICS] = Metrics(router)
    routes = all_routes()
    for route in routes:
        app.router.add_route(route.method, route.path, route.handler)
    spec = build_spec(routes, "galley", VERSION)

    async def openapi(request: web.Request) -> web.Response:
        return json_response(spec)

    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
