"""The composition of the services: one `Services` object built from the router, the database
and the settings, started and closed as one. `server.py` and the tests build it through
`api.app.create_app`; handlers reach a service as `services(request).<name>`.

This module (with server.py) is where the layers meet: it builds the stores (storage), hands
them and the router (scheduling) to the services, and orders their background loops.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from scheduling.rollout import DeploymentsConfig
from scheduling.router import Router
from services.admission import Admission
from services.batch.jobs import BatchConfig
from services.batch.runner import BatchRunner
from services.batch.webhooks import WebhookClient
from services.cache.response_cache import ResponseCache, ResponseCacheConfig
from services.conversations import Conversations
from services.deployments.loading import LifecycleConfig, Loader
from services.deployments.manager import ModelManager
from services.deployments.shadow import ShadowMirror
from services.errors import SHUTTING_DOWN
from services.inference.encoders import Encoders
from services.inference.generation import Inference
from services.observability.alerts import DEFAULT_ALERTS, AlertManager, AlertRule, MetricsWindow
from services.observability.metrics import Metrics, StorageCollector
from services.observability.profiling import Profiler
from services.observability.status import ServerStatus
from services.observability.telemetry import (
    ObservabilityConfig,
    RecentRequests,
    Tracing,
    TracingConfig,
    build_tracing,
    log_request,
)
from services.server_state import ServerState
from services.streams.hub import StreamHub, StreamsConfig
from services.tenancy import Auth, TenantAdmin, TenantDirectory
from storage.batches import BatchStore
from storage.conversations import ConversationStore
from storage.db import Database
from storage.registry import RegistryStore
from storage.streams import StreamStore
from storage.tenants import TenantStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Settings:
    """What the services are configured with (the config file's sections, or a test's choice)."""

    auth_enabled: bool = False
    admin_key_hash: str | None = None  # None: the admin API refuses every key
    bind_host: str = "127.0.0.1"  # beyond loopback with auth on, /metrics needs a token
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    response_cache: ResponseCacheConfig = field(default_factory=ResponseCacheConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    deployments: DeploymentsConfig = field(default_factory=DeploymentsConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    alerts: tuple[AlertRule, ...] = DEFAULT_ALERTS


@dataclass
class Services:
    """Every service of one server, by the name handlers use."""

    settings: Settings
    router: Router
    state: ServerState
    db: Database
    auth: Auth
    tenants: TenantAdmin
    metrics: Metrics
    admission: Admission
    cache: ResponseCache
    models: ModelManager
    shadows: ShadowMirror
    conversations: Conversations
    encoders: Encoders
    streams: StreamHub
    inference: Inference
    batch: BatchRunner
    recent: RecentRequests
    alerts: AlertManager
    tracing: Tracing | None
    profiler: Profiler
    status: ServerStatus
    _loops: dict[str, asyncio.Task] = field(default_factory=dict)
    _temporary: Path | None = None  # a throwaway database's folder, removed at close

    async def start(self) -> None:
        """The background loops: alerts, shadows and the lifecycle (keep-alive, canary), stream
        expiry, batch expiry."""
        loop = asyncio.get_running_loop()
        self._loops["alerts"] = loop.create_task(self.alerts.run(self.settings.observability.alert_interval_seconds))
        await self.shadows.restore()
        self._loops["lifecycle"] = loop.create_task(self.models.run())
        self._loops["sweeper"] = loop.create_task(self.streams.run_sweeper())
        self.batch.start_expiry()

    async def close(self) -> None:
        """Stop what `start` started, in reverse: batch items and streams checkpoint, then shadows
        and models, then the alerts; a throwaway database goes last. Every step runs even when one
        before it failed (the first failure is raised at the end)."""
        failures: list[BaseException] = []
        for step in (self.batch.close, self._stop_streams, self.shadows.close, self._stop_models, self._stop_alerts,
                     self._remove_temporary):
            try:
                await step()
            except Exception as exc:  # noqa: BLE001 - logged, the rest still stops
                log.exception("stopping a service failed", step=step.__name__)
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _stop_streams(self) -> None:
        self._stop("sweeper")
        await self.streams.close()

    async def _stop_models(self) -> None:
        self._stop("lifecycle")
        await self.models.close()

    async def _stop_alerts(self) -> None:
        self._stop("alerts")
        if self.tracing is not None:
            self.tracing.shutdown()

    async def _remove_temporary(self) -> None:
        if self._temporary is not None:
            self.db.close()
            shutil.rmtree(self._temporary, ignore_errors=True)

    def _stop(self, loop_name: str) -> None:
        task = self._loops.pop(loop_name, None)
        if task is not None:
            task.cancel()

    def begin_drain(self) -> None:
        """SIGTERM: /ready turns 503 and new work is refused (`ModelManager.refuse_if_draining`)."""
        self.state.draining = True

    async def interrupt(self) -> None:
        """The drain's time is up: end what is left, each client with a final error. Batch items and
        streams are left unfinished in SQLite (checkpointed), so a restart resumes them."""
        await self.batch.close()
        await self.streams.close()  # producers checkpoint; followers send `server_shutting_down` and end
        self.router.fail_all("the server shut down before this request finished; retry it", SHUTTING_DOWN)


def build_services(router: Router, webhooks: WebhookClient, *, settings: Settings | None = None,
                   state: ServerState | None = None, db: Database | None = None, loader: Loader | None = None,
                   span_exporter: Any = None) -> Services:
    """The services over `router`; `db` stays open at close (its owner closes it), and without one
    a throwaway database is used. Without a `loader` only the models already in `router` are
    served (the registry cannot load more)."""
    settings = settings or Settings()
    temporary = None
    if db is None:
        temporary = Path(tempfile.mkdtemp(prefix="galley-"))
        db = Database(temporary / "galley.db")
    state = state or ServerState(ready=True)
    obs = settings.observability
    tenant_store, registry = TenantStore(db), RegistryStore(db)
    auth = Auth(settings.auth_enabled, TenantDirectory.load(tenant_store), settings.admin_key_hash)
    metrics = Metrics(router)
    metrics.registry.register(StorageCollector(db))
    metrics.log_prompts = obs.log_prompts
    recent = RecentRequests(obs.recent_requests)
    tracing = build_tracing(settings.tracing, span_exporter)
    metrics.sinks += [log_request, recent, *([tracing] if tracing is not None else [])]
    keep_s = max([obs.stats_window_seconds, *(r.window_seconds for r in settings.alerts)])
    alerts = AlertManager(settings.alerts, MetricsWindow(metrics.registry, keep_s + obs.alert_interval_seconds))
    admission = Admission(router, metrics)
    cache = ResponseCache(settings.response_cache, metrics, admission)
    models = ModelManager(router, registry, metrics.registry, loader, settings.lifecycle, settings.deployments, state)
    shadows = ShadowMirror(models, admission, registry, metrics.registry)
    conversations = Conversations(ConversationStore(db), models, admission)
    streams = StreamHub(router, StreamStore(db), metrics, settings.streams, auth)
    # batch items route like requests (by the job id): a cold or unloaded version loads again
    batch = BatchRunner(router, admission, models, BatchStore(db), metrics,
                        lambda name: auth.directory.tenants.get(name), state, webhooks, settings.batch)
    return Services(
        settings=settings, router=router, state=state, db=db, auth=auth,
        tenants=TenantAdmin(tenant_store, auth.directory), metrics=metrics, admission=admission, cache=cache,
        models=models, shadows=shadows, conversations=conversations,
        encoders=Encoders(cache, admission, shadows, metrics), streams=streams,
        inference=Inference(router, models, admission, metrics, streams, shadows, conversations, cache), batch=batch,
        recent=recent, alerts=alerts, tracing=tracing, profiler=Profiler(router, obs.max_profile_seconds),
        status=ServerStatus(state, router, db, metrics.registry, alerts, obs.stats_window_seconds,
                            settings.auth_enabled),
        _temporary=temporary,
    )
