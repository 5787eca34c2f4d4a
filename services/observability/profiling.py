"""Torch profiler traces of one device worker's engine steps, one recording at a time."""

from __future__ import annotations

import asyncio
from typing import Any

from scheduling.router import Router
from services.errors import ConflictError, NotFoundError, NotImplementedFeatureError


class Profiler:
    def __init__(self, router: Router, max_seconds: float) -> None:
        self.router = router
        self.max_seconds = max_seconds
        self._lock = asyncio.Lock()

    def workers_by_device(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for model in self.router.served_models():
            for replica in model.replicas:
                out.setdefault(replica.device, replica.worker)
        return out

    async def record(self, seconds: float, device: str | None = None) -> tuple[str, bytes]:
        """(device, Chrome-trace JSON) of `device`'s worker (default: the first) over `seconds`,
        at most `max_seconds`."""
        seconds = min(seconds, self.max_seconds)
        workers = self.workers_by_device()
        device = device or next(iter(workers), None)
        worker = workers.get(device) if device else None
        if worker is None:
            raise NotFoundError(f"no device worker {device!r}; loaded: {sorted(workers)}", param="device")
        if not hasattr(worker, "profile"):
            raise NotImplementedFeatureError(f"the worker of {device!r} cannot record a profile")
        if self._lock.locked():
            raise ConflictError("a profile is already being recorded; try again when it ends", code="profile_running")
        async with self._lock:
            return device, await asyncio.wrap_future(worker.profile(seconds))
