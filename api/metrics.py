"""Prometheus metrics (`GET /metrics`): per-request latencies and tokens, engine gauges.

Each app owns its own `CollectorRegistry` (tests build several apps in one process). Engine
gauges are read at scrape time from each replica's `EngineStats` snapshot.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.types import TokenEvent
from scheduling.encoders import EncoderRegistry
from scheduling.router import RequestStream, Router

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineCollector:
    """Reads replica snapshots when Prometheus scrapes; nothing is updated on the hot path."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        labels = ["model", "replica"]
        gauge = lambda name, doc: GaugeMetricFamily(name, doc, labels=labels)  # noqa: E731
        counter = lambda name, doc: CounterMetricFamily(name, doc, labels=labels)  # noqa: E731
        gauges = {
            "num_running": gauge("galley_requests_running", "Sequences in the running batch"),
            "num_waiting": gauge("galley_requests_waiting", "Sequences waiting to run"),
            "kv_blocks_used": gauge("galley_kv_blocks_used", "KV cache blocks in use"),
            "kv_blocks_total": gauge("galley_kv_blocks_total", "KV cache blocks in the pool"),
        }
        counters = {
            "num_preemptions": counter("galley_preemptions", "Sequences preempted for KV space"),
            "num_steps": counter("galley_engine_steps", "Engine steps run"),
            "num_batched_tokens": counter("galley_batched_tokens", "Tokens run through the model"),
        }
        for model in self.router.models.values():
            for replica in model.replicas:
                stats = replica.worker.stats(replica.engine_id)
                for name, family in {**gauges, **counters}.items():
                    family.add_metric([model.name, replica.device], getattr(stats, name))
        yield from gauges.values()
        yield from counters.values()
        yield self._queue_depth()

    def _queue_depth(self) -> GaugeMetricFamily:
        depth = GaugeMetricFamily("galley_queue_depth", "Waiting sequences by priority and tenant",
                                  labels=["model", "priority", "tenant"])
        for model in self.router.models.values():
            totals: dict[tuple[str, str], int] = {}
            for replica in model.replicas:
                for key, count in replica.worker.stats(replica.engine_id).waiting_by_class.items():
                    totals[key] = totals.get(key, 0) + count
            for (priority, tenant), count in sorted(totals.items()):
                depth.add_metric([model.name, priority, tenant], count)
        return depth


BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EncoderCollector:
    """Each encoder's batch sizes and inputs, read from its batcher's stats at scrape time."""

    def __init__(self, encoders: EncoderRegistry) -> None:
        self.encoders = encoders

    def collect(self):
        sizes = HistogramMetricFamily("galley_encoder_batch_size", "Inputs per encoder forward", labels=["model"])
        inputs = CounterMetricFamily("galley_encoder_inputs", "Inputs run through encoder models", labels=["model"])
        for model in self.encoders.models.values():
            stats = model.handle.stats
            buckets = [(str(bound), sum(n for size, n in stats.batch_sizes.items() if size <= bound))
                       for bound in BATCH_SIZE_BUCKETS]
            buckets.append(("+Inf", stats.num_batches))
            sizes.add_metric([model.name], buckets, sum_value=stats.num_items)
            inputs.add_metric([model.name], stats.num_items)
        yield sizes
        yield inputs


class Metrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("galley_requests", "Finished generation requests", ["model", "finish_reason"],
                                registry=r)
        self.admitted = Counter("galley_admitted", "Requests admitted to a model's queue",
                                ["model", "tenant", "priority"], registry=r)
        self.rejected = Counter("galley_rejected", "Requests refused at admission", ["model", "reason"], registry=r)
        self.prompt_tokens = Counter("galley_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model", "tenant"], registry=r)
        self.generation_tokens = Counter("galley_generation_tokens", "Generated tokens of finished requests",
                                         ["model", "tenant"], registry=r)
        self.ttft = Histogram("galley_time_to_first_token_seconds", "Arrival to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("galley_inter_token_latency_seconds", "Gap between consecutive token events",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("galley_request_duration_seconds", "Arrival to last token", ["model"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.cache_hits = Counter("galley_response_cache_hits", "Response cache hits (encoders: per input)",
                                  ["model"], registry=r)
        self.cache_misses = Counter("galley_response_cache_misses", "Response cache misses (encoders: per input)",
                                    ["model"], registry=r)
        self.encoder_requests = Counter("galley_encoder_requests", "Embedding and classification requests",
                                        ["model", "status"], registry=r)
        self.registry.register(EngineCollector(router))

    def watch_encoders(self, encoders: EncoderRegistry) -> None:
        self.registry.register(EncoderCollector(encoders))

    async def observe(self, stream: RequestStream) -> AsyncIterator[TokenEvent]:
        """Pass a stream's events through, recording its latencies and tokens."""
        model, arrival = stream.model.name, time.monotonic()
        last: float | None = None
        event = None
        async for event in stream:
            now = time.monotonic()
            if event.token_ids:
                if last is None:
                    self.ttft.labels(model).observe(now - arrival)
                else:
                    self.itl.labels(model).observe(now - last)
                last = now
            yield event
        if event is not None and event.finished:
            self.duration.labels(model).observe(time.monotonic() - arrival)
            self.requests.labels(model, event.finish_reason.value).inc()
            tenant = stream.request.tenant
            self.prompt_tokens.labels(model, tenant).inc(event.num_prompt_tokens)
            self.generation_tokens.labels(model, tenant).inc(event.num_output_tokens)


METRICS = web.AppKey("metrics", Metrics)


async def metrics_endpoint(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
