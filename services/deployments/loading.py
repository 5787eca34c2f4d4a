"""Loading and unloading model versions, one at a time (`_lock`, so the memory budget is counted
exactly): weights load off the loop through an injected `Loader` (launch.py's `EngineLoader`:
services never import torch); a version becomes routable only after it answered a warm-up (one
token, or one input through an encoder's batcher); one being unloaded drains first (routing
skips it, in-flight requests or inputs finish) and only then is detached from its workers or its
batcher stopped. Under a per-device memory budget, least recently used unpinned versions are
unloaded to make room.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import structlog

from engine.types import FinishReason, GenerationRequest, SamplingParams
from scheduling.encoders import ServedEncoder
from scheduling.rollout import parse_model_ref
from scheduling.router import Router, Served, ServedModel
from services.background import BackgroundTasks
from services.deployments.offload import in_fresh_thread
from services.errors import ServiceUnavailableError
from storage.registry import ModelVersion, RegistryStore

if TYPE_CHECKING:
    from services.deployments.manager import LifecycleMetrics

log = structlog.get_logger(__name__)

GIB = 1024**3
WARMUP_PREFIX = "warmup-"


@dataclass(frozen=True)
class LifecycleConfig:
    memory_budget_gib: float = 0.0  # per device: weights + KV cache of loaded versions; 0: no budget
    load_timeout_seconds: float = 300.0  # a request waiting for a cold model gets 503 after this
    check_interval_seconds: float = 1.0  # how often idle versions (keep_alive) are looked for


class Loader(Protocol):
    def registration_problem(self, spec: ModelVersion) -> str | None: ...  # blocking: call from a thread
    def devices_for(self, spec: ModelVersion) -> list[str]: ...
    def device_names(self, spec: ModelVersion) -> list[str]: ...
    def estimate_bytes(self, spec: ModelVersion) -> int: ...
    def load(self, spec: ModelVersion, on_progress: Callable[[str, float], None] | None = None) -> Served: ...
    def load_adapter(self, spec: ModelVersion, base: ServedModel) -> ServedModel: ...
    def unload(self, served: Served) -> None: ...


class LoadFailed(Exception):
    pass


def load_failed(ref: str) -> ServiceUnavailableError:
    """The client's error for a version that failed to load: the loader's text (paths, stack
    details) is for the logs and the admin API only."""
    return ServiceUnavailableError(f"`{ref}` failed to load; the admin API has the details",
                                   code="model_load_failed")


@dataclass
class VersionState:
    """One registered version at runtime (the stored `ModelVersion` plus what only the running
    process knows: load state, devices, memory, idle clock). Invariant: `served` (routing's handle
    on it) is set exactly while attached to workers."""

    spec: ModelVersion
    state: str = "unloaded"
    error: str | None = None
    load_phase: str | None = None  # while loading (and after): what the last load was doing, set from its thread
    load_progress: float | None = None  # that load's fraction done, 0..1
    served: Served | None = None
    devices: list[str] = field(default_factory=list)
    mem_bytes: int = 0
    last_used_s: float = field(default_factory=time.monotonic)
    loading: asyncio.Task | None = None
    num_waiters: int = 0  # requests waiting for it to load: it is not evicted before they submit

    @property
    def ref(self) -> str:
        return self.spec.ref

    @property
    def keep_alive_s(self) -> float:
        return float(self.spec.options.get("keep_alive", 0))

    @property
    def base(self) -> str | None:
        """A LoRA adapter's base (`name` or `name@version`, as registered); None for a model with weights."""
        return self.spec.options.get("base")


class Loading:
    """Loads and unloads the versions in `versions` (the manager's registry view, shared)."""

    def __init__(self, router: Router, store: RegistryStore, loader: Loader | None, cfg: LifecycleConfig,
                 versions: dict[str, VersionState], metrics: LifecycleMetrics, background: BackgroundTasks) -> None:
        self.router = router
        self.store = store
        self.loader = loader
        self.cfg = cfg
        self.versions = versions
        self.metrics = metrics
        self._background = background
        self._lock = asyncio.Lock()

    def task(self, vs: VersionState) -> asyncio.Task:
        """`vs` loading (and warming up) in the background: the running task, or a new one."""
        if vs.loading is None or vs.loading.done():
            vs.loading = self._background.spawn(self._load(vs))
        return vs.loading

    async def _load(self, vs: VersionState) -> Served:
        base = await self._load_base(vs) if vs.base else None  # before the lock, which the base's load takes
        async with self._lock:
            if vs.served is not None and not vs.served.draining:
                return vs.served
            if vs.served is not None:  # draining: let it finish unloading before loading anew
                await self._unload_locked(vs, "reload")
            return await self._load_locked(vs, base)

    async def _load_base(self, vs: VersionState) -> VersionState:
        """An adapter's base version, loaded: the one it names, else its model's stable version now."""
        name, version = parse_model_ref(vs.base)
        deployment = self.router.deployments.get(name)
        version = version or (deployment.stable if deployment is not None else None)
        base = self.versions.get(f"{name}@{version}")
        if base is None or base.base:
            self.set_state(vs, "failed", f"its base `{vs.base}` is not a registered model with weights")
            raise LoadFailed(vs.error)
        try:
            await self.task(base)
        except LoadFailed as exc:
            self.set_state(vs, "failed", f"its base `{base.ref}` failed to load: {exc}")
            raise LoadFailed(vs.error) from exc
        return base

    async def _load_locked(self, vs: VersionState, base: VersionState | None = None) -> Served:
        started = time.monotonic()
        served = None
        try:
            if base is not None:  # a LoRA adapter, onto its base's engines
                if base.served is None or base.served.draining:
                    raise RuntimeError(f"its base `{base.ref}` was unloaded while it waited to load")
                vs.devices = base.devices
                self.set_state(vs, "loading")
                served = await in_fresh_thread(self.loader.load_adapter, vs.spec, base.served)
            else:
                vs.devices = self.loader.devices_for(vs.spec)
                await self._make_room(vs)
                self.set_state(vs, "loading")
                served = await in_fresh_thread(self.loader.load, vs.spec, partial(self._on_progress, vs))
            vs.load_phase = "warming up"
            await self._warm_up(served)
        except Exception as exc:
            if served is not None:
                await in_fresh_thread(self.loader.unload, served)
            self.set_state(vs, "failed", f"{type(exc).__name__}: {exc}")
            log.error("model version failed to load", model=vs.ref, error=vs.error)
            raise LoadFailed(vs.error) from exc
        vs.served, vs.mem_bytes, vs.last_used_s = served, self.loader.estimate_bytes(vs.spec), time.monotonic()
        self.router.add_model(served)
        vs.load_phase = "ready"
        self.set_state(vs, "ready")
        load_s = time.monotonic() - started
        self.metrics.load_seconds.labels(vs.spec.name).observe(load_s)
        log.info("model version ready", model=vs.ref, load_s=round(load_s, 2), devices=vs.devices,
                 mem_bytes=vs.mem_bytes)
        return served

    @staticmethod
    def _on_progress(vs: VersionState, phase: str, fraction: float) -> None:
        """Called on the loading thread: two plain attribute writes the loop reads when it renders."""
        vs.load_phase, vs.load_progress = phase, fraction

    async def _warm_up(self, served: Served) -> None:
        """One token through the real engine path, or one input through the encoder's real batcher,
        before the version gets any traffic (not counted in its health)."""
        if isinstance(served, ServedEncoder):
            future = served.handle.submit([served.warmup if served.warmup is not None else "Hello"])
            async with asyncio.timeout(self.cfg.load_timeout_seconds):  # not wait_for: see metrics.observe
                outputs = await asyncio.wrap_future(future)
            if len(outputs) != 1:
                raise RuntimeError(f"warm-up failed: {len(outputs)} outputs for 1 input")
            return
        prompt = served.tokenizer.encode("Hello", add_special_tokens=False)[:4] or [0]
        request = GenerationRequest(WARMUP_PREFIX + uuid.uuid4().hex, prompt,
                                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                    tenant="galley-warmup")
        last = None
        async for event in self.router.submit(served, request):
            last = event
        if last is None or last.finish_reason == FinishReason.ERROR:
            raise RuntimeError(f"warm-up failed: {last.error if last else 'no event'}")

    async def _unload_locked(self, vs: VersionState, reason: str) -> None:
        served = vs.served
        if served is None:
            return
        for adapter in self.adapters_on(vs):  # they run on its engines: they go first, each drained
            await self._unload_locked(adapter, reason)
        served.draining = True
        while served.num_in_flight:
            await asyncio.sleep(0.02)
        self.router.remove_model(served)
        await in_fresh_thread(self.loader.unload, served)
        vs.served, vs.mem_bytes = None, 0
        self.set_state(vs, "unloaded")
        self.metrics.unloads.labels(vs.spec.name, reason).inc()
        log.info("model version unloaded", model=vs.ref, reason=reason)

    async def unload(self, vs: VersionState, reason: str) -> None:
        async with self._lock:
            await self._unload_locked(vs, reason)

    def adapters_on(self, base: VersionState) -> list[VersionState]:
        """The loaded LoRA adapters running over `base`'s engines."""
        return [v for v in self.versions.values()
                if v.served is not None and base.served is not None and getattr(v.served, "base", "") == base.ref
                and v.served is not base.served]

    def _used_bytes(self, device: str, exclude: VersionState) -> int:
        return sum(v.mem_bytes for v in self.versions.values()
                   if v is not exclude and v.served is not None and device in v.devices)

    def fits(self, vs: VersionState) -> bool:
        budget = self.cfg.memory_budget_gib * GIB
        if not budget or self.loader is None:
            return True
        need = self.loader.estimate_bytes(vs.spec)
        return all(self._used_bytes(d, vs) + need <= budget for d in self.loader.devices_for(vs.spec))

    async def _make_room(self, vs: VersionState) -> None:
        """Under the budget, unload least recently used unpinned versions until `vs` fits."""
        budget = self.cfg.memory_budget_gib * GIB
        if not budget:
            return
        need = self.loader.estimate_bytes(vs.spec)
        for device in vs.devices:
            while self._used_bytes(device, vs) + need > budget:
                victims = [v for v in self.versions.values() if v is not vs and v.served is not None
                           and device in v.devices and not v.spec.pinned]
                if not victims:
                    raise MemoryError(f"{vs.ref} needs {need} bytes on {device}: over the memory budget "
                                      f"({self.cfg.memory_budget_gib:g} GiB) with only pinned models left")
                free = [v for v in victims if not v.num_waiters]
                if not free:  # its callers are about to submit: let them, then it drains
                    await asyncio.sleep(0.005)
                    continue
                await self._unload_locked(min(free, key=lambda v: v.last_used_s), "memory_budget")

    def set_state(self, vs: VersionState, state: str, error: str | None = None) -> None:
        vs.state, vs.error = state, error
        if state == "loading":
            vs.load_phase, vs.load_progress = "starting", 0.0
        elif state == "unloaded":
            vs.load_phase = vs.load_progress = None
        name, version = vs.spec.name, vs.spec.version
        write = self.store.set_state(name, version, state, error)
        write.add_done_callback(lambda f: f.exception() and log.error(  # memory (authoritative) is right
            "could not store a model version's state", model=vs.ref, state=state, error=repr(f.exception())))
