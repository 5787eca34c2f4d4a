"""The aiohttp application factory: routes, middlewares, request ids, OpenAPI."""

from __future__ import annotations

import asyncio
import random
import time

import structlog
from aiohttp import web

from api import batch, conversations, health, oip, rerank, tokenize, ws
from api import streams as stream_api
from api.admin import dashboard, profiling
from api.admin import deployments as deployments_api
from api.admin import tenants as admin
from api.auth import add_notes_headers, auth_middleware
from api.errors import CLIENT_CLOSED, client_gone, error_middleware, json_response
from api.metrics import METRICS_ACCESS, MetricsAccess, metrics_endpoint
from api.native import encoders as encoders_api
from api.native import generate as native
from api.openai import chat as chat_api
from api.openai import completions as completions_api
from api.openai import embeddings as embeddings_api
from api.openai import models as models_api
from api.openai import responses_api
from api.openapi import build_spec
from api.routes import VERSION, Route
from api.services import SERVICES
from api.webhooks import webhook_client
from services.wiring import Services, Settings, build_services

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024


def new_request_id() -> str:
    """32 hex digits, like uuid4().hex but without its getrandom syscall: a request id names a
    request in logs and routing, it is no secret, and under load each syscall on the event loop
    is a point where it loses its core to the worker's threads (cProfile in the embeddings bench:
    0.14 ms wall per uuid4)."""
    return f"{random.getrandbits(128):032x}"


@web.middleware
async def request_context(request: web.Request, handler):
    request_id = request.headers.get("X-Request-Id") or new_request_id()
    request["request_id"] = request_id
    started = time.monotonic()
    structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        if client_gone(request):  # aiohttp cancelled the handler of a client that left: a normal end
            log_request(request, started, CLIENT_CLOSED)
        raise
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    if not response.prepared:
        response.headers.setdefault("X-Request-Id", request_id)
    log_request(request, started, response.status)
    return response


def log_request(request: web.Request, started: float, status: int) -> None:
    log.info("request", request_id=request["request_id"], method=request.method, path=request.path, status=status,
             duration_s=round(time.monotonic() - started, 4))


def begin_drain(app: web.Application) -> None:
    """SIGTERM: /ready turns 503, new work is refused (503 + Retry-After), idle WebSockets close;
    in-flight requests go on."""
    app[SERVICES].begin_drain()
    ws.close_idle_sockets(app)


async def interrupt(app: web.Application) -> None:
    """The drain's time is up: what is left ends with a final error each, checkpointed to resume."""
    await app[SERVICES].interrupt()


def all_routes() -> list[Route]:
    return [*health.ROUTES, *models_api.ROUTES, *chat_api.ROUTES, *completions_api.ROUTES, *stream_api.ROUTES,
            *admin.ROUTES, *conversations.ROUTES, *ws.ROUTES, *batch.ROUTES, *native.ROUTES, *embeddings_api.ROUTES,
            *encoders_api.ROUTES, *deployments_api.ROUTES, *dashboard.ROUTES, *profiling.ROUTES,
            *tokenize.ROUTES, *responses_api.ROUTES, *rerank.ROUTES, *oip.ROUTES]


async def run_services(app: web.Application):
    """Start the services' background work with the app; stop it at cleanup, or at once when
    starting failed part way (nothing started is left running)."""
    try:
        await app[SERVICES].start()
    except BaseException:
        await app[SERVICES].close()
        raise
    yield
    await app[SERVICES].close()


def create_app(router, state=None, *, db=None, settings: Settings | None = None, loader=None,
               span_exporter=None) -> web.Application:
    """The app over `router` (a `scheduling.router.Router`) with services built by
    `services.wiring.build_services` (see there for `state`, `db` and `loader`)."""
    settings = settings or Settings()
    services = build_services(router, webhook_client(settings.batch), settings=settings, state=state, db=db,
                              loader=loader, span_exporter=span_exporter)
    return serve_services(services)


def serve_services(services: Services) -> web.Application:
    """Routes, middlewares and response hooks over built services."""
    app = web.Application(middlewares=[request_context, error_middleware, auth_middleware],
                          client_max_size=MAX_BODY_BYTES)
    app[SERVICES] = services
    settings = services.settings
    app[METRICS_ACCESS] = MetricsAccess.for_bind(settings.auth_enabled, settings.bind_host,
                                                 settings.observability.metrics_token)
    app.cleanup_ctx.append(run_services)
    app.on_response_prepare.append(add_notes_headers)
    dashboard.setup(app)
    ws.setup(app)
    routes = all_routes()
    for route in routes:
        app.router.add_route(route.method, route.path, route.handler)
    spec = build_spec(routes, "galley", VERSION, settings.auth_enabled)

    async def openapi(request: web.Request) -> web.Response:
        return json_response(spec)

    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
