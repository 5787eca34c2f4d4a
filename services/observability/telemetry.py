"""What happens to a generation request once it ends: one log line, the recent-requests ring,
and OpenTelemetry spans.

`services.observability.metrics.Metrics.observe` builds a `RequestRecord` while a stream's events pass and
hands the finished record to each sink here. The log line carries the request id (the
`X-Request-Id` of the HTTP request that started it), tenant, model@version, token counts,
queue / prefill / decode / total times, finish reason and status; prompts and outputs only
with `log_prompts = true`. API keys never reach a record. Tracing is optional: with
`[tracing] enabled = true` and `opentelemetry-sdk` installed, each record becomes a
`generation` span with `queue`, `prefill` and `decode` children, timed from the record, so
no tracing code sits on the token path.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("galley.requests")

SUCCESS = ("stop", "length")  # statuses of requests that ended normally
FAILURE = ("error", "timeout")  # statuses that count as server errors (alerts, error rate)


@dataclass(frozen=True)
class ObservabilityConfig:
    log_prompts: bool = False  # put prompt and output text in the per-request log line and ring
    recent_requests: int = 500  # request records kept in memory for GET /admin/api/requests
    max_profile_seconds: float = 30.0  # longest POST /admin/api/profile?seconds=N
    alert_interval_seconds: float = 5.0  # how often [[alerts]] rules are evaluated
    stats_window_seconds: float = 60.0  # window of the TTFT percentiles in GET /admin/api/stats
    metrics_token: str = ""  # env GALLEY_METRICS_TOKEN wins; with auth on a non-loopback bind, /metrics needs it
    # (or the admin key) as `Authorization: Bearer`; "": the admin key only


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = False  # spans need the `tracing` extra: pip install 'galley[tracing]'
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"  # OTLP/HTTP collector; "" records no export
    service_name: str = "galley"


def unix_time(monotonic_s: float) -> float:
    return time.time() - (time.monotonic() - monotonic_s)


@dataclass
class RequestRecord:
    """One generation request from arrival to its end; times are monotonic seconds until `to_dict`."""

    request_id: str
    generation_id: str
    tenant: str
    model: str
    version: str
    priority: str
    arrival_s: float
    status: str | None = None  # stop | length | cancelled | error | timeout | rejected
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    scheduled_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    prompt: str | None = None
    output: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def queue_s(self) -> float | None:
        end = self.scheduled_s if self.scheduled_s is not None else self.end_s
        return None if end is None else max(0.0, end - self.arrival_s)

    @property
    def prefill_s(self) -> float | None:
        if self.scheduled_s is None or self.first_token_s is None:
            return None
        return max(0.0, self.first_token_s - self.scheduled_s)

    @property
    def decode_s(self) -> float | None:
        if self.first_token_s is None or self.end_s is None:
            return None
        return max(0.0, self.end_s - self.first_token_s)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def total_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        """The JSON of the log line and of GET /admin/api/requests (seconds rounded to 0.1 ms)."""
        r = lambda v: None if v is None else round(v, 4)  # noqa: E731
        out = {
            "request_id": self.request_id, "generation_id": self.generation_id, "tenant": self.tenant,
            "model": f"{self.model}@{self.version}", "priority": self.priority, "status": self.status,
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "queue_s": r(self.queue_s), "prefill_s": r(self.prefill_s),
            "decode_s": r(self.decode_s), "ttft_s": r(self.ttft_s), "total_s": r(self.total_s),
            "preemptions": self.num_preemptions, "time": round(unix_time(self.arrival_s), 3),
        }
        if self.error:
            out["error"] = self.error
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.output is not None:
            out["output"] = self.output
        return out


class RecentRequests:
    """The last N finished records, newest last (a bounded deque: old ones fall off)."""

    def __init__(self, size: int) -> None:
        self.records: collections.deque[RequestRecord] = collections.deque(maxlen=max(1, size))

    def __call__(self, record: RequestRecord) -> None:
        self.records.append(record)

    def latest(self, limit: int, tenant: str | None = None, status: str | None = None) -> list[dict]:
        out = []
        for record in reversed(self.records):
            if (tenant is None or record.tenant == tenant) and (status is None or record.status == status):
                out.append(record.to_dict())
                if len(out) >= limit:
                    break
        return out


def log_request(record: RequestRecord) -> None:
    """One JSON line per generation request at its end."""
    fields = record.to_dict()
    level = "warning" if record.status in FAILURE else "info"
    getattr(log, level)("generation", **fields)


class Tracing:
    """OpenTelemetry spans from finished records, on a provider of our own (no global state)."""

    def __init__(self, config: TracingConfig, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif config.otlp_endpoint:
            self.provider.add_span_processor(BatchSpanProcessor(otlp_exporter(config.otlp_endpoint)))
        self.tracer = self.provider.get_tracer("galley")

    def __call__(self, record: RequestRecord) -> None:
        offset_s = time.time() - time.monotonic()  # one offset, so the spans nest exactly
        ns = lambda s: int((s + offset_s) * 1e9)  # noqa: E731
        end = record.end_s if record.end_s is not None else time.monotonic()
        attributes = {"galley.request_id": record.request_id, "galley.generation_id": record.generation_id,
                      "galley.tenant": record.tenant, "galley.model": record.model,
                      "galley.model_version": record.version, "galley.priority": record.priority,
                      "galley.status": record.status or "", "galley.prompt_tokens": record.prompt_tokens,
                      "galley.output_tokens": record.output_tokens}
        root = self.tracer.start_span("generation", start_time=ns(record.arrival_s), attributes=attributes)
        from opentelemetry import trace

        context = trace.set_span_in_context(root)
        scheduled = record.scheduled_s if record.scheduled_s is not None else end
        phases = [("queue", record.arrival_s, scheduled)]
        if record.scheduled_s is not None:
            first = record.first_token_s if record.first_token_s is not None else end
            phases.append(("prefill", record.scheduled_s, first))
            if record.first_token_s is not None:
                phases.append(("decode", record.first_token_s, end))
        for name, start_s, end_s in phases:
            span = self.tracer.start_span(name, context=context, start_time=ns(start_s))
            span.end(end_time=ns(max(start_s, end_s)))
        if record.status in FAILURE:
            root.set_status(trace.Status(trace.StatusCode.ERROR, record.error or record.status))
        root.end(end_time=ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()


def otlp_exporter(endpoint: str) -> Any:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def build_tracing(config: TracingConfig, exporter: Any = None) -> Tracing | None:
    """Spans when enabled and the SDK is installed; otherwise None (and a warning if it was asked for)."""
    if not config.enabled:
        return None
    try:
        return Tracing(config, exporter)
    except ImportError as exc:
        log.warning("tracing is enabled but OpenTelemetry is not installed: pip install 'galley[tracing]'",
                    error=str(exc))
        return None
