"""One thread per device: drain the inbox, step every engine with work, publish events.

The only thread that touches engine, scheduler and KV state. Other threads talk to it
through `submit` / `abort` (a thread-safe inbox, drained before every step, so an abort
frees its blocks before the next step runs) and hear back through `emit`, which the
server wires to `loop.call_soon_threadsafe`. It never blocks on I/O. Engines come and go
while it runs (`attach` / `detach` are inbox commands too), so a model version loads and
unloads without stopping the others.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog

from engine.engine import LLMEngine
from engine.profiler import StepProfiler
from engine.types import EngineStats, GenerationRequest, TokenEvent

log = structlog.get_logger(__name__)

Emit = Callable[[list[TokenEvent]], None]


@dataclass
class _Add:
    engine_id: str
    request: GenerationRequest


@dataclass
class _Abort:
    engine_id: str
    request_id: str


@dataclass
class _Attach:
    engine_id: str
    engine: LLMEngine
    done: Future = field(default_factory=Future)


@dataclass
class _Detach:
    engine_id: str
    done: Future = field(default_factory=Future)


@dataclass
class _Profile:
    seconds: float
    done: Future = field(default_factory=Future)


_STOP = object()


class DeviceWorker:
    def __init__(self, device: str, emit: Emit) -> None:
        self.device = device
        self.emit = emit
        self.engines: dict[str, LLMEngine] = {}
        self.profiler = StepProfiler(device)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"galley-worker-{device}", daemon=True)

    def attach(self, engine_id: str, engine: LLMEngine) -> Future:
        """Add an engine; once the thread runs, through the inbox (done when the worker has it)."""
        command = _Attach(engine_id, engine)
        if self._thread.is_alive():
            self._inbox.put(command)
        else:
            self._apply(command)
        return command.done

    def detach(self, engine_id: str) -> Future:
        """Drop an engine and free its memory (its requests should have drained first)."""
        command = _Detach(engine_id)
        if self._thread.is_alive():
            self._inbox.put(command)
        else:
            self._apply(command)
        return command.done

    def start(self) -> None:
        self._thread.start()

    def submit(self, engine_id: str, request: GenerationRequest) -> None:
        self._inbox.put(_Add(engine_id, request))

    def abort(self, engine_id: str, request_id: str) -> None:
        self._inbox.put(_Abort(engine_id, request_id))

    def profile(self, seconds: float) -> Future:
        """Record a torch profiler trace of this worker's steps for `seconds`; the future gets
        the Chrome-trace JSON bytes (or `ProfilerBusy` while another recording runs)."""
        command = _Profile(seconds)
        self._inbox.put(command)
        return command.done

    def stats(self, engine_id: str) -> EngineStats:
        """A snapshot for metrics, taken by the worker thread after each step and inbox drain."""
        return self.engines[engine_id].last_stats

    def stop(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _has_work(self) -> bool:
        return any(engine.has_work() for engine in self.engines.values())

    def _run(self) -> None:
        while True:
            if not self._drain(block=not self._has_work()):
                self.profiler.stop()
                return
            for engine_id, engine in self.engines.items():
                events = None
                if engine.has_work():
                    with self.profiler.label(f"step {engine_id}"):
                        events = engine.step()
                engine.refresh_stats()  # before emitting: a client that saw its last token sees its blocks freed
                if events:
                    self.emit(events)
            self.profiler.tick()

    def _drain(self, block: bool) -> bool:
        """Apply every queued command; False once asked to stop. Blocks at most until a
        running profile is due to stop."""
        try:
            item = self._inbox.get(timeout=self.profiler.timeout_s()) if block else self._inbox.get_nowait()
            while True:
                if item is _STOP:
                    return False
                self._apply(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, item: _Add | _Abort | _Attach | _Detach | _Profile) -> None:
        try:
            if isinstance(item, _Add):
                self.engines[item.engine_id].add_request(item.request)
            elif isinstance(item, _Abort):
                self.engines[item.engine_id].abort(item.request_id)
            elif isinstance(item, _Attach):
                self.engines[item.engine_id] = item.engine
                item.done.set_result(None)
            elif isinstance(item, _Profile):
                self.profiler.start(item.seconds, item.done)
            else:
                self._detach(item)
        except Exception as exc:
            log.exception("worker command failed", device=self.device)
            if isinstance(item, _Attach | _Detach) and not item.done.done():
                item.done.set_exception(exc)

    def _detach(self, item: _Detach) -> None:
        engine = self.engines.pop(item.engine_id, None)
        if engine is not None and engine.num_unfinished:
            log.warning("detaching an engine with unfinished requests", engine=item.engine_id,
                        num_unfinished=engine.num_unfinished)
        on_cuda = engine is not None and engine.runner.device.type == "cuda"
        del engine
        gc.collect()
        if on_cuda:
            import torch

            torch.cuda.empty_cache()
        item.done.set_result(None)
