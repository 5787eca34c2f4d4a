"""Test-only fault injection: a model runner (or an encoder handle) that works for the warm-up,
then fails every step (every submit).

Selected by the registry option `fault = "raise"`, so a tiny model can play a broken canary
(weights that load and warm up but raise at runtime) in the auto-rollback tests. Never use it
in production: it exists so failure handling is tested on the real engine path.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from engine.model_runner import ModelRunner
from engine.types import ScheduledBatch


class InjectedFault(RuntimeError):
    pass


class FaultyRunner:
    """Delegates to `runner`; after `num_good_steps` steps, every `execute` raises."""

    def __init__(self, runner: ModelRunner, num_good_steps: int = 1) -> None:
        self.runner = runner
        self.num_good_steps = num_good_steps
        self.num_steps = 0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, batch: ScheduledBatch):
        self.num_steps += 1
        if self.num_steps > self.num_good_steps:
            raise InjectedFault("injected fault (test-only option fault='raise')")
        return self.runner.execute(batch)


class FaultyEncoderHandle:
    """Delegates to an encoder's handle; after `num_good_submits` submits (the warm-up), every
    submit's future fails, as if the encoder's forward raised."""

    def __init__(self, handle: Any, num_good_submits: int = 1) -> None:
        self.handle = handle
        self.num_good_submits = num_good_submits
        self.num_submits = 0

    def __getattr__(self, name: str):
        return getattr(self.handle, name)

    def submit(self, items: list[Any], low: bool = False) -> Future:
        self.num_submits += 1
        if self.num_submits <= self.num_good_submits:
            return self.handle.submit(items, low)
        future: Future = Future()
        future.set_exception(InjectedFault("injected fault (test-only option fault='raise')"))
        return future
