"""Dynamic batching for models without a KV cache (encoders): one thread per model.

Callers on any thread `submit` a list of inputs and get a `concurrent.futures.Future` of
the list of outputs (the event loop awaits it with `asyncio.wrap_future`, which hands the
result back through `call_soon_threadsafe`). The thread collects inputs across requests
until `max_batch` are waiting or the oldest has waited `max_wait_ms`, runs ONE call of
`run_batch` over them, and splits the outputs back to their requests. A request larger
than `max_batch` is cut into several batches. Torch-free: the forward comes in as a callable.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

RunBatch = Callable[[list[Any]], list[Any]]


@dataclass
class BatcherStats:
    """Counters read by metrics at scrape time (replaced whole, so a reader sees one consistent copy)."""

    num_batches: int = 0
    num_items: int = 0
    num_requests: int = 0
    num_failed_batches: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> batches of that size


class _Pending:
    """One submitted request: its outputs fill in as its items' batches finish."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.outputs: list[Any] = [None] * len(items)
        self.remaining = len(items)
        self.future: Future = Future()
        self.arrival_s = time.monotonic()


@dataclass
class _Slice:
    pending: _Pending
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


_STOP = object()


class DynamicBatcher:
    """Invariant: every submitted request's future completes exactly once (result or exception)."""

    def __init__(self, name: str, run_batch: RunBatch, max_batch: int, max_wait_ms: float) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        self.name = name
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.stats = BatcherStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[_Slice] = collections.deque()
        self._num_waiting = 0
        self._thread = threading.Thread(target=self._run, name=f"galley-encoder-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, items: list[Any]) -> Future:
        pending = _Pending(list(items))
        if not pending.items:
            pending.future.set_result([])
        else:
            self._inbox.put(pending)
        return pending.future

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if not self._collect():
                self._fail_waiting(RuntimeError(f"encoder {self.name!r} stopped"))
                return
            batch = self._take_batch()
            if batch:
                self._run_one(batch)

    def _collect(self) -> bool:
        """Take everything already queued; then wait for work, until a full batch or the oldest
        input's deadline. False on stop."""
        while self._num_waiting < self.max_batch:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                return False
            self._add(item)
        while True:
            if self._num_waiting >= self.max_batch:
                return True
            if self._waiting:
                timeout = self._waiting[0].pending.arrival_s + self.max_wait_s - time.monotonic()
                if timeout <= 0:
                    return True
            else:
                timeout = None
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            self._add(item)

    def _add(self, pending: _Pending) -> None:
        for start in range(0, len(pending.items), self.max_batch):
            piece = _Slice(pending, start, min(start + self.max_batch, len(pending.items)))
            self._waiting.append(piece)
            self._num_waiting += piece.size

    def _take_batch(self) -> list[_Slice]:
        """Oldest first, up to max_batch inputs; requests already done (cancelled, failed) are dropped."""
        batch: list[_Slice] = []
        size = 0
        while self._waiting and (not batch or size + self._waiting[0].size <= self.max_batch):
            piece = self._waiting.popleft()
            self._num_waiting -= piece.size
            if not piece.pending.future.done():
                size += piece.size
                batch.append(piece)
        return batch

    def _run_one(self, batch: list[_Slice]) -> None:
        inputs = [item for s in batch for item in s.pending.items[s.start:s.stop]]
        try:
            outputs = self.run_batch(inputs)
            if len(outputs) != len(inputs):
                raise RuntimeError(f"run_batch returned {len(outputs)} outputs for {len(inputs)} inputs")
        except Exception as exc:
            log.exception("encoder batch failed", model=self.name, batch_size=len(inputs))
            self._record(len(inputs), failed=True)
            for s in batch:
                self._fail(s.pending, exc)
            return
        self._record(len(inputs), failed=False)
        offset = 0
        for s in batch:
            s.pending.outputs[s.start:s.stop] = outputs[offset:offset + s.size]
            offset += s.size
            s.pending.remaining -= s.size
            if s.pending.remaining == 0:
                self._record_request()
                with contextlib.suppress(InvalidStateError):  # cancelled by its caller meanwhile
                    s.pending.future.set_result(s.pending.outputs)

    def _fail(self, pending: _Pending, exc: BaseException) -> None:
        with contextlib.suppress(InvalidStateError):
            pending.future.set_exception(exc)

    def _fail_waiting(self, exc: BaseException) -> None:
        while self._waiting:
            self._fail(self._waiting.popleft().pending, exc)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._fail(item, exc)

    def _record(self, size: int, failed: bool) -> None:
        old = self.stats
        sizes = dict(old.batch_sizes)
        sizes[size] = sizes.get(size, 0) + 1
        self.stats = BatcherStats(old.num_batches + 1, old.num_items + size, old.num_requests,
                                  old.num_failed_batches + failed, sizes)

    def _record_request(self) -> None:
        old = self.stats
        self.stats = BatcherStats(old.num_batches, old.num_items, old.num_requests + 1,
                                  old.num_failed_batches, old.batch_sizes)
