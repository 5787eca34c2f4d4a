"""One thread per device: drain the inbox, step every engine with work, run due encoder
batches, publish events.

The only thread that touches engine, scheduler and KV state, and the only one that runs the
device's models: generative engines and encoders (embed, classify) alike. One torch thread
per device matters on CPU: libgomp gives every thread that runs torch ops its own OpenMP
team, and once the teams hold more threads than there are CPUs it stops spin-waiting, which
made a decode step's matmuls ~3x slower. Other threads talk to it through `submit` / `abort`
/ `EncoderClient.submit` (a thread-safe inbox, drained before every step, so an abort frees
its blocks before the next step runs) and hear back through `emit` (token events, which the
server wires to `loop.call_soon_threadsafe`) or a future (encoder outputs). It never blocks
on I/O. Engines and encoders come and go while it runs (attach / detach are inbox commands
too), so a model version loads and unloads without stopping the others.
"""

from __future__ import annotations

import dataclasses
import gc
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import structlog

from engine.batcher import BatcherStats, DynamicBatcher, Pending
from engine.cpu_share import CHECK_INTERVAL_S, CpuShare
from engine.engine import LLMEngine
from engine.inbox import (
    STOP,
    Abort,
    Add,
    Attach,
    AttachEncoder,
    Command,
    Detach,
    DetachEncoder,
    Encode,
    Profile,
    SetAdapter,
)
from engine.lora import PeftAdapter
from engine.profiler import StepProfiler
from engine.types import GENERATION_FAILED, EngineStats, FinishReason, GenerationRequest, TokenEvent

log = structlog.get_logger(__name__)

Emit = Callable[[list[TokenEvent]], None]

BURST_QUIET_S = 0.005  # an idle worker's first request waits this long for the next one
BURST_MAX_S = 0.05  # and gathers a burst for at most this long


class DeviceWorker:
    def __init__(self, device: str, emit: Emit, stall_after_s: float = 60.0, adapt_threads: bool = True) -> None:
        self.device = device
        self.emit = emit
        self.stall_after_s = stall_after_s  # a round of steps longer than this: not responsive (/ready 503)
        self._busy_since_s: float | None = None
        self.engines: dict[str, LLMEngine] = {}
        self.encoders: dict[str, DynamicBatcher] = {}
        self._encode_credit_s = 0.0  # see _run_encoders
        self.burst_sizes: dict[int, int] = {}  # requests an idle worker gathered in one burst -> bursts (metrics)
        self.profiler = StepProfiler(device)
        # one thread while another busy process holds a core (engine/cpu_share.py)
        self.cpu_share = CpuShare() if adapt_threads and device.startswith("cpu") else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"galley-worker-{device}", daemon=True)

    def attach(self, engine_id: str, engine: LLMEngine) -> Future:
        """Add an engine (done when the worker has it)."""
        return self._command(Attach(engine_id, engine))

    def detach(self, engine_id: str) -> Future:
        """Drop an engine and free its memory (its requests should have drained first)."""
        return self._command(Detach(engine_id))

    def attach_adapter(self, engine_id: str, name: str, adapter: PeftAdapter) -> Future:
        """Load a LoRA adapter onto an engine, between steps (the future raises AdapterError if it does not fit)."""
        return self._command(SetAdapter(engine_id, name, adapter))

    def detach_adapter(self, engine_id: str, name: str) -> Future:
        """Drop an adapter from an engine (its requests should have drained; any left end with an error)."""
        return self._command(SetAdapter(engine_id, name, None))

    def attach_encoder(self, encoder_id: str, batcher: DynamicBatcher) -> EncoderClient:
        """Run an encoder's batches on this thread; the client is what callers submit to."""
        self._command(AttachEncoder(encoder_id, batcher)).result()
        return EncoderClient(self, encoder_id, batcher)

    def detach_encoder(self, encoder_id: str) -> Future:
        """Drop an encoder and free its memory; inputs still waiting fail (drain it first)."""
        return self._command(DetachEncoder(encoder_id))

    def start(self) -> None:
        self._thread.start()

    def submit(self, engine_id: str, request: GenerationRequest) -> None:
        self._inbox.put(Add(engine_id, request))

    def abort(self, engine_id: str, request_id: str) -> None:
        self._inbox.put(Abort(engine_id, request_id))

    def encode(self, encoder_id: str, pending: Pending) -> None:
        self._inbox.put(Encode(encoder_id, pending))

    def profile(self, seconds: float) -> Future:
        """Record a torch profiler trace of this worker's steps for `seconds`; the future gets
        the Chrome-trace JSON bytes (or `ProfilerBusy` while another recording runs)."""
        command = Profile(seconds)
        self._inbox.put(command)
        return command.done

    def stats(self, engine_id: str) -> EngineStats:
        """A snapshot for metrics, taken by the worker thread after each step and inbox drain."""
        return self.engines[engine_id].last_stats

    def stop(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _command(self, command: Command) -> Future:
        """Through the inbox once the thread runs; applied at once before it starts."""
        if self._thread.is_alive():
            self._inbox.put(command)
        else:
            self._apply(command)
        return command.done

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._busy_since_s = None  # idle while it waits for work
            try:
                if not self._drain():
                    self.profiler.stop()
                    for batcher in self.encoders.values():
                        batcher.fail_all(RuntimeError(f"worker {self.device} stopped"))
                    return
                self._busy_since_s = time.monotonic()
                stepped_s = self._step_engines()
                encoded = self._run_encoders(stepped_s)
                self.profiler.tick()
                if self.cpu_share is not None:
                    self.cpu_share.tick(busy=stepped_s > 0 or encoded)
            except Exception:  # a bug outside the guarded parts: log it and go on with the next round
                log.exception("worker loop failed; continuing", device=self.device)

    def _step_engines(self) -> float:
        """One step of every engine with work; returns the seconds the steps took. A step that
        raises past the engine's own guards fails that engine's requests only."""
        stepped_s = 0.0
        for engine_id, engine in list(self.engines.items()):
            events = None
            try:
                if engine.has_work():
                    started = time.perf_counter()
                    with self.profiler.label(f"step {engine_id}"):
                        events = engine.step()
                    stepped_s += time.perf_counter() - started
                engine.refresh_stats()  # before emitting: a client that saw its last token sees its blocks freed
                if events:
                    self.emit(events)
            except Exception:
                log.exception("engine step failed; failing its requests", device=self.device, engine=engine_id)
                self._fail_engine(engine, events)
        return stepped_s

    def _fail_engine(self, engine: LLMEngine, undelivered: list[TokenEvent] | None) -> None:
        """End every request of `engine` with an error, and those whose last events may not have
        gone out (they were finished in the step, so the engine no longer holds them)."""
        events = engine.fail_all()
        ended = {event.request_id for event in events}
        events += [dataclasses.replace(event, text="", token_ids=[], logprobs=None, error=GENERATION_FAILED,
                                       finish_reason=FinishReason.ERROR)
                   for event in undelivered or [] if event.finished and event.request_id not in ended]
        try:
            engine.refresh_stats()
            self.emit(events)
        except Exception:
            log.exception("could not deliver the failed requests' errors", device=self.device)

    def is_responsive(self) -> bool:
        """False if the thread died or one round of steps has run for `stall_after_s` (stuck)."""
        busy_since = self._busy_since_s
        stuck = busy_since is not None and time.monotonic() - busy_since > self.stall_after_s
        return self._thread.is_alive() and not stuck

    def _run_encoders(self, stepped_s: float) -> bool:
        """At most one batch per encoder between steps. While engines generate, encoders get about
        as much device time as the steps took (`_encode_credit_s`: step time earned, batch time
        spent, never more than one step ahead), in batches sized to it, so streams keep their
        pace instead of waiting behind whole batches; with no generation, full batches."""
        if not stepped_s:
            self._encode_credit_s = 0.0
        else:
            self._encode_credit_s = min(self._encode_credit_s + stepped_s, stepped_s)
        now, encoded = time.monotonic(), False
        for encoder_id, batcher in self.encoders.items():
            if not batcher.due(now) or (stepped_s and self._encode_credit_s <= 0):
                continue
            limit = batcher.items_for(self._encode_credit_s) if stepped_s else None
            started = time.perf_counter()
            with self.profiler.label(f"encode {encoder_id}"):
                batcher.run_once(limit)
            encoded = True
            if stepped_s:
                self._encode_credit_s -= time.perf_counter() - started
        return encoded

    def _wait_s(self) -> float | None:
        """How long the inbox may be waited on: not at all while an engine has work or an encoder
        batch is due, else until the next encoder batch, profile stop or CPU share check is due
        (None: no limit)."""
        if any(engine.has_work() for engine in self.engines.values()):
            return 0.0
        deadlines = [d for d in (b.deadline() for b in self.encoders.values()) if d is not None]
        waits = [max(0.0, min(deadlines) - time.monotonic())] if deadlines else []
        if self.profiler.timeout_s() is not None:
            waits.append(self.profiler.timeout_s())
        if self.cpu_share is not None:  # idle, it still checks the neighbours: work resumes on today's threads
            waits.append(CHECK_INTERVAL_S)
        return min(waits) if waits else None

    def _drain(self) -> bool:
        """Apply every queued command, first waiting up to `_wait_s` for one; False once asked to stop.

        A request that wakes an idle worker opens a burst: more are taken while they keep coming
        (each within BURST_QUIET_S of the last, for at most BURST_MAX_S), so requests sent together
        (a shared system prompt's burst, `n` clients at once) start in one step instead of the first
        running alone while the rest queue behind its prefill. A lone request pays BURST_QUIET_S."""
        wait_s = self._wait_s()
        burst = 0
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s != 0.0 else self._inbox.get_nowait()
            burst_ends = time.monotonic() + BURST_MAX_S if wait_s != 0.0 and isinstance(item, Add) else None
            while True:
                if item is STOP:
                    return False
                self._apply(item)
                burst += burst_ends is not None and isinstance(item, Add)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    left = burst_ends - time.monotonic() if burst_ends is not None else 0.0
                    if left <= 0 or not isinstance(item, Add):
                        raise
                    item = self._inbox.get(timeout=min(BURST_QUIET_S, left))
        except queue.Empty:
            return True
        finally:
            if burst:
                self.burst_sizes[burst] = self.burst_sizes.get(burst, 0) + 1

    def _apply(self, item: Add | Abort | Encode | Command) -> None:
        try:
            if isinstance(item, Add):
                self._add(item)
            elif isinstance(item, Abort):
                self.engines[item.engine_id].abort(item.request_id)
            elif isinstance(item, Encode):
                self._encode(item)
            elif isinstance(item, Attach):
                self.engines[item.engine_id] = item.engine
                item.done.set_result(None)
            elif isinstance(item, SetAdapter):
                self._set_adapter(item)
            elif isinstance(item, AttachEncoder):
                self.encoders[item.encoder_id] = item.batcher
                item.done.set_result(None)
            elif isinstance(item, Profile):
                self.profiler.start(item.seconds, item.done)
            elif isinstance(item, DetachEncoder):
                self._detach_encoder(item)
            else:
                self._detach(item)
        except Exception as exc:
            log.exception("worker command failed", device=self.device)
            if isinstance(item, Command) and not item.done.done():
                item.done.set_exception(exc)

    def _add(self, item: Add) -> None:
        """Hand a request to its engine; one that cannot be added ends at once with an error event
        (its client must not wait forever for a request the worker dropped)."""
        try:
            self.engines[item.engine_id].add_request(item.request)
        except Exception:
            log.exception("could not add a request", device=self.device, engine=item.engine_id,
                          request_id=item.request.request_id)
            engine = self.engines.get(item.engine_id)
            try:
                if engine is not None:
                    engine.abort(item.request.request_id)
            except Exception:  # half-added: release what can be; the error event below must go out
                log.exception("could not release a request that failed to add", request_id=item.request.request_id)
            self.emit([TokenEvent(item.request.request_id, "", [], len(item.request.prompt_token_ids), 0,
                                  finish_reason=FinishReason.ERROR, error=GENERATION_FAILED)])

    def _set_adapter(self, item: SetAdapter) -> None:
        engine = self.engines.get(item.engine_id)
        if item.adapter is not None:
            if engine is None:
                raise KeyError(f"engine {item.engine_id!r} is not attached to this worker")
            engine.add_adapter(item.name, item.adapter)
        elif engine is not None:
            self.emit(engine.remove_adapter(item.name))
        item.done.set_result(None)

    def _encode(self, item: Encode) -> None:
        batcher = self.encoders.get(item.encoder_id)
        if batcher is None:
            item.pending.future.set_exception(RuntimeError(f"encoder {item.encoder_id!r} is not loaded"))
        else:
            batcher.add(item.pending)

    def _detach(self, item: Detach) -> None:
        engine = self.engines.pop(item.engine_id, None)
        if engine is not None and engine.num_unfinished:
            log.warning("detaching an engine with unfinished requests", engine=item.engine_id,
                        num_unfinished=engine.num_unfinished)
        del engine
        self._free_memory()
        item.done.set_result(None)

    def _detach_encoder(self, item: DetachEncoder) -> None:
        batcher = self.encoders.pop(item.encoder_id, None)
        if batcher is not None:
            batcher.fail_all(RuntimeError(f"encoder {item.encoder_id!r} was unloaded"))
        del batcher
        self._free_memory()
        item.done.set_result(None)

    @staticmethod
    def _free_memory() -> None:
        """After dropping a model: collect it, and hand its CUDA blocks back if CUDA is in use."""
        gc.collect()
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


class EncoderClient:
    """An encoder attached to a worker, as other threads see it (`ServedEncoder.handle`)."""

    def __init__(self, worker: DeviceWorker, encoder_id: str, batcher: DynamicBatcher) -> None:
        self.worker = worker
        self.encoder_id = encoder_id
        self.owns_worker = False  # a worker started for this encoder alone stops with it
        self._batcher = batcher

    def submit(self, items: list, low: bool = False) -> Future:
        """A future of one output per item, in order (thread-safe); `low` inputs (batch jobs,
        shadow copies) only fill the room interactive requests leave in a batch."""
        pending = Pending(list(items), low)
        if not pending.items:
            pending.future.set_result([])
        else:
            self.worker.encode(self.encoder_id, pending)
        return pending.future

    @property
    def stats(self) -> BatcherStats:
        return self._batcher.stats

    def stop(self, timeout_s: float = 30.0) -> None:
        """Detach from the worker, failing inputs still waiting (blocking)."""
        self.worker.detach_encoder(self.encoder_id).result(timeout_s)
        if self.owns_worker:
            self.worker.stop(timeout_s)
