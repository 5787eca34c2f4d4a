"""The one admission path: every generation, encoder call and cache hit a caller starts passes
here, so tenant limits, queue bounds, refusal errors and their metrics are decided in one place.

Refusals become domain errors with a retry hint (`RateLimitError`/`QueueFullError` -> 429,
`ServiceUnavailableError` -> 503); nothing is changed by a refused request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import structlog

from engine.types import GenerationRequest, ImageInputs, Priority, SamplingParams
from scheduling.encoders import EncoderBusy, ServedEncoder
from scheduling.limiter import Rejected, TenantLimits
from scheduling.router import ModelUnavailable, QueueFull, RequestStream, Router, ServedModel
from services.errors import QueueFullError, ServiceError, ServiceUnavailableError, rate_limited
from services.observability.metrics import Metrics

log = structlog.get_logger(__name__)


class Admission:
    def __init__(self, router: Router, metrics: Metrics) -> None:
        self.router = router
        self.metrics = metrics

    def generation(self, model: ServedModel, prompt_ids: list[int], params: SamplingParams,
                   limits: TenantLimits, weight: float, priority: str, request_id: str | None = None, *,
                   counted: bool = True, cache_salt: str = "", images: ImageInputs | None = None) -> RequestStream:
        """Admit a generation to `model`'s queue (tenant limits, then the queue bound) and start it.

        `counted=False`: an internal copy (shadow traffic), kept out of the request metrics."""
        generation = GenerationRequest(request_id or uuid.uuid4().hex, prompt_ids, params, tenant=limits.name,
                                       priority=Priority[priority.upper()], weight=weight, cache_salt=cache_salt,
                                       images=images)
        try:
            stream = self.router.submit(model, generation, limits)
        except QueueFull as exc:
            if counted:
                self.metrics.reject(model, "queue_full", limits.name, priority)
            raise QueueFullError(f"{exc}; retry shortly", retry_after_s=1) from exc
        except ModelUnavailable as exc:  # unloaded while this request was being prepared
            raise ServiceUnavailableError(f"{exc}; retry shortly", code="model_unloading", retry_after_s=1) from exc
        except Rejected as exc:
            if counted:
                self.metrics.reject(model, exc.reason, limits.name, priority)
            raise rate_limited(exc) from exc
        if counted:
            self.metrics.admitted.labels(model.name, limits.name, priority).inc()
        return stream

    async def encode(self, model: ServedEncoder, items: Sequence[str | list[int]], limits: TenantLimits,
                     low: bool = False, *, counted: bool = True) -> list[Any]:
        """One output per item from `model`'s batcher, charged to the tenant's token rate by the
        tokens the model actually read.

        `counted=False`: a caller that waits out refusals and tries again (batch items): kept out of
        the request metrics and the failure log (it logs its own), and a busy batcher charges nothing."""
        estimate, started = sum(estimated_tokens(x) for x in items), time.monotonic()
        ticket = self._admit(model.name, limits, estimate, counted)
        used = estimate
        try:
            try:
                future = self.router.submit_encoder(model, list(items), low=low)
            except EncoderBusy as exc:
                if counted:
                    self.metrics.refused(model.name, "queue_full")
                else:
                    used = 0
                raise QueueFullError(f"{exc}; retry shortly", retry_after_s=1) from exc
            try:
                outputs = await future
            except Exception as exc:
                if counted:
                    self.metrics.encoder_requests.labels(model.name, model.kind, "error").inc()
                    log.error("encoder failed", model=model.ref, exc_info=exc)  # the client gets no exception text
                raise ServiceError(f"the {model.kind} model failed on these inputs (internal error)",
                                   code="model_failed") from exc
            used = sum(getattr(out, "num_tokens", 0) for out in outputs)  # tensor models read no tokens
            if counted:
                self.metrics.encoder_requests.labels(model.name, model.kind, "ok").inc()
                self.metrics.encoder_duration.labels(model.name, model.kind).observe(time.monotonic() - started)
            return outputs
        finally:
            self.router.admission.release(ticket, used)

    def cache_hit(self, model_name: str, limits: TenantLimits) -> None:
        """A cache hit is still one of its tenant's requests: it counts against `requests_per_minute`
        and `max_concurrent` like any other, and over them is refused with the same 429 (it computed
        no tokens, so `tokens_per_minute` is not charged)."""
        self.router.admission.release(self._admit(model_name, limits, 0), 0)

    def count_request(self, limits: TenantLimits) -> None:
        """What a tenant creates (a batch job, a conversation) or replays (a stream) counts as one of
        its requests: it runs no generation and holds no slot, so it takes one from
        `requests_per_minute` only; over it, the same RateLimitError (429 with a retry hint) as any
        refused request, changing nothing. Call it before any work the creation causes (loading a
        cold model, storing inputs)."""
        try:
            self.router.admission.count_request(limits)
        except Rejected as exc:
            raise rate_limited(exc) from exc

    def _admit(self, model_name: str, limits: TenantLimits, estimate: int, counted: bool = True):
        try:
            return self.router.admission.admit(limits, estimate)
        except Rejected as exc:
            if counted:
                self.metrics.refused(model_name, exc.reason)
            raise rate_limited(exc) from exc


def estimated_tokens(item: Any) -> int:
    """An encoder input's tokens before the tokenizer has counted them: a text's (about 4 characters a
    token), a pair's, or a token id list's; a tensor model's request (a dict of arrays) reads none."""
    if isinstance(item, str):
        return len(item) // 4 + 2
    if isinstance(item, tuple):
        return sum(len(text) // 4 + 2 for text in item)
    return len(item) if isinstance(item, list) else 0  # tensors (a dict of arrays) and images read no tokens
