"""Model lifecycle on the event loop: the registry's versions, routing a request to a version,
traffic splits and rollbacks, idle unloading. Loading and unloading (warm-up, drain, memory
budget) are in loading.py, canary judging in canary.py.

Versions are generative (`ServedModel`: engines on the device workers) or encoders
(`ServedEncoder`: embed/classify behind a batcher handle); both go through the same
registry, routing, warm-up, drain, health and memory budget.

`ModelManager` owns the in-memory view of the registry (SQLite is written through the
`RegistryStore` after each change; memory is authoritative while the process runs) and the
router's deployments.

`route` is the one lookup every endpoint makes for a caller (tenant checks, kind, routing, a
cold version loading); the HTTP side (api/models.py) wraps it and adds the `X-Model-Version`
header.

A model has several types along its way, each for one stage:
- `config.ModelSpec`: a `[[models]]` entry of config.toml, before the registry sees it.
- `storage.registry.ModelVersion`: a registered version as stored (name, version, source,
  kind, options); `storage.registry.Deployment`: a model name's stored traffic split.
- `VersionState` (here): a registered version at runtime: its load state, devices, memory,
  idle clock and, while loaded, its `Served` handle.
- `engine.loader.LoadedModel`: what the loader builds on the device (weights, tokenizer).
- `scheduling.router.ServedModel` / `ServedEncoder` (`Served`): a loaded version as routing
  sees it (replicas or batcher, limits); `ModelDeployment`: a model name as routing sees
  it (the live split and the loaded versions).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from engine.types import FinishReason, TokenEvent
from scheduling.encoders import ServedEncoder
from scheduling.rollout import DeploymentsConfig, HealthWindow, parse_model_ref
from scheduling.router import ModelDeployment, RequestStream, Router, Served, ServedModel
from services.background import BackgroundTasks
from services.deployments.canary import Canaries
from services.deployments.loading import (
    WARMUP_PREFIX,
    LifecycleConfig,
    Loader,
    LoadFailed,
    Loading,
    VersionState,
    load_failed,
)
from services.deployments.offload import in_fresh_thread
from services.deployments.options import check_options
from services.errors import (
    ConflictError,
    InvalidRequestError,
    ModelNotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from services.inference.params import model_defaults
from services.server_state import ServerState
from services.tenancy import Caller
from storage import registry
from storage.registry import Deployment, ModelVersion, RegistryStore

log = structlog.get_logger(__name__)

SHADOW_PREFIX = "shadow-"  # mirrored copies (shadow.py): they keep a version warm but judge nothing
DRAINING_RETRY_AFTER_S = 5  # a draining server's Retry-After: about a restart's time


class LifecycleMetrics:
    def __init__(self, registry_: CollectorRegistry, manager: ModelManager) -> None:
        self.load_seconds = Histogram("galley_model_load_seconds", "Time to load and warm up a model version",
                                      ["model"], buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                      registry=registry_)
        self.rollbacks = Counter("galley_rollbacks", "Deployments rolled back", ["model", "trigger"],
                                 registry=registry_)
        self.unloads = Counter("galley_model_unloads", "Model versions unloaded", ["model", "reason"],
                               registry=registry_)
        self.manager = manager
        registry_.register(self)

    def collect(self):
        """`galley_models_loaded{device}`, and `galley_model_state{model,version,state} 1` per version."""
        yield self.loaded()
        family = GaugeMetricFamily("galley_model_state", "1 for each model version's state "
                                   "(unloaded, loading, ready, failed)", labels=["model", "version", "state"])
        for name, version, state in self.manager.states():
            family.add_metric([name, version, state], 1)
        yield family

    def loaded(self) -> GaugeMetricFamily:
        loaded = GaugeMetricFamily("galley_models_loaded", "Model versions loaded, per device", labels=["device"])
        counts: dict[str, int] = {}
        for vs in self.manager.versions.values():
            for device in vs.devices if vs.served is not None else []:
                counts[device] = counts.get(device, 0) + 1
        for device, count in sorted(counts.items()):
            loaded.add_metric([device], count)
        return loaded


class ModelManager:
    def __init__(self, router: Router, store: RegistryStore, metrics_registry: CollectorRegistry,
                 loader: Loader | None = None, lifecycle: LifecycleConfig | None = None,
                 deployments: DeploymentsConfig | None = None, server: ServerState | None = None) -> None:
        self.router = router
        self.server = server or ServerState(ready=True)  # routing refuses new work while it drains
        self.store = store
        self.loader = loader
        self.cfg = lifecycle or LifecycleConfig()
        self.deploy_cfg = deployments or DeploymentsConfig()
        self.versions: dict[str, VersionState] = {}
        self.previous_stable: dict[str, str | None] = {}  # model name -> what a rollback returns to
        self.metrics = LifecycleMetrics(metrics_registry, self)
        self._background = BackgroundTasks()
        self.loading = Loading(router, store, loader, self.cfg, self.versions, self.metrics, self._background)
        self.canaries = Canaries(router, self.deploy_cfg, lambda name, reason: self.rollback(name, reason, True),
                                 self._background)
        router.finish_listeners.append(self.on_finish)
        router.encoder_finish_listeners.append(self.on_encoder_finish)

    # ---- startup ------------------------------------------------------------------------

    async def start(self, seed: list[ModelVersion] = ()) -> None:
        """Register the config's models, restore deployments, load what takes traffic.

        A seeded (config) version that fails to load raises LoadFailed: the server cannot start."""
        versions, deployments = await asyncio.wrap_future(self.store.restore(seed, "config"))
        for spec in versions:
            self.versions[spec.ref] = VersionState(spec, spec.state, spec.error)
        for d in deployments:
            self._apply_deployment(d)
        seeded = {s.ref for s in seed}
        wanted = [vs for vs in self.versions.values() if vs.state != "failed" and self._has_traffic(vs)]
        for vs in sorted(wanted, key=lambda v: (not v.spec.pinned, v.ref not in seeded)):
            if not self.loading.fits(vs):
                log.info("left cold: over the memory budget", model=vs.ref)
                continue
            try:
                await self.loading.task(vs)
            except LoadFailed:
                if vs.ref in seeded:
                    raise

    def _has_traffic(self, vs: VersionState) -> bool:
        """Loaded at start: pinned, or taking traffic unless it asked to load on its first request."""
        d = self.router.deployments.get(vs.spec.name)
        preload = vs.spec.options.get("preload", True)
        return d is not None and ((d.traffic.get(vs.spec.version, 0) > 0 and preload) or vs.spec.pinned)

    def _apply_deployment(self, d: Deployment) -> None:
        current = self.router.deployments.get(d.model_name)
        if current is None:
            current = self.router.deployments[d.model_name] = ModelDeployment(d.model_name, d.traffic,
                                                                               d.stable_version)
        current.traffic, current.stable = dict(d.traffic), d.stable_version
        current.num_registered = sum(v.spec.name == d.model_name for v in self.versions.values())
        self.previous_stable[d.model_name] = d.previous_stable_version

    # ---- routing ------------------------------------------------------------------------

    async def route(self, caller: Caller, ref: str, *, user: str | None = None, conversation_id: str | None = None,
                    pinned_version: str | None = None, kinds: tuple[str, ...] = ("generate",)) -> Served:
        """The one lookup for every endpoint: the served version for `ref` (`name` or `name@version`).

        Routing key: `user`, else the conversation, else the request id. An unknown model is a
        404 (503 while startup loading runs), then the tenant must be allowed it and an explicit
        version (403), then it must be of one of `kinds` (else 404: this endpoint has no such model),
        then a cold version loads."""
        self.refuse_if_draining()
        name, version = parse_model_ref(ref)
        deployment = self.router.deployments.get(name)
        if deployment is None:
            if not self.server.ready:
                raise ServiceUnavailableError("models are still loading", retry_after_s=5)
            raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model")
        caller.check_model(name)
        if version is not None and pinned_version is None:
            check_version_access(caller, deployment, version)
        kind = self.kind(name)
        if kind not in kinds:
            raise ModelNotFoundError(f"The model `{name}` is a `{kind}` model; this endpoint needs a "
                                     f"`{' or '.join(kinds)}` model.", param="model", code="wrong_model_kind")
        served = await self.resolve(ref, user or conversation_id or caller.request_id, pinned_version)
        self.refuse_if_draining()  # the drain may have begun while a cold version loaded
        caller.notes.model_version = served.ref
        return served

    def refuse_if_draining(self) -> None:
        """503 for new work once SIGTERM came (every generation, encoder input, batch job and
        conversation routes its model here): in-flight requests finish, new ones go elsewhere."""
        if self.server.draining:
            raise ServiceUnavailableError("the server is shutting down; retry shortly (or on another replica)",
                                          code="server_draining", retry_after_s=DRAINING_RETRY_AFTER_S)

    def label(self, served: Served) -> str:
        """The `model` field of responses: `name`, or `name@version` while the model has several versions."""
        return self.router.label(served)

    async def resolve(self, ref: str, key: str, pinned_version: str | None = None) -> Served:
        """The version that serves a request for `ref` (`name` or `name@version`).

        Pinned (a conversation's) version, else the explicit one, else the split by `key`. A
        canary that is not ready yet (or failed) leaves its share to the stable version; an
        explicit, pinned or stable version that is cold is loaded while the caller waits."""
        name, version = parse_model_ref(ref)
        version = pinned_version or version
        deployment = self.router.deployments.get(name)
        if deployment is None:
            raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model")
        explicit = version is not None
        version = version or deployment.choose(key)
        served = deployment.routable(version)
        if served is None and not explicit and version != deployment.stable:
            self._warm_in_background(f"{name}@{version}")
            version, served = deployment.stable, deployment.routable(deployment.stable)
        while served is None or served.draining:  # draining: unloaded (e.g. evicted) before this caller ran
            served = await self._wait_loaded(f"{name}@{version}")
        self.touch(served)
        return served  # the caller submits before its next await, so a drain counts the request

    def touch(self, served: Served) -> None:
        """`served` was just used: restart its idle (keep_alive) clock."""
        vs = self.versions.get(served.ref)
        if vs is not None:
            vs.last_used_s = time.monotonic()

    async def _wait_loaded(self, ref: str) -> Served:
        vs = self.versions.get(ref)
        if vs is None or self.loader is None:
            raise ModelNotFoundError(f"The model version `{ref}` does not exist.", param="model")
        if vs.state == "failed":
            raise load_failed(ref)
        vs.num_waiters += 1
        try:
            async with asyncio.timeout(self.cfg.load_timeout_seconds):  # not wait_for: see metrics.observe
                return await asyncio.shield(self.loading.task(vs))
        except TimeoutError:
            raise ServiceUnavailableError(f"`{ref}` is still loading; retry shortly", code="model_loading",
                                          retry_after_s=5) from None
        except LoadFailed:
            raise load_failed(ref) from None
        finally:
            vs.num_waiters -= 1

    def _warm_in_background(self, ref: str) -> None:
        vs = self.versions.get(ref)
        if vs is not None and vs.state == "unloaded" and self.loader is not None:
            self.loading.task(vs).add_done_callback(lambda t: t.cancelled() or t.exception())

    # ---- health and idleness ------------------------------------------------------------

    def on_finish(self, stream: RequestStream, event: TokenEvent) -> None:
        """Router hook: every finished request feeds its version's health window and idle clock
        (a shadow copy only the idle clock)."""
        if stream.request_id.startswith(SHADOW_PREFIX):
            self.touch(stream.model)
        elif not stream.request_id.startswith(WARMUP_PREFIX):
            self._record(stream.model, event.finish_reason != FinishReason.ERROR,
                         time.monotonic() - stream.request.arrival_s)

    def on_encoder_finish(self, served: ServedEncoder, ok: bool, latency_s: float) -> None:
        """Router hook: every finished encoder submit, likewise."""
        self._record(served, ok, latency_s)

    def _record(self, served: Served, ok: bool, latency_s: float) -> None:
        now = time.monotonic()
        if served.ref in self.versions:
            self.versions[served.ref].last_used_s = now
        self.canaries.record(served, ok, latency_s, now)

    @property
    def health(self) -> dict[str, HealthWindow]:
        """name@version -> its recent outcomes (the canary window)."""
        return self.canaries.health

    async def run(self) -> None:
        """Background: unload idle versions past their keep_alive; re-judge canaries."""
        while True:
            await asyncio.sleep(self.cfg.check_interval_seconds)
            now = time.monotonic()
            for vs in list(self.versions.values()):
                served = vs.served
                if (served is not None and not served.draining and not vs.spec.pinned and vs.keep_alive_s > 0
                        and served.num_in_flight == 0 and now - vs.last_used_s > vs.keep_alive_s):
                    self._background.spawn(self.loading.unload(vs, "keep_alive"))
            for name in list(self.router.deployments):
                self.canaries.check(name, force=True)

    # ---- registry and deployments -------------------------------------------------------

    async def register(self, name: str, version: str, source: str, kind: str = "generate",
                       options: dict[str, Any] | None = None) -> VersionState:
        """Add a version to the registry (the first of a name gets all its traffic); a pinned one loads."""
        try:
            options = check_options(options or {}, kind)
        except ValueError as exc:
            param, _, why = str(exc).partition(": ")
            raise InvalidRequestError(f"{param}: {why}", param=param) from exc
        spec = ModelVersion(name, version, source, kind, options)
        existing = self.kind(spec.name)
        if existing is not None and existing != spec.kind:  # routing treats all versions of a name alike
            raise ConflictError(f"`{spec.name}` is a `{existing}` model: its versions must all be `{existing}`.",
                                param="kind", code="kind_mismatch")
        if spec.ref in self.versions:
            raise ConflictError(f"`{spec.ref}` is already registered.", param="version", code="version_exists")
        problem = await asyncio.to_thread(self.loader.registration_problem, spec) if self.loader else None
        if problem is not None:  # refused now, not as a 503 on every request once it fails to load
            raise InvalidRequestError(f"cannot register `{spec.ref}`: {problem}", param="source",
                                      code="model_not_loadable")
        first = not any(v.spec.name == spec.name for v in self.versions.values())
        try:  # the first version of a name gets all of its traffic
            deployment = await asyncio.wrap_future(self.store.register(spec, "first version" if first else None))
        except registry.VersionExistsError as exc:
            raise ConflictError(f"`{spec.ref}` is already registered.", param="version",
                                code="version_exists") from exc
        vs = self.versions[spec.ref] = VersionState(spec)
        if deployment is not None:
            self._apply_deployment(deployment)
        self.router.deployments[spec.name].num_registered = sum(
            v.spec.name == spec.name for v in self.versions.values())
        if spec.pinned:
            self._warm_in_background(spec.ref)
        return vs

    def kind(self, name: str) -> str | None:
        """A model name's kind: from the registry, else from a loaded version (attached without the registry)."""
        registered = next((vs.spec.kind for vs in self.versions.values() if vs.spec.name == name), None)
        deployment = self.router.deployments.get(name)
        served = next(iter(deployment.versions.values()), None) if deployment is not None else None
        if registered is not None or served is None:
            return registered
        return served.kind if isinstance(served, ServedEncoder) else "generate"

    def catalog(self) -> list[dict[str, Any]]:
        """Every model name, registered or attached, as an OpenAI model card: loaded or not (`ready`)."""
        cards = []
        for name, deployment in sorted(self.router.deployments.items()):
            served = deployment.default
            limit = None if served is None else (
                served.max_seq_len if isinstance(served, ServedEncoder) else served.max_model_len)
            created = served.created if served is not None else self._registered_at(name)
            defaults = model_defaults(served) if isinstance(served, ServedModel) else None
            cards.append({"id": name, "object": "model", "created": created, "owned_by": "galley",
                          "kind": self.kind(name), "max_model_len": limit, "sampling_defaults": defaults,
                          "ready": served is not None})
        return cards

    def states(self) -> list[tuple[str, str, str]]:
        """(name, version, state) per version: the registry's, and `ready` for versions attached
        to the router without it (tests)."""
        states = {(vs.spec.name, vs.spec.version): vs.state for vs in self.versions.values()}
        for served in [*self.router.served_models(), *self.router.served_encoders()]:
            states.setdefault((served.name, served.version), "ready")
        return sorted((name, version, state) for (name, version), state in states.items())

    def _registered_at(self, name: str) -> int:
        stamps = [vs.spec.created_at for vs in self.versions.values() if vs.spec.name == name]
        return int(datetime.fromisoformat(min(stamps)).timestamp()) if stamps else 0

    def names(self) -> list[str]:
        """Every model name with a deployment (registered or attached), sorted."""
        return sorted(self.router.deployments)

    def get(self, name: str, version: str) -> VersionState:
        vs = self.versions.get(f"{name}@{version}")
        if vs is None:
            raise ModelNotFoundError(f"The model version `{name}@{version}` does not exist.", param="version")
        return vs

    def load_in_background(self, vs: VersionState) -> None:
        if vs.state == "failed":
            vs.state = "unloaded"
        self._warm_in_background(vs.ref)

    def unload_in_background(self, vs: VersionState) -> None:
        self._background.spawn(self.loading.unload(vs, "admin"))

    def deployment(self, name: str) -> tuple[ModelDeployment, str | None]:
        deployment = self.router.deployments.get(name)
        if deployment is None:
            raise ModelNotFoundError(f"The model `{name}` has no deployment.", param="model_name")
        return deployment, self.previous_stable.get(name)

    async def update_traffic(self, name: str, traffic: dict[str, int]) -> None:
        """An operator's new split: unknown models and versions are 404s before the split's sum is judged."""
        self.deployment(name)
        for version in traffic:
            self.get(name, version)
        try:
            registry.check_traffic(traffic)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="traffic") from exc
        await self.set_traffic(name, traffic, "traffic")

    async def set_traffic(self, name: str, traffic: dict[str, int], kind: str, reason: str | None = None,
                          stable: str | None = None) -> None:
        """Change a split; a new stable version that is not ready yet loads first (the old one serves)."""
        deployment, previous = self.deployment(name)
        for version in traffic:
            self.get(name, version)
        traffic = {v: p for v, p in traffic.items() if p > 0}
        if stable is None:
            stable = deployment.stable if deployment.stable in traffic else max(traffic, key=traffic.get)
        if stable != deployment.stable:
            previous = deployment.stable
        new = Deployment(name, traffic, stable, previous)
        for version in traffic:
            if self.versions[f"{name}@{version}"].state != "ready":
                self.load_in_background(self.versions[f"{name}@{version}"])
        target = self.versions[f"{name}@{stable}"]
        if stable != deployment.stable and target.state != "ready":
            self._background.spawn(self._switch_when_ready(target, new, kind, reason))
            return
        await self._save(new, kind, reason)

    async def _switch_when_ready(self, target: VersionState, new: Deployment, kind: str, reason: str | None) -> None:
        try:
            await self.loading.task(target)
        except LoadFailed:
            log.error("deployment not applied: its new stable version failed to load", model=target.ref)
            return
        await self._save(new, kind, reason)

    async def _save(self, new: Deployment, kind: str, reason: str | None) -> None:
        saved = await asyncio.wrap_future(self.store.save_deployment(new, kind, reason))
        self._apply_deployment(saved)
        log.info("deployment changed", model=new.model_name, kind=kind, traffic=new.traffic,
                 stable=new.stable_version, reason=reason)

    async def deploy(self, name: str, version: str, percent: int) -> None:
        deployment, _ = self.deployment(name)
        self.get(name, version)
        if version == deployment.stable or percent == 100:
            await self.set_traffic(name, {version: 100}, "deploy", stable=version)
        else:
            await self.set_traffic(name, {deployment.stable: 100 - percent, version: percent}, "deploy")

    async def rollback(self, name: str, reason: str | None = None, automatic: bool = False) -> bool:
        """All traffic to the stable version (dropping canaries), or, with none, back to the previous
        stable. Nothing to roll back: False for an automatic one, a ConflictError for an operator's."""
        deployment, previous = self.deployment(name)
        canaries = [v for v, p in deployment.traffic.items() if v != deployment.stable and p > 0]
        if canaries:
            target = deployment.stable
        elif previous is not None and f"{name}@{previous}" in self.versions and not automatic:
            target = previous
        elif automatic:
            return False
        else:
            raise ConflictError(f"`{name}` has no canary and no previous stable version to roll back to.",
                                param="model_name", code="nothing_to_roll_back")
        kind = "auto_rollback" if automatic else "rollback"
        await self.set_traffic(name, {target: 100}, kind, reason, stable=target)
        for canary in canaries:
            self.canaries.forget(f"{name}@{canary}")
        self.metrics.rollbacks.labels(name, "auto" if automatic else "manual").inc()
        log.warning("deployment rolled back", model=name, to=target, automatic=automatic, reason=reason)
        return True

    async def events(self, name: str | None = None, limit: int = 20) -> list[registry.DeploymentEvent]:
        return await asyncio.to_thread(self.store.events, name, limit)

    # ---- plumbing -----------------------------------------------------------------------

    async def close(self) -> None:
        """Stop loads and unloads; stop the encoders it loaded (engines go with their device workers)."""
        await self._background.cancel_all()
        for vs in self.versions.values():
            if isinstance(vs.served, ServedEncoder):
                await in_fresh_thread(self.loader.unload, vs.served)
                vs.served = None


def check_version_access(caller: Caller, deployment: ModelDeployment, version: str) -> None:
    """403 unless the split sends `version` traffic or the caller may name any version: auth is off
    (the local operator), or its tenant's allowed models list `name@version` (or `name@*`). Loading
    versions is the operator's call: a tenant that could name any one could load, and by alternating,
    thrash them all under the memory budget."""
    if deployment.traffic.get(version, 0) > 0 or not caller.auth_enabled:
        return
    granted = caller.tenant.allowed_models or ()
    if f"{deployment.name}@{version}" in granted or f"{deployment.name}@*" in granted:
        return
    raise PermissionDeniedError(
        f"`{deployment.name}@{version}` takes no traffic; naming such a version needs the admin's grant "
        f"(`{deployment.name}@{version}` among the key's allowed models).", param="model", code="version_not_allowed")
