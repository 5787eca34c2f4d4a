"""What finished requests tell the lifecycle, and the loop that acts on it: every finished request
(or encoder submit) restarts its version's idle clock and feeds its canary health window;
`run` unloads versions idle past their `keep_alive` and re-judges canaries on a timer.

Warm-up requests count for neither; shadow copies (`SHADOW_PREFIX`, shadow.py) keep a version
warm but judge nothing.
"""

from __future__ import annotations

import asyncio
import time

from engine.types import FinishReason, TokenEvent
from scheduling.encoders import ServedEncoder
from scheduling.router import RequestStream, Router, Served
from services.background import BackgroundTasks
from services.deployments.canary import Canaries
from services.deployments.loading import WARMUP_PREFIX, LifecycleConfig, Loading, VersionState

SHADOW_PREFIX = "shadow-"  # mirrored copies (shadow.py): they keep a version warm but judge nothing


class Activity:
    """The idle clocks of the versions in `versions` (the manager's registry view, shared) and the
    outcomes that `canaries` judge."""

    def __init__(self, router: Router, versions: dict[str, VersionState], loading: Loading, canaries: Canaries,
                 cfg: LifecycleConfig, background: BackgroundTasks) -> None:
        self.router = router
        self.versions = versions
        self.loading = loading
        self.canaries = canaries
        self.cfg = cfg
        self._background = background
        router.finish_listeners.append(self.on_finish)
        router.encoder_finish_listeners.append(self.on_encoder_finish)

    def touch(self, served: Served, now: float | None = None) -> None:
        """`served` was just used: restart its idle (keep_alive) clock, and a LoRA adapter's base's too."""
        now = now if now is not None else time.monotonic()
        for ref in (served.ref, getattr(served, "base", "")):
            if ref in self.versions:
                self.versions[ref].last_used_s = now

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
        self.touch(served, now)
        self.canaries.record(served, ok, latency_s, now)

    async def run(self) -> None:
        """Background: unload idle versions past their keep_alive; re-judge canaries."""
        while True:
            await asyncio.sleep(self.cfg.check_interval_seconds)
            now = time.monotonic()
            for vs in list(self.versions.values()):
                served = vs.served
                busy = served is not None and any(a.served.num_in_flight for a in self.loading.adapters_on(vs))
                if (served is not None and not served.draining and not vs.spec.pinned and vs.keep_alive_s > 0
                        and served.num_in_flight == 0 and not busy and now - vs.last_used_s > vs.keep_alive_s):
                    self._background.spawn(self.loading.unload(vs, "keep_alive"))
            for name in list(self.router.deployments):
                self.canaries.check(name, force=True)
