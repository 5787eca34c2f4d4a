"""Model lifecycle on the event loop: the registry's versions and routing a request to a version.
`ModelManager` is what the rest of galley calls; it composes the parts that each do one job:
loading and unloading (warm-up, drain, memory budget) in loading.py, traffic splits and
rollbacks in traffic.py, idle clocks, canary outcomes and idle unloading in activity.py, canary
judging in canary.py, and the read views (kinds, model cards, states, metrics) in catalog.py.

Versions are generative (`ServedModel`: engines on the device workers) or encoders
(`ServedEncoder`: embed/classify behind a batcher handle); both go through the same
registry, routing, warm-up, drain, health and memory budget.

`ModelManager` owns the in-memory view of the registry (SQLite is written through the
`RegistryStore` after each change; memory is authoritative while the process runs) and the
router's deployments.

`route` is the one lookup every endpoint makes for a caller (tenant checks, kind, routing, a
cold version loading); the HTTP side (api/versions.py) wraps it and adds the `X-Model-Version`
header.

A model has several types along its way, each for one stage:
- `config.ModelSpec`: a `[[models]]` entry of config.toml, before the registry sees it.
- `storage.registry.ModelVersion`: a registered version as stored (name, version, source,
  kind, options); `storage.registry.Deployment`: a model name's stored traffic split.
- `VersionState` (loading.py): a registered version at runtime: its load state, devices, memory,
  idle clock and, while loaded, its `Served` handle.
- `engine.loader.LoadedModel`: what the loader builds on the device (weights, tokenizer).
- `scheduling.router.ServedModel` / `ServedEncoder` (`Served`): a loaded version as routing
  sees it (replicas or batcher, limits); `ModelDeployment`: a model name as routing sees
  it (the live split and the loaded versions).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from scheduling.encoders import ServedEncoder
from scheduling.rollout import DeploymentsConfig, HealthWindow, parse_model_ref
from scheduling.router import ModelDeployment, Router, Served
from services.background import BackgroundTasks
from services.deployments.activity import SHADOW_PREFIX, Activity
from services.deployments.canary import Canaries
from services.deployments.catalog import (
    LifecycleMetrics,
    kind_of,
    model_cards,
    registered_version,
    version_states,
)
from services.deployments.loading import (
    LifecycleConfig,
    Loader,
    LoadFailed,
    Loading,
    VersionState,
    load_failed,
)
from services.deployments.offload import in_fresh_thread
from services.deployments.options import check_options
from services.deployments.resources import Resources, check_amounts
from services.deployments.traffic import TrafficSplits
from services.errors import (
    DRAINING_RETRY_AFTER_S,
    ConflictError,
    InvalidRequestError,
    ModelNotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from services.server_state import ServerState
from services.tenancy import Caller
from storage import registry
from storage.registry import ModelVersion, RegistryStore

log = structlog.get_logger(__name__)

# other modules import these from here (some live in activity.py, loading.py, catalog.py)
__all__ = ["SHADOW_PREFIX", "LifecycleConfig", "LifecycleMetrics", "ModelManager", "Served"]


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
        self.metrics = LifecycleMetrics(metrics_registry, router, self.versions)
        self._background = BackgroundTasks()
        self.loading = Loading(router, store, loader, self.cfg, self.versions, self.metrics, self._background)
        self.canaries = Canaries(router, self.deploy_cfg, lambda name, reason: self.rollback(name, reason, True),
                                 self._background)
        self.traffic = TrafficSplits(router, store, self.versions, self.loading, self.canaries, self.metrics,
                                     self._background, self.load_in_background)
        self.activity = Activity(router, self.versions, self.loading, self.canaries, self.cfg, self._background)

    # ---- startup ------------------------------------------------------------------------

    async def start(self, seed: list[ModelVersion] = ()) -> None:
        """Register the config's models, restore deployments, load what takes traffic.

        A seeded (config) version that fails to load raises LoadFailed: the server cannot start."""
        versions, deployments = await asyncio.wrap_future(self.store.restore(seed, "config"))
        for spec in versions:
            self.versions[spec.ref] = VersionState(spec, spec.state, spec.error)
        for d in deployments:
            self.traffic.apply(d)
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
        self.activity.touch(served)

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

    # ---- health and idleness (activity.py) ----------------------------------------------

    @property
    def health(self) -> dict[str, HealthWindow]:
        """name@version -> its recent outcomes (the canary window)."""
        return self.canaries.health

    async def run(self) -> None:
        """Background: unload idle versions past their keep_alive; re-judge canaries (activity.py)."""
        await self.activity.run()

    # ---- registering --------------------------------------------------------------------

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
        if "base" in spec.options:
            self._check_base(spec)
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
            self.traffic.apply(deployment)
        self.router.deployments[spec.name].num_registered = sum(
            v.spec.name == spec.name for v in self.versions.values())
        if spec.pinned:
            self._warm_in_background(spec.ref)
        return vs

    def _check_base(self, spec: ModelVersion) -> None:
        """An adapter's base must be a registered generate model (or version) that is not itself an adapter."""
        base = spec.options["base"]
        name, version = parse_model_ref(base)
        bases = [vs.spec for vs in self.versions.values()
                 if vs.spec.name == name and version in (None, vs.spec.version)]
        if not bases:
            raise InvalidRequestError(f"base: `{base}` is not a registered model", param="base", code="base_not_found")
        if bases[0].kind != "generate" or any("base" in b.options for b in bases):
            raise InvalidRequestError(f"base: `{base}` is not a generate model of its own (an adapter's base is "
                                      "a model with weights)", param="base", code="base_not_a_model")

    # ---- what the registry holds (catalog.py) -------------------------------------------

    def kind(self, name: str) -> str | None:
        """A model name's kind: from the registry, else from a loaded version (attached without the registry)."""
        return kind_of(self.router, self.versions, name)

    def catalog(self) -> list[dict[str, Any]]:
        """Every model name, registered or attached, as an OpenAI model card: loaded or not (`ready`)."""
        return model_cards(self.router, self.versions)

    def states(self) -> list[tuple[str, str, str]]:
        """(name, version, state) per version, attached ones (tests) `ready`."""
        return version_states(self.router, self.versions)

    def names(self) -> list[str]:
        """Every model name with a deployment (registered or attached), sorted."""
        return sorted(self.router.deployments)

    def get(self, name: str, version: str) -> VersionState:
        """The registered version `name@version`, else a 404."""
        return registered_version(self.versions, name, version)

    def load_in_background(self, vs: VersionState) -> None:
        if vs.state == "failed":
            vs.state = "unloaded"
        self._warm_in_background(vs.ref)

    def unload_in_background(self, vs: VersionState) -> None:
        self._background.spawn(self.loading.unload(vs, "admin"))

    # ---- traffic splits (traffic.py) ----------------------------------------------------

    def deployment(self, name: str) -> tuple[ModelDeployment, str | None]:
        """A model's live deployment and its previous stable version; a 404 for a model without one."""
        return self.traffic.deployment(name)

    async def update_traffic(self, name: str, traffic: dict[str, int]) -> None:
        """An operator's new split (see `TrafficSplits.update_traffic`)."""
        await self.traffic.update_traffic(name, traffic)

    async def deploy(self, name: str, version: str, percent: int, resources: Resources | None = None) -> None:
        """`percent` of `name`'s traffic to `version` (see `TrafficSplits.deploy`), on the `resources`
        asked for (`services.deployments.resources`): checked, and its replicas kept with the version."""
        if resources is not None:
            await self._place(self.get(name, version), resources)
        await self.traffic.deploy(name, version, percent)

    async def _place(self, vs: VersionState, resources: Resources) -> None:
        spec, replicas = vs.spec, resources.replicas
        if replicas is not None and (spec.kind != "generate" or "base" in spec.options) and replicas != 1:
            raise InvalidRequestError(f"resources.replicas: `{spec.ref}` runs on one device"
                                      + (" (its base's)" if "base" in spec.options else f" (a {spec.kind} model)"),
                                      param="resources.replicas", code="resources_unavailable")
        placed = spec
        if replicas is not None and spec.kind == "generate" and "base" not in spec.options:
            placed = dataclasses.replace(spec, options={**spec.options, "replicas": replicas})
        if self.loader is None:
            return
        problem = await asyncio.to_thread(self.loader.registration_problem, placed)
        if problem is not None:
            raise InvalidRequestError(f"resources: {problem}", param="resources.replicas" if replicas else "resources",
                                      code="resources_unavailable")
        devices = self.loader.device_names(placed)
        check_amounts(resources, spec.ref, devices, self.loader.estimate_bytes(placed), self.cfg.memory_budget_gib)
        if placed.options == spec.options:
            return
        if vs.served is not None or vs.state == "loading":
            raise ConflictError(f"`{spec.ref}` is loaded on {len(vs.devices)} replica(s); unload it to deploy it on "
                                f"{replicas}", param="resources.replicas", code="version_loaded")
        vs.spec = (await asyncio.wrap_future(self.store.set_options(spec.name, spec.version, placed.options)))

    async def rollback(self, name: str, reason: str | None = None, automatic: bool = False) -> bool:
        """Back to the stable (or previous stable) version (see `TrafficSplits.rollback`)."""
        return await self.traffic.rollback(name, reason, automatic)

    async def events(self, name: str | None = None, limit: int = 20) -> list[registry.DeploymentEvent]:
        return await self.traffic.events(name, limit)

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
