"""Served encoder models (kinds `embed` and `classify`) and tensor models (`onnx`, `tabular`) as the API
sees them, torch-free.

An encoder has no KV cache and no engine step: its handle (wired in by launch.py) takes a
list of inputs and returns a `concurrent.futures.Future` of one output per input (`.values`,
`.num_tokens`). `submit` bounds how many inputs may wait per model, so overload is refused
at once instead of queueing without end, and counts inputs in flight until their future
finishes, so a version being unloaded drains before its handle stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol


class EncoderHandle(Protocol):
    def submit(self, items: list[Any], low: bool = False) -> Future: ...

    @property
    def stats(self) -> Any: ...  # engine.batcher.BatcherStats: num_batches, num_items, batch_sizes


class EncoderBusy(Exception):
    def __init__(self, model: str, limit: int) -> None:
        super().__init__(f"model {model!r} has {limit} inputs waiting, its limit")
        self.model = model
        self.limit = limit


@dataclass
class ServedEncoder:
    """An embedding or classification model version: what validation and responses need, and its handle."""

    name: str
    kind: str  # embed | classify
    handle: EncoderHandle
    dimensions: int  # hidden size: the embedding length
    max_seq_len: int  # inputs are truncated to this many tokens
    vocab_size: int
    labels: list[str] = field(default_factory=list)  # classify: label by output index (config id2label)
    multi_label: bool = False  # classify: sigmoid per label instead of softmax
    score_activation: str = "sigmoid"  # a cross-encoder (classify, one label): sigmoid | identity of its logit
    # tensor models (onnx, tabular): their inputs and outputs ({"name", "datatype", "shape"}, -1: any size),
    # the runtime (Triton's platform names), and one request of zeros to warm up with
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    platform: str = ""
    warmup: Any = None
    max_waiting: int = 1024  # inputs submitted and not yet answered; beyond it 429
    version: str = "1"
    created: int = 0
    mem_bytes: int = 0  # weights, measured after loading
    num_in_flight: int = 0  # inputs whose future has not finished; touched only on the event loop
    draining: bool = False  # being unloaded: in-flight inputs finish, new requests go elsewhere

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


# (model, ok, latency_s) for each finished submit, on the event loop: canary health, idle clocks
OnEncoderFinish = Callable[[ServedEncoder, bool, float], None]


def submit(model: ServedEncoder, items: list[Any], on_finish: OnEncoderFinish | None = None,
           low: bool = False) -> asyncio.Future:
    """Hand inputs to the model's handle, or raise `EncoderBusy` changing nothing. Call on the event loop.

    Returns a future on the running loop, settled in the one loop callback that also drops
    `num_in_flight` (when the handle finishes, not when a caller stops waiting) and calls
    `on_finish`. Cancelling it (a caller that leaves) does not cancel the inputs: a version
    being drained still waits for them. `low` inputs (batch jobs, shadow copies) only fill the
    room that interactive requests leave in a batch."""
    if model.num_in_flight + len(items) > model.max_waiting and model.num_in_flight:
        raise EncoderBusy(model.name, model.max_waiting)
    loop, started = asyncio.get_running_loop(), time.monotonic()
    result = loop.create_future()
    future = model.handle.submit(items, low)
    model.num_in_flight += len(items)

    def settle(done: Future) -> None:
        model.num_in_flight -= len(items)
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if on_finish is not None:
            on_finish(model, error is None, time.monotonic() - started)
        if result.done():  # its caller stopped waiting
            return
        if error is None:
            result.set_result(done.result())
        else:
            result.set_exception(error)

    def finished(done: Future) -> None:  # on the handle's thread
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: nobody is counting
            loop.call_soon_threadsafe(settle, done)

    future.add_done_callback(finished)
    return result
