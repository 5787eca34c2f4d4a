"""Changing a model's traffic split: an operator's new split or deploy, a rollback (the operator's,
or the automatic one a failing canary starts), and the history of those changes.

Each change is saved through the `RegistryStore` (with its deployment event), then applied to
the router's `ModelDeployment`; SQLite is written first, memory follows what was saved. A
version that gets traffic and is not ready starts loading; a new stable version that is not
ready yet loads first while the old one serves, and the split switches once it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from scheduling.router import ModelDeployment, Router
from services.background import BackgroundTasks
from services.deployments.canary import Canaries
from services.deployments.catalog import LifecycleMetrics, registered_version
from services.deployments.loading import LoadFailed, Loading, VersionState
from services.errors import ConflictError, InvalidRequestError, ModelNotFoundError
from storage import registry
from storage.registry import Deployment, RegistryStore

log = structlog.get_logger(__name__)


class TrafficSplits:
    """The deployments of the versions in `versions` (the manager's registry view, shared)."""

    def __init__(self, router: Router, store: RegistryStore, versions: dict[str, VersionState], loading: Loading,
                 canaries: Canaries, metrics: LifecycleMetrics, background: BackgroundTasks,
                 load_in_background: Callable[[VersionState], None]) -> None:
        self.router = router
        self.store = store
        self.versions = versions
        self.loading = loading
        self.canaries = canaries
        self.metrics = metrics
        self._background = background
        self.load_in_background = load_in_background  # the manager's: a cold (or failed) version starts loading
        self.previous_stable: dict[str, str | None] = {}  # model name -> what a rollback returns to

    def apply(self, d: Deployment) -> None:
        """A stored deployment (restored, or just saved) becomes the router's."""
        current = self.router.deployments.get(d.model_name)
        if current is None:
            current = self.router.deployments[d.model_name] = ModelDeployment(d.model_name, d.traffic,
                                                                               d.stable_version)
        current.traffic, current.stable = dict(d.traffic), d.stable_version
        current.num_registered = sum(v.spec.name == d.model_name for v in self.versions.values())
        self.previous_stable[d.model_name] = d.previous_stable_version

    def deployment(self, name: str) -> tuple[ModelDeployment, str | None]:
        """A model's live deployment and its previous stable version; a 404 for a model without one."""
        deployment = self.router.deployments.get(name)
        if deployment is None:
            raise ModelNotFoundError(f"The model `{name}` has no deployment.", param="model_name")
        return deployment, self.previous_stable.get(name)

    async def update_traffic(self, name: str, traffic: dict[str, int]) -> None:
        """An operator's new split: unknown models and versions are 404s before the split's sum is judged."""
        self.deployment(name)
        for version in traffic:
            registered_version(self.versions, name, version)
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
            registered_version(self.versions, name, version)
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
        self.apply(saved)
        log.info("deployment changed", model=new.model_name, kind=kind, traffic=new.traffic,
                 stable=new.stable_version, reason=reason)

    async def deploy(self, name: str, version: str, percent: int) -> None:
        """`percent` of the traffic to `version` beside the stable one (a canary); 100, or the stable
        version itself, makes it the stable version with all of the traffic."""
        deployment, _ = self.deployment(name)
        registered_version(self.versions, name, version)
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
        """The latest split changes (of `name`, or of every model), newest first."""
        return await asyncio.to_thread(self.store.events, name, limit)
