"""A submitted generation's token events as its caller reads them, and what its end means.

The first-event timeout lives here, once: a request the scheduler has not started within the
router's `queue_timeout_s` is aborted and refused (503 `queue_timeout`), whether it is collected,
streamed, merged with other choices or recorded by a live stream. Failures become domain errors
with messages safe to show a client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from engine.types import TokenEvent, TokenLogprob
from scheduling.router import RequestStream, Router
from services.answers.events import StreamEvent
from services.errors import DRAINING_RETRY_AFTER_S, SHUTTING_DOWN, ServiceError, ServiceUnavailableError
from services.observability.metrics import Metrics

log = structlog.get_logger(__name__)

QUEUE_TIMEOUT = "queue_timeout"
QUEUE_TIMEOUT_RETRY_AFTER_S = 5


def queue_timeout(timeout_s: float) -> ServiceUnavailableError:
    """A request that waited `timeout_s` without being scheduled."""
    return ServiceUnavailableError(
        f"the request waited {timeout_s:g}s without being scheduled (queue_timeout_seconds); "
        "the server is overloaded, retry later",
        code=QUEUE_TIMEOUT, retry_after_s=QUEUE_TIMEOUT_RETRY_AFTER_S,
    )


async def scheduled_events(router: Router, metrics: Metrics, stream: RequestStream) -> AsyncIterator[TokenEvent]:
    """The stream's events, recorded by the metrics; if the first does not come within the queue
    timeout, the generation is aborted and `queue_timeout` raised."""
    events = metrics.observe(stream, router.queue_timeout_s)
    try:
        first = await anext(events)
    except TimeoutError:
        router.abort(stream)
        raise queue_timeout(router.queue_timeout_s) from None
    yield first
    async for event in events:
        yield event


async def prepend(first, rest):
    """`first`, then the items of `rest` (an async iterator already started)."""
    yield first
    async for item in rest:
        yield item


def generation_failed(event: TokenEvent) -> ServiceError:
    """A generation that ended with an error: the engine's fixed text, or the end of a drain
    (503 to retry, not a server error)."""
    if event.error_code == SHUTTING_DOWN:
        return ServiceUnavailableError(event.error, code=SHUTTING_DOWN, retry_after_s=DRAINING_RETRY_AFTER_S)
    return ServiceError(event.error, code="generation_failed")


def stream_failed(event: StreamEvent) -> ServiceError:
    """A live stream's error event as an error (a stream that failed before its first token)."""
    message = event.error or "generation failed"
    if event.error_status == 503:
        return ServiceUnavailableError(message, code=event.error_code, retry_after_s=QUEUE_TIMEOUT_RETRY_AFTER_S)
    return ServiceError(message, code=event.error_code)


def failure(exc: Exception) -> ServiceError:
    """An exception as what a client may see: our own errors as they are, anything else logged
    and reduced to a fixed message (exception text can hold paths and other requests' data)."""
    if isinstance(exc, ServiceError):
        return exc
    log.error("request failed", exc_info=exc)
    return ServiceError("internal server error", code="internal_error")


def usage_of(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens whose KV came from the prefix cache (always
    there, as OpenAI sends it; vLLM only with --enable-prompt-tokens-details)."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def usage(event: TokenEvent) -> dict:
    return usage_of(event.num_prompt_tokens, event.num_output_tokens, event.num_cached_tokens)


def cached_tokens(usage_: dict) -> int:
    """A usage's cached prompt tokens (0 in one stored before they were counted)."""
    return (usage_.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def usage_n(usages: list[dict], n: int) -> dict:
    """Of n choices per prompt (in choice order: a prompt's n choices side by side): each prompt
    counted once (its cached tokens too: its first choice's); every choice's completion tokens."""
    firsts = usages[::n]
    return usage_of(sum(u["prompt_tokens"] for u in firsts), sum(u["completion_tokens"] for u in usages),
                    sum(cached_tokens(u) for u in firsts))


def finish_reason(reason) -> str | None:
    """The OpenAI finish reason: `stop` or `length`; anything else (abort, error) is none."""
    value = getattr(reason, "value", reason)
    return value if value in ("stop", "length") else None


@dataclass(frozen=True)
class Answer:
    """A generation read to its end."""

    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # stop | length | None (tool_calls once its calls are parsed out)
    usage: dict
    tool_calls: list[dict] | None = None  # OpenAI's shape; `text` is then the content beside them
    reasoning_content: str | None = None  # a thinking model's thoughts (`text` is then the answer after them)


async def collect(router: Router, metrics: Metrics, stream: RequestStream) -> Answer:
    """A non-streamed, unrecorded generation to its end; a caller that goes away (is cancelled) aborts it."""
    text, logprobs, last = "", [], None
    try:
        async for event in scheduled_events(router, metrics, stream):
            text, last = text + event.text, event
            logprobs.extend(event.logprobs or [])
    finally:
        if not stream.finished:  # the caller went away: its task was cancelled
            router.abort(stream)
    if last.error:
        raise generation_failed(last)
    return Answer(text, logprobs, finish_reason(last.finish_reason), usage(last))
