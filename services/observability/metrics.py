"""Prometheus metrics: per-request latencies and tokens, engine gauges (`api/metrics.py` serves `GET /metrics`).

Each app owns its own `CollectorRegistry` (tests build several apps in one process). Engine
gauges are read at scrape time from each replica's `EngineStats` snapshot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.types import BATCH_TOKEN_BOUNDS, EngineStats, FinishReason, TokenEvent
from scheduling.router import RequestStream, Router, ServedModel
from services.observability.telemetry import SUCCESS, RequestRecord

BURST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)  # light models answer in ms
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STATUS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "cancelled",
          FinishReason.ERROR: "error"}

log = structlog.get_logger(__name__)
Sink = Callable[[RequestRecord], None]


class EngineCollector:
    """Reads replica snapshots when Prometheus scrapes; nothing is updated on the hot path."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        labels = ["model", "version", "replica"]
        gauge = lambda name, doc: GaugeMetricFamily(name, doc, labels=labels)  # noqa: E731
        counter = lambda name, doc: CounterMetricFamily(name, doc, labels=labels)  # noqa: E731
        gauges = {
            "num_running": gauge("galley_requests_running", "Sequences in the running batch"),
            "num_waiting": gauge("galley_requests_waiting", "Sequences waiting to run"),
            "kv_blocks_used": gauge("galley_kv_blocks_used", "KV cache blocks in use"),
            "kv_blocks_total": gauge("galley_kv_blocks_total", "KV cache blocks in the pool"),
            "weights_bytes": gauge("galley_model_weights_bytes", "Bytes of the replica's weights"),
            "kv_cache_bytes": gauge("galley_kv_cache_bytes", "Bytes of the replica's KV cache pool"),
            "prefix_cache_blocks": gauge("galley_prefix_cache_blocks", "KV cache blocks holding a reusable prefix"),
        }
        counters = {
            "num_preemptions": counter("galley_preemptions", "Sequences preempted for KV space"),
            "num_steps": counter("galley_engine_steps", "Engine steps run"),
            "num_graph_steps": counter("galley_engine_graph_steps", "Engine steps replayed from a CUDA graph "
                                       "(decode steps on CUDA; the rest ran op by op)"),
            "num_batched_tokens": counter("galley_batched_tokens", "Tokens run through the model"),
            "num_step_errors": counter("galley_engine_step_errors", "Engine steps in which something raised "
                                       "(only the requests it hit ended with an error)"),
            "prefix_cache_query_tokens": counter("galley_prefix_cache_queries", "Tokens of admitted "
                                                 "requests looked up in the prefix cache"),
            "prefix_cache_hit_tokens": counter("galley_prefix_cache_hits", "Tokens found in the prefix "
                                               "cache (their KV reused, not prefilled)"),
            "spec_num_draft_tokens": counter("galley_spec_decode_num_draft_tokens", "Speculative draft "
                                             "tokens verified by the model"),
            "spec_num_accepted_tokens": counter("galley_spec_decode_num_accepted_tokens", "Speculative draft "
                                                "tokens the model accepted (its own samples agreed)"),
        }
        batch = HistogramMetricFamily("galley_batch_tokens", "Tokens per engine step", labels=labels)
        devices: dict[str, EngineStats] = {}
        for model in self.router.served_models():
            for replica in model.replicas:
                stats = replica.worker.stats(replica.engine_id)
                key = [model.name, model.version, replica.device]
                for name, family in {**gauges, **counters}.items():
                    family.add_metric(key, getattr(stats, name))
                batch.add_metric(key, batch_buckets(stats), sum_value=stats.num_batched_tokens)
                if stats.device_memory_total_bytes is not None:
                    devices[replica.device] = stats
        yield from gauges.values()
        yield from counters.values()
        yield batch
        yield self._bursts()
        yield self._cpu_threads()
        yield self._queue_depth()
        yield from device_memory(devices)

    def _workers(self) -> list:
        """(device, worker) of every worker serving a loaded model, by device."""
        workers = {replica.worker.device: replica.worker
                   for model in self.router.served_models() for replica in model.replicas}
        return sorted(workers.items())

    def _bursts(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily("galley_worker_burst_requests", "Requests a device worker took together "
                                       "when one woke it from idle, so that they start in one step",
                                       labels=["worker"])
        for name, worker in self._workers():
            sizes = dict(worker.burst_sizes)  # written by the worker thread
            buckets = [(str(float(bound)), sum(n for size, n in sizes.items() if size <= bound))
                       for bound in BURST_BUCKETS]
            buckets.append(("+Inf", sum(sizes.values())))
            family.add_metric([name], buckets, sum_value=sum(size * n for size, n in sizes.items()))
        return family

    def _cpu_threads(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily("galley_cpu_threads", "Threads a CPU worker's steps run on: fewer than the "
                                   "cores while another process keeps one busy (engine/cpu_share.py)",
                                   labels=["worker"])
        for name, worker in self._workers():
            if worker.cpu_share is not None:
                family.add_metric([name], worker.cpu_share.threads)  # an int, written by the worker thread
        return family

    def _queue_depth(self) -> GaugeMetricFamily:
        depth = GaugeMetricFamily("galley_queue_depth", "Waiting sequences by priority and tenant",
                                  labels=["model", "priority", "tenant"])
        for name, totals in queue_depths(self.router).items():
            for (priority, tenant), count in sorted(totals.items()):
                depth.add_metric([name, priority, tenant], count)
        return depth


def queue_depths(router: Router) -> dict[str, dict[tuple[str, str], int]]:
    """Waiting sequences per model name by (priority, tenant), summed over versions and replicas."""
    out: dict[str, dict[tuple[str, str], int]] = {}
    for model in router.served_models():
        totals = out.setdefault(model.name, {})
        for replica in model.replicas:
            for key, count in replica.worker.stats(replica.engine_id).waiting_by_class.items():
                totals[key] = totals.get(key, 0) + count
    return out


def batch_buckets(stats: EngineStats) -> list[tuple[str, int]]:
    """The engine's per-bucket step counts as Prometheus' cumulative `le` buckets."""
    counts = stats.batch_token_counts or (0,) * (len(BATCH_TOKEN_BOUNDS) + 1)
    buckets, total = [], 0
    for bound, count in zip(BATCH_TOKEN_BOUNDS, counts):
        total += count
        buckets.append((str(float(bound)), total))
    buckets.append(("+Inf", total + counts[-1]))
    return buckets


def device_memory(devices: dict[str, EngineStats]):
    """CUDA memory gauges, one sample per device (absent on CPU-only servers)."""
    if not devices:
        return
    used = GaugeMetricFamily("galley_device_memory_used_bytes", "Bytes torch has allocated on the device",
                             labels=["device"])
    total = GaugeMetricFamily("galley_device_memory_total_bytes", "The device's memory", labels=["device"])
    for device, stats in sorted(devices.items()):
        used.add_metric([device], stats.device_memory_used_bytes)
        total.add_metric([device], stats.device_memory_total_bytes)
    yield used
    yield total


class StorageCollector:
    """Database writes SQLite refused, counted by the writer thread (so none goes unseen)."""

    def __init__(self, db) -> None:  # storage.db.Database
        self.db = db

    def collect(self):
        errors = CounterMetricFamily("galley_storage_write_errors", "Database writes SQLite refused "
                                     "(disk full, database locked, I/O error)")
        errors.add_metric([], self.db.num_write_errors)
        yield errors


BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EncoderCollector:
    """Each encoder's batch sizes and inputs, read from its loaded versions' batcher stats at scrape
    time and summed per model name (a version's counts leave with it when it unloads)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        labels = ["model", "kind"]
        sizes = HistogramMetricFamily("galley_encoder_batch_size", "Inputs per batch of a batched model (every kind "
                                      "but generate)", labels=labels)
        inputs = CounterMetricFamily("galley_encoder_inputs", "Inputs run through batched models", labels=labels)
        busy = CounterMetricFamily("galley_encoder_busy_seconds", "Seconds batched models' batches ran on their "
                                   "device (its share of the device beside engine steps)", labels=labels)
        by_name: dict[tuple[str, str], list] = {}
        for model in self.router.served_encoders():
            by_name.setdefault((model.name, model.kind), []).append(model.handle.stats)
        for name, stats in sorted(by_name.items()):
            buckets = [(str(bound), sum(n for s in stats for size, n in s.batch_sizes.items() if size <= bound))
                       for bound in BATCH_SIZE_BUCKETS]
            buckets.append(("+Inf", sum(s.num_batches for s in stats)))
            num_items = sum(s.num_items for s in stats)
            sizes.add_metric(list(name), buckets, sum_value=num_items)
            inputs.add_metric(list(name), num_items)
            busy.add_metric(list(name), sum(s.busy_s for s in stats))
        yield sizes
        yield inputs
        yield busy


class Metrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        version = ["model", "version"]
        self.requests = Counter("galley_requests", "Generation requests by how they ended: stop, length, "
                                "cancelled, error, timeout (not scheduled in time), rejected (at admission)",
                                ["model", "version", "status"], registry=r)
        self.admitted = Counter("galley_admitted", "Requests admitted to a model's queue",
                                ["model", "tenant", "priority"], registry=r)
        self.rejected = Counter("galley_rejected", "Requests refused at admission", ["model", "reason"], registry=r)
        self.prompt_tokens = Counter("galley_prompt_tokens", "Prompt tokens of requests that ran",
                                     ["model", "version", "tenant"], registry=r)
        self.generation_tokens = Counter("galley_generation_tokens", "Generated tokens, counted as they stream",
                                         ["model", "version", "tenant"], registry=r)
        self.ttft = Histogram("galley_time_to_first_token_seconds", "Arrival to first token", version,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("galley_inter_token_latency_seconds", "Gap between consecutive token events",
                             version, buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("galley_request_duration_seconds", "Arrival to last token of completed requests",
                                  version, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("galley_queue_wait_seconds", "Arrival to first scheduled step",
                                    ["model", "priority"], buckets=LATENCY_BUCKETS, registry=r)
        self.sinks: list[Sink] = []  # called with each finished RequestRecord (log line, ring, spans)
        self.cache_hits = Counter("galley_response_cache_hits", "Response cache hits (encoders: per input)",
                                  ["model"], registry=r)
        self.cache_misses = Counter("galley_response_cache_misses", "Response cache misses (encoders: per input)",
                                    ["model"], registry=r)
        self.encoder_requests = Counter("galley_encoder_requests", "Requests to batched models (every kind but "
                                        "generate) by how they ended: ok, cached, error", ["model", "kind", "status"],
                                        registry=r)
        self.encoder_duration = Histogram("galley_encoder_request_duration_seconds", "Admission to answer of "
                                          "requests to batched models that ran", ["model", "kind"],
                                          buckets=FAST_BUCKETS, registry=r)
        self.log_prompts = False
        self.registry.register(EngineCollector(router))
        self.registry.register(EncoderCollector(router))

    def refused(self, model_name: str, reason: str) -> None:
        """Any refusal (queue full, a tenant limit, not scheduled in time): `galley_rejected_total`."""
        self.rejected.labels(model_name, reason).inc()

    def reject(self, model: ServedModel, reason: str, tenant: str = "default", priority: str = "normal",
               request_id: str | None = None) -> None:
        """A generation refused at admission: counted as a refusal and as a request that ended
        `rejected`, and recorded (encoder calls and cache hits are only `refused`)."""
        self.refused(model.name, reason)
        self.requests.labels(model.name, model.version, "rejected").inc()
        now = time.monotonic()
        record = RequestRecord(request_id or current_request_id() or "", "", tenant, model.name, model.version,
                               priority, now, status="rejected", end_s=now, error=reason)
        self._emit(record)

    async def observe(self, stream: RequestStream, first_event_timeout_s: float | None = None,
                      keep_text: bool = False) -> AsyncIterator[TokenEvent]:
        """Pass a stream's events through, recording latencies and tokens as they come and the
        request's record when it ends, however it ends (finished, cancelled, left unread).

        With `first_event_timeout_s`, raises TimeoutError (status `timeout`) when the first event
        does not come in time; the caller aborts the stream.
        """
        req, model = stream.request, stream.model
        record = RequestRecord(current_request_id() or req.request_id, req.request_id, req.tenant, model.name,
                               model.version, req.priority.name.lower(), req.arrival_s)
        keep_text = keep_text or self.log_prompts
        if keep_text:
            record.prompt, record.output = model.tokenizer.decode(req.prompt_token_ids), ""
        events = aiter(stream)
        try:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the event when a cancel
                # (server shutdown) comes with it, swallowing the cancel (CPython gh-86296, fixed in 3.12),
                # and the task then waited for events a stopped engine never sends (a teardown hung on it)
                async with asyncio.timeout(first_event_timeout_s):
                    event = await anext(events)
            except TimeoutError:
                record.status = "timeout"
                self.refused(model.name, "queue_timeout")
                raise
            while True:
                self._on_event(record, event)
                yield event
                if event.finished:
                    return
                event = await anext(events)
        finally:
            self._finish(record)

    def _on_event(self, record: RequestRecord, event: TokenEvent) -> None:
        now = time.monotonic()
        labels = (record.model, record.version)
        if record.scheduled_s is None and event.scheduled_s is not None:
            record.scheduled_s = event.scheduled_s
            self.queue_wait.labels(record.model, record.priority).observe(max(0.0, event.scheduled_s -
                                                                              record.arrival_s))
            self.prompt_tokens.labels(*labels, record.tenant).inc(event.num_prompt_tokens)
        if event.token_ids:
            if record.first_token_s is None:
                self.ttft.labels(*labels).observe(now - record.arrival_s)
            else:
                self.itl.labels(*labels).observe(now - record.end_s)
            record.first_token_s = record.first_token_s or now
            record.end_s = now
            self.generation_tokens.labels(*labels, record.tenant).inc(len(event.token_ids))
        record.prompt_tokens, record.output_tokens = event.num_prompt_tokens, event.num_output_tokens
        record.num_preemptions = event.num_preemptions
        if record.output is not None:
            record.output += event.text
        if event.finished:
            record.status, record.finish_reason = STATUS[event.finish_reason], event.finish_reason.value
            record.error = event.error

    def _finish(self, record: RequestRecord) -> None:
        record.status = record.status or "cancelled"  # the reader stopped before the end
        record.end_s = time.monotonic() if record.status not in SUCCESS or record.end_s is None else record.end_s
        self.requests.labels(record.model, record.version, record.status).inc()
        if record.status in SUCCESS:
            self.duration.labels(record.model, record.version).observe(record.end_s - record.arrival_s)
        self._emit(record)

    def _emit(self, record: RequestRecord) -> None:
        for sink in self.sinks:
            try:
                sink(record)
            except Exception:
                log.exception("request record sink failed", sink=repr(sink))


def current_request_id() -> str | None:
    """The X-Request-Id bound by the HTTP middleware in this task's context, if any."""
    return structlog.contextvars.get_contextvars().get("request_id")
