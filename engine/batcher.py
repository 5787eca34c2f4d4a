"""Dynamic batching for models without a KV cache (encoders), driven by the device worker.

Callers on any thread submit a list of inputs through the worker (`engine.worker.EncoderClient`)
and get a `concurrent.futures.Future` of the list of outputs (`scheduling.encoders.submit`
turns it into an event-loop future). The worker thread hands each request to `add`, and whenever `due`
(`max_batch` inputs waiting, a preferred batch size can be filled, or the oldest has waited
`max_wait_ms`) calls `run_once`: ONE call of `run_batch` over the oldest inputs (interactive
requests first; `low` ones, batch jobs and shadow copies, fill the room left), whose outputs are
split back to their requests. Preferred sizes work as Triton's `preferred_batch_size`: the largest
one the waiting inputs fill runs at once; when the wait expires, whatever is waiting runs.
A request larger than `max_batch` is cut into several batches. There is no thread here: the
encoders of a device run on that device's worker thread, between engine steps, because a
second long-lived thread running torch ops makes libgomp throttle both threads' OpenMP teams
(more team threads than CPUs). Torch-free: the forward comes in as a callable.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

RunBatch = Callable[[list[Any]], list[Any]]


@dataclass(frozen=True)
class Batching:
    """A model's batching options (`max_batch`, `max_wait_ms` or Triton's `max_queue_delay_microseconds`,
    `preferred_batch_size`)."""

    max_batch: int = 32
    max_wait_ms: float = 5.0
    preferred: tuple[int, ...] = ()

    def batcher(self, name: str, run_batch: RunBatch) -> DynamicBatcher:
        return DynamicBatcher(name, run_batch, self.max_batch, self.max_wait_ms, self.preferred)


@dataclass
class BatcherStats:
    """Counters read by metrics at scrape time (replaced whole, so a reader sees one consistent copy)."""

    num_batches: int = 0
    num_items: int = 0
    num_requests: int = 0
    num_failed_batches: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> batches of that size
    busy_s: float = 0.0  # seconds spent running batches on the device (its share beside engine steps)


class Pending:
    """One submitted request: its outputs fill in as its items' batches finish."""

    def __init__(self, items: list[Any], low: bool = False) -> None:
        self.items = items
        self.low = low  # batch jobs and shadow copies: they fill what room interactive requests leave
        self.outputs: list[Any] = [None] * len(items)
        self.remaining = len(items)
        self.future: Future = Future()
        self.arrival_s = time.monotonic()


@dataclass
class _Slice:
    pending: Pending
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class DynamicBatcher:
    """Invariant: every added request's future completes exactly once (result or exception).
    All methods but `stats` run on the owning worker's thread."""

    def __init__(self, name: str, run_batch: RunBatch, max_batch: int, max_wait_ms: float,
                 preferred: tuple[int, ...] = ()) -> None:
        if max_batch < 1 or max_wait_ms < 0 or any(not 1 <= size <= max_batch for size in preferred):
            raise ValueError("max_batch must be >= 1, max_wait_ms >= 0 and preferred sizes in 1..max_batch")
        self.name = name
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.preferred = tuple(sorted(set(preferred), reverse=True))  # largest first
        self.stats = BatcherStats()
        self.item_s: float | None = None  # moving average of a batch's seconds per input
        self._waiting: collections.deque[_Slice] = collections.deque()  # interactive requests, oldest first
        self._low: collections.deque[_Slice] = collections.deque()  # `low` requests, oldest first
        self._num_waiting = 0  # inputs in both

    def add(self, pending: Pending) -> None:
        line = self._low if pending.low else self._waiting
        for start in range(0, len(pending.items), self.max_batch):
            piece = _Slice(pending, start, min(start + self.max_batch, len(pending.items)))
            line.append(piece)
            self._num_waiting += piece.size

    def deadline(self) -> float | None:
        """When a batch is due (monotonic seconds): now if full, else when the oldest input's wait
        ends; None with nothing waiting."""
        oldest = [line[0].pending.arrival_s for line in (self._waiting, self._low) if line]
        if not oldest:
            return None
        if self._num_waiting >= self.max_batch or self._preferred_size(self._num_waiting):
            return 0.0
        return min(oldest) + self.max_wait_s

    def due(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and deadline <= now

    def run_once(self, limit: int | None = None) -> None:
        """Run one batch of the oldest inputs: up to `max_batch`, or `limit` (see `items_for`); before
        the oldest input's wait expires, the largest preferred size that fits."""
        limit = min(limit or self.max_batch, self.max_batch)
        oldest = [line[0].pending.arrival_s for line in (self._waiting, self._low) if line]
        if oldest and time.monotonic() < min(oldest) + self.max_wait_s:
            limit = self._preferred_size(min(limit, self._num_waiting)) or limit
        batch = self._take_batch(limit)
        if batch:
            self._run_one(batch)

    def _preferred_size(self, available: int) -> int | None:
        """The largest preferred batch size at most `available`, or None."""
        return next((size for size in self.preferred if size <= available), None)

    def items_for(self, seconds: float) -> int:
        """How many inputs one batch may take to run for about `seconds` (at least one), by the
        measured time per input; one before anything was measured."""
        if self.item_s is None:
            return 1
        return max(1, min(self.max_batch, int(seconds / self.item_s)))

    def fail_all(self, exc: BaseException) -> None:
        for line in (self._waiting, self._low):
            while line:
                self._fail(line.popleft().pending, exc)
        self._num_waiting = 0

    def _take_batch(self, limit: int) -> list[_Slice]:
        """Up to `limit` inputs: interactive requests oldest first, then `low` ones in the room
        left; whole requests where they fit (a request that does not fit an empty batch is cut);
        requests already done (cancelled, failed) are dropped."""
        batch: list[_Slice] = []
        size = 0
        for line in (self._waiting, self._low):
            while line and size < limit:
                piece = line[0]
                if piece.pending.future.done():
                    line.popleft()
                    self._num_waiting -= piece.size
                    continue
                if size + piece.size > limit:
                    if batch:
                        break
                    piece = _Slice(piece.pending, piece.start, piece.start + limit)
                    line[0].start += limit  # the rest stays first in line
                else:
                    line.popleft()
                self._num_waiting -= piece.size
                size += piece.size
                batch.append(piece)
        return batch

    def _run_one(self, batch: list[_Slice]) -> None:
        inputs = [item for s in batch for item in s.pending.items[s.start:s.stop]]
        started = time.perf_counter()
        try:
            outputs = self.run_batch(inputs)
            if len(outputs) != len(inputs):
                raise RuntimeError(f"run_batch returned {len(outputs)} outputs for {len(inputs)} inputs")
        except Exception as exc:
            log.exception("encoder batch failed", model=self.name, batch_size=len(inputs))
            self._record(len(inputs), True, time.perf_counter() - started)
            for s in batch:
                self._fail(s.pending, exc)
            return
        self._record(len(inputs), False, time.perf_counter() - started)
        item_s = (time.perf_counter() - started) / len(inputs)
        self.item_s = item_s if self.item_s is None else 0.8 * self.item_s + 0.2 * item_s
        offset = 0
        for s in batch:
            s.pending.outputs[s.start:s.stop] = outputs[offset:offset + s.size]
            offset += s.size
            s.pending.remaining -= s.size
            if s.pending.remaining == 0:
                self._record_request()
                with contextlib.suppress(InvalidStateError):  # cancelled by its caller meanwhile
                    s.pending.future.set_result(s.pending.outputs)

    def _fail(self, pending: Pending, exc: BaseException) -> None:
        with contextlib.suppress(InvalidStateError):
            pending.future.set_exception(exc)

    def _record(self, size: int, failed: bool, seconds: float) -> None:
        old = self.stats
        sizes = dict(old.batch_sizes)
        sizes[size] = sizes.get(size, 0) + 1
        self.stats = BatcherStats(old.num_batches + 1, old.num_items + size, old.num_requests,
                                  old.num_failed_batches + failed, sizes, old.busy_s + seconds)

    def _record_request(self) -> None:
        self.stats = dataclasses.replace(self.stats, num_requests=self.stats.num_requests + 1)
