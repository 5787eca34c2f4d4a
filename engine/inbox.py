"""What other threads put in a device worker's inbox (`engine.worker.DeviceWorker`): requests and aborts,
encoder inputs, and commands, each of which the worker answers through its `done` future once applied
between two steps.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.batcher import DynamicBatcher, Pending
from engine.engine import LLMEngine
from engine.lora import PeftAdapter
from engine.types import GenerationRequest


@dataclass
class Add:
    engine_id: str
    request: GenerationRequest


@dataclass
class Abort:
    engine_id: str
    request_id: str


@dataclass
class Attach:
    engine_id: str
    engine: LLMEngine
    done: Future = field(default_factory=Future)


@dataclass
class Detach:
    engine_id: str
    done: Future = field(default_factory=Future)


@dataclass
class SetAdapter:
    """Load a LoRA adapter onto an engine (`adapter` set), or drop it (None)."""

    engine_id: str
    name: str
    adapter: PeftAdapter | None
    done: Future = field(default_factory=Future)


@dataclass
class AttachEncoder:
    encoder_id: str
    batcher: DynamicBatcher
    done: Future = field(default_factory=Future)


@dataclass
class DetachEncoder:
    encoder_id: str
    done: Future = field(default_factory=Future)


@dataclass
class Encode:
    encoder_id: str
    pending: Pending


@dataclass
class Profile:
    seconds: float
    done: Future = field(default_factory=Future)


STOP = object()
Command = Attach | Detach | SetAdapter | AttachEncoder | DetachEncoder | Profile
