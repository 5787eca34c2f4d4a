"""Served encoder models (kinds `embed` and `classify`) as the API sees them, torch-free.

An encoder has no KV cache and no engine step: its handle (a dynamic batcher thread,
wired in by launch.py) takes a list of inputs and returns a `concurrent.futures.Future` of
one output per input (`.values`, `.num_tokens`). The registry bounds how many inputs may
wait per model, so overload is refused at once instead of queueing without end.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol


class EncoderHandle(Protocol):
    def submit(self, items: list[Any]) -> Future: ...

    @property
    def stats(self) -> Any: ...  # engine.batcher.BatcherStats: num_batches, num_items, batch_sizes


class EncoderBusy(Exception):
    def __init__(self, model: str, limit: int) -> None:
        super().__init__(f"model {model!r} has {limit} inputs waiting, its limit")
        self.model = model
        self.limit = limit


@dataclass
class ServedEncoder:
    """An embedding or classification model: what validation and responses need, and its handle."""

    name: str
    kind: str  # embed | classify
    handle: EncoderHandle
    dimensions: int  # hidden size: the embedding length
    max_seq_len: int  # inputs are truncated to this many tokens
    vocab_size: int
    labels: list[str] = field(default_factory=list)  # classify: label by output index (config id2label)
    multi_label: bool = False  # classify: sigmoid per label instead of softmax
    max_waiting: int = 1024  # inputs submitted and not yet answered; beyond it 429
    version: str = "1"
    created: int = 0
    num_in_flight: int = 0  # inputs; touched only on the event loop


@dataclass
class EncoderRegistry:
    models: dict[str, ServedEncoder] = field(default_factory=dict)

    def add(self, model: ServedEncoder) -> None:
        self.models[model.name] = model

    def submit(self, model: ServedEncoder, items: list[Any]) -> Future:
        """Hand inputs to the model's batcher, or raise `EncoderBusy` changing nothing.

        The caller calls `done(model, len(items))` once the future is finished or abandoned."""
        if model.num_in_flight + len(items) > model.max_waiting and model.num_in_flight:
            raise EncoderBusy(model.name, model.max_waiting)
        model.num_in_flight += len(items)
        return model.handle.submit(items)

    def done(self, model: ServedEncoder, num_items: int) -> None:
        model.num_in_flight -= num_items
