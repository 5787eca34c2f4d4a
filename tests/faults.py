"""Fault injection for tests: a model runner (or an encoder handle) that works for the warm-up,
then fails every step (every submit), and `FaultyLoader`, an `EngineLoader` that builds the
versions a test names that way.

A tiny model can so play a broken canary (weights that load and warm up but raise at runtime)
in the auto-rollback tests: failure handling is tested on the real engine path, and production
has no switch that breaks a model.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.engine import LLMEngine
from engine.loader import LoadedModel
from engine.model_runner import ModelRunner
from engine.types import ScheduledBatch
from launch import EngineLoader
from scheduling.encoders import ServedEncoder
from storage.registry import ModelVersion


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
            raise InjectedFault("injected fault (tests/faults.py)")
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
        future.set_exception(InjectedFault("injected fault (tests/faults.py)"))
        return future


@dataclass
class FaultyLoader(EngineLoader):
    """Loads as EngineLoader does; the versions in `faulty` (`name@version`) warm up, then every
    engine step (an encoder: every submit) raises."""

    faulty: set[str] = field(default_factory=set)

    def new_engine(self, spec: ModelVersion, loaded: LoadedModel) -> LLMEngine:
        engine = super().new_engine(spec, loaded)
        if spec.ref in self.faulty:
            engine.runner = FaultyRunner(engine.runner)
        return engine

    def _load_encoder(self, spec: ModelVersion) -> ServedEncoder:
        served = super()._load_encoder(spec)
        if spec.ref in self.faulty:
            served.handle = FaultyEncoderHandle(served.handle)
        return served
