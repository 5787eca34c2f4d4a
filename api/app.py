"""The aiohttp application factory: routes, middlewares, request ids, OpenAPI."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from pathlib import Path

import structlog
from aiohttp import web

from api import batch, conversations, health, models, ws
from api import streams as stream_api
from api.admin import dashboard, profiling
from api.admin import deployments as deployments_api
from api.admin import tenants as admin
from api.auth import AUTH, TENANT_ADMIN, auth_middleware
from api.context import (
    ADMISSION,
    BATCH,
    DATABASE,
    ENCODERS,
    HUB,
    INFERENCE,
    METRICS,
    RESPONSE_CACHE,
    ROUTER,
    SHADOWS,
    STATE,
    ServerState,
)
from api.errors import CLIENT_CLOSED, client_gone, error_middleware, json_response
from api.metrics import METRICS_ACCESS, MetricsAccess, metrics_endpoint
from api.native import encoders as encoders_api
from api.native import generate as native
from api.openai import chat as chat_api
from api.openai import completions as completions_api
from api.openai import embeddings as embeddings_api
from api.openai import models as models_api
from api.openapi import build_spec
from api.response_cache import add_cache_header
from api.routes import Route
from api.webhooks import webhook_client
from scheduling.deployments import DeploymentsConfig
from scheduling.router import Router
from services.batch.runner import BatchConfig, BatchRunner
from services.cache.responses import ResponseCache, ResponseCacheConfig
from services.conversations import Conversations
from services.deployments import manager as lifecycle
from services.deployments.shadow import ShadowMirror
from services.errors import SHUTTING_DOWN
from services.inference.admission import Admission
from services.inference.encoders import Encoders
from services.inference.generation import Inference
from services.observability.alerts import DEFAULT_ALERTS, AlertRule
from services.observability.metrics import Metrics, StorageCollector
from services.observability.telemetry import ObservabilityConfig, TracingConfig
from services.streams.hub import StreamHub, StreamsConfig
from services.tenancy import Auth, TenantAdmin, TenantDirectory
from storage.batches import BatchStore
from storage.conversations import ConversationStore
from storage.db import Database
from storage.registry import RegistryStore
from storage.streams import StreamStore
from storage.tenants import TenantStore

log = structlog.get_logger(__name__)

VERSION = "0.1.0"
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
    """SIGTERM: /ready turns 503, new work is refused (503 + Retry-After, `ModelManager.refuse_if_draining`),
    idle WebSockets close; in-flight requests go on."""
    app[STATE].draining = True
    ws.close_idle_sockets(app)


async def interrupt(app: web.Application) -> None:
    """The drain's time is up: end what is left, each client with a final error. Batch items and
    streams are left unfinished in SQLite (checkpointed), so a restart resumes them."""
    await app[BATCH].close()
    await app[HUB].close()  # producers checkpoint; followers send `server_shutting_down` and end
    app[ROUTER].fail_all("the server shut down before this request finished; retry it", SHUTTING_DOWN)


def all_routes() -> list[Route]:
    return [*health.ROUTES, *models_api.ROUTES, *chat_api.ROUTES, *completions_api.ROUTES, *stream_api.ROUTES,
            *admin.ROUTES, *conversations.ROUTES, *ws.ROUTES, *batch.ROUTES, *native.ROUTES, *embeddings_api.ROUTES,
            *encoders_api.ROUTES, *deployments_api.ROUTES, *dashboard.ROUTES, *profiling.ROUTES]


def temporary_database(app: web.Application) -> Database:
    """For callers with no data dir (tests): a throwaway database, closed and removed at cleanup."""
    folder = Path(tempfile.mkdtemp(prefix="galley-"))
    db = Database(folder / "galley.db")

    async def remove(app: web.Application) -> None:
        db.close()
        shutil.rmtree(folder, ignore_errors=True)

    app.on_cleanup.append(remove)
    return db


async def run_stream_sweeper(app: web.Application):
    """Expire finished streams in the background; on shutdown stop the stream producers."""
    sweeper = asyncio.get_running_loop().create_task(app[HUB].run_sweeper())
    yield
    sweeper.cancel()
    await app[HUB].close()


def create_app(router: Router, state: ServerState | None = None, *, db: Database | None = None,
               auth_enabled: bool = False, admin_key_hash: str | None = None,
               streams_config: StreamsConfig | None = None,
               batch_config: BatchConfig | None = None,
               response_cache: ResponseCacheConfig | None = None, loader: lifecycle.Loader | None = None,
               lifecycle_config: lifecycle.LifecycleConfig | None = None,
               deployments_config: DeploymentsConfig | None = None,
               observability: ObservabilityConfig | None = None, tracing: TracingConfig | None = None,
               alerts: tuple[AlertRule, ...] = DEFAULT_ALERTS, span_exporter=None,
               bind_host: str = "127.0.0.1") -> web.Application:
    """The app; `db` stays open after cleanup (its owner closes it). No admin key: the admin API refuses all.
    `bind_host` is where the server listens: beyond loopback with auth on, /metrics needs a token.

    Without a `loader` only the models already in `router` are served (the registry cannot load more)."""
    app = web.Application(middlewares=[request_context, error_middleware, auth_middleware],
                          client_max_size=MAX_BODY_BYTES)
    app[DATABASE] = db if db is not None else temporary_database(app)
    tenant_store = TenantStore(app[DATABASE])
    app[AUTH] = Auth(auth_enabled, TenantDirectory.load(tenant_store), admin_key_hash)
    app[TENANT_ADMIN] = TenantAdmin(tenant_store, app[AUTH].directory)
    app[ROUTER] = router
    app[STATE] = state or ServerState(ready=True)
    observability = observability or ObservabilityConfig()
    app[METRICS] = Metrics(router)
    app[ADMISSION] = Admission(router, app[METRICS])
    app[METRICS_ACCESS] = MetricsAccess.for_bind(auth_enabled, bind_host, observability.metrics_token)
    app[METRICS].registry.register(StorageCollector(app[DATABASE]))
    dashboard.setup(app, observability, tracing or TracingConfig(), alerts, span_exporter)
    app[RESPONSE_CACHE] = ResponseCache(response_cache or ResponseCacheConfig(), app[METRICS], app[ADMISSION])
    app.on_response_prepare.append(add_cache_header)
    registry_store = RegistryStore(app[DATABASE])
    manager = lifecycle.ModelManager(router, registry_store, app[METRICS].registry, loader, lifecycle_config,
                                     deployments_config, app[STATE])
    models.setup(app, manager, ShadowMirror(manager, app[ADMISSION], registry_store, app[METRICS].registry))
    app[conversations.CONVERSATIONS] = Conversations(ConversationStore(app[DATABASE]), manager, router.admission)
    app[ENCODERS] = Encoders(app[RESPONSE_CACHE], app[ADMISSION], app[SHADOWS], app[METRICS])
    app[HUB] = StreamHub(router, StreamStore(app[DATABASE]), app[METRICS], streams_config or StreamsConfig(), app[AUTH])
    app[INFERENCE] = Inference(router, app[ADMISSION], app[METRICS], app[HUB], app[SHADOWS],
                               app[conversations.CONVERSATIONS], app[RESPONSE_CACHE])
    app.cleanup_ctx.append(run_stream_sweeper)
    tenants = lambda name: app[AUTH].directory.tenants.get(name)  # noqa: E731
    # batch items route like requests (by the job id): a cold or unloaded version loads again
    batch_config = batch_config or BatchConfig()
    batch.setup(app, BatchRunner(router, app[ADMISSION], manager, BatchStore(app[DATABASE]), app[METRICS], tenants,
                                 app[STATE], webhook_client(batch_config), batch_config))
    ws.setup(app)
    routes = all_routes()
    for route in routes:
        app.router.add_route(route.method, route.path, route.handler)
    spec = build_spec(routes, "galley", VERSION, auth_enabled)

    async def openapi(request: web.Request) -> web.Response:
        return json_response(spec)

    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
