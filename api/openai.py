"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions.

Handlers validate with the pydantic schemas, build a `GenerationRequest`, submit it through
the router and turn token events into OpenAI's exact JSON (streamed as SSE or collected).
A client that goes away aborts its request, so its KV blocks free within one step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from api.auth import check_model_access, check_priority_access, tenant_of
from api.context import ROUTER, STATE
from api.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RateLimitError,
    ServiceUnavailableError,
    json_response,
)
from api.metrics import METRICS
from api.routes import Route
from api.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
    SamplingFields,
)
from api.sse import open_sse, send_event
from api.validation import parse_body
from engine.types import FinishReason, GenerationRequest, Priority, SamplingParams, TokenEvent, TokenLogprob
from scheduling.admission import Rejected, TenantLimits
from scheduling.router import QueueFull, RequestStream, ServedModel

log = structlog.get_logger(__name__)


def served_model(request: web.Request, name: str) -> ServedModel:
    model = request.app[ROUTER].models.get(name)
    if model is None and not request.app[STATE].ready:
        raise ServiceUnavailableError("models are still loading", headers={"Retry-After": "5"})
    if model is None:
        raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model")
    return model


def sampling_params(request: web.Request, body: SamplingFields, max_tokens: int | None, prompt_len: int,
                    model: ServedModel, logprobs: int | None) -> SamplingParams:
    room = model.max_model_len - prompt_len
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        asked = f"{prompt_len} in the prompt" + (f" and {max_tokens} for the completion" if max_tokens else "")
        raise InvalidRequestError(
            f"This model's maximum context length is {model.max_model_len} tokens, "
            f"but you requested {prompt_len + (max_tokens or 0)} tokens ({asked}).",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    cap = tenant_of(request).max_tokens
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, over this API key's cap of {cap}", param="max_tokens")
    if cap is not None:
        room = min(room, cap)
    vocab = model.vocab_size
    if body.stop_token_ids and any(not 0 <= t < vocab for t in body.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens or room,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k if body.top_k and body.top_k > 0 else None,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def tenant_limits(request: web.Request) -> tuple[TenantLimits, float]:
    tenant = tenant_of(request)
    limits = TenantLimits(tenant.name, tenant.max_concurrent, tenant.requests_per_minute, tenant.tokens_per_minute)
    return limits, tenant.weight


def submit(request: web.Request, model: ServedModel, prompt_ids: list[int], params: SamplingParams,
           priority: str) -> RequestStream:
    limits, weight = tenant_limits(request)
    generation = GenerationRequest(uuid.uuid4().hex, prompt_ids, params, tenant=limits.name,
                                   priority=Priority[priority.upper()], weight=weight)
    metrics = request.app[METRICS]
    try:
        stream = request.app[ROUTER].submit(model, generation, limits)
    except QueueFull as exc:
        metrics.rejected.labels(model.name, "queue_full").inc()
        raise QueueFullError(f"{exc}; retry shortly", headers={"Retry-After": "1"}) from exc
    except Rejected as exc:
        metrics.rejected.labels(model.name, exc.reason).inc()
        raise RateLimitError(str(exc), code=exc.reason, headers={"Retry-After": str(exc.retry_after_s)}) from exc
    metrics.admitted.labels(model.name, limits.name, priority).inc()
    return stream


async def scheduled_events(request: web.Request, stream: RequestStream) -> AsyncIterator[TokenEvent]:
    """The stream's events; if the first does not come within the queue timeout, abort with 503."""
    events = request.app[METRICS].observe(stream)
    timeout_s = request.app[ROUTER].queue_timeout_s
    try:
        first = await asyncio.wait_for(anext(events), timeout_s)
    except TimeoutError:
        request.app[ROUTER].abort(stream)
        request.app[METRICS].rejected.labels(stream.model.name, "queue_timeout").inc()
        raise ServiceUnavailableError(
            f"the request waited {timeout_s:g}s without being scheduled (queue_timeout_seconds); "
            "the server is overloaded, retry later",
            code="queue_timeout", headers={"Retry-After": "5"},
        ) from None
    yield first
    async for event in events:
        yield event


def usage(event: TokenEvent) -> dict:
    return {
        "prompt_tokens": event.num_prompt_tokens,
        "completion_tokens": event.num_output_tokens,
        "total_tokens": event.num_prompt_tokens + event.num_output_tokens,
    }


def finish_reason(event: TokenEvent) -> str | None:
    return event.finish_reason.value if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) else None


@dataclass
class Collected:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: TokenEvent | None = None


async def collect(request: web.Request, stream: RequestStream) -> Collected:
    out = Collected()
    async for event in scheduled_events(request, stream):
        out.text += event.text
        out.logprobs.extend(event.logprobs or [])
        out.last = event
    if out.last is not None and out.last.error:
        raise web.HTTPInternalServerError(text=out.last.error)
    return out


async def prepend(first: TokenEvent, rest: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
    yield first
    async for event in rest:
        yield event


ChunkFn = Callable[[str, list[TokenLogprob], str | None], dict]


async def stream_sse(request: web.Request, stream: RequestStream, make_chunk: ChunkFn, base: dict,
                     include_usage: bool, first: dict | None = None) -> web.StreamResponse:
    """Write one chunk per event that carries text, then the finish chunk, usage and [DONE].

    The response starts with the first token, so a request that times out in the queue
    still gets a plain HTTP error.
    """
    events = scheduled_events(request, stream)
    first_event = await anext(events)
    response = await open_sse(request, {"X-Request-Id": request["request_id"]})
    if first is not None:
        await send_event(response, first)
    pending: list[TokenLogprob] = []
    async for event in prepend(first_event, events):
        if event.error:
            await send_event(response, {"error": {"message": event.error, "type": "internal_error",
                                                  "param": None, "code": None}})
            return response
        pending.extend(event.logprobs or [])
        if event.text:
            await send_event(response, make_chunk(event.text, pending, None))
            pending = []
        if event.finished:
            await send_event(response, make_chunk("", pending, finish_reason(event)))
            if include_usage:
                await send_event(response, {**base, "choices": [], "usage": usage(event)})
    await send_event(response, "[DONE]")
    return response


async def with_abort_on_disconnect(request: web.Request, stream: RequestStream, run):
    try:
        return await run
    finally:
        if not stream.finished:  # client went away (cancelled handler or reset write)
            request.app[ROUTER].abort(stream)
            request.app[METRICS].requests.labels(stream.model.name, "abort").inc()


# ---- chat ------------------------------------------------------------------------------


def token_text(model: ServedModel, token_id: int) -> str:
    return model.tokenizer.decode([token_id])


def chat_logprobs(model: ServedModel, items: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(model, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items
    ]}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionRequest)
    model = served_model(request, body.model)
    check_model_access(request, model.name)
    check_priority_access(request, body.priority)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        rendered = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises on conversations the template rejects
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc
    prompt_ids = model.tokenizer.encode(rendered, add_special_tokens=False)
    want_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(request, body, body.max_completion_tokens or body.max_tokens, len(prompt_ids), model,
                             want_logprobs)
    stream = submit(request, model, prompt_ids, params, body.priority)
    base = {"id": f"chatcmpl-{stream.request_id}", "created": int(time.time()), "model": model.name}

    if not body.stream:
        async def run() -> web.Response:
            out = await collect(request, stream)
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": chat_logprobs(model, out.logprobs) if body.logprobs else None,
                      "finish_reason": finish_reason(out.last)}
            result = {**base, "object": "chat.completion", "choices": [choice], "usage": usage(out.last)}
            return json_response(result, headers={"X-Request-Id": request["request_id"]})
        return await with_abort_on_disconnect(request, stream, run())

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_base = {**base, "object": "chat.completion.chunk"}
    if include_usage:
        chunk_base["usage"] = None

    def make_chunk(text: str, logprobs: list[TokenLogprob], finish: str | None) -> dict:
        delta = {"content": text} if text else {}
        lp = chat_logprobs(model, logprobs) if body.logprobs and logprobs else None
        return {**chunk_base, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    first = {**chunk_base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
    return await with_abort_on_disconnect(
        request, stream, stream_sse(request, stream, make_chunk, chunk_base, include_usage, first)
    )


# ---- completions -----------------------------------------------------------------------


def completion_logprobs(model: ServedModel, items: list[TokenLogprob], offset: int) -> dict:
    tokens, offsets = [], []
    for lp in items:
        tokens.append(token_text(model, lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{token_text(model, t): v for t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionRequest)
    model = served_model(request, body.model)
    check_model_access(request, model.name)
    check_priority_access(request, body.priority)
    if isinstance(body.prompt, str):
        prompt_ids = model.tokenizer.encode(body.prompt)
    else:
        vocab = model.vocab_size
        if any(not 0 <= t < vocab for t in body.prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        prompt_ids = list(body.prompt)
    params = sampling_params(request, body, body.max_tokens or 16, len(prompt_ids), model, body.logprobs)
    stream = submit(request, model, prompt_ids, params, body.priority)
    base = {"id": f"cmpl-{stream.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": model.name}

    if not body.stream:
        async def run() -> web.Response:
            out = await collect(request, stream)
            lp = completion_logprobs(model, out.logprobs, 0) if body.logprobs is not None else None
            choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": finish_reason(out.last)}
            return json_response({**base, "choices": [choice], "usage": usage(out.last)},
                                 headers={"X-Request-Id": request["request_id"]})
        return await with_abort_on_disconnect(request, stream, run())

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_base = {**base, "usage": None} if include_usage else base
    sent = [0]

    def make_chunk(text: str, logprobs: list[TokenLogprob], finish: str | None) -> dict:
        lp = completion_logprobs(model, logprobs, sent[0]) if body.logprobs is not None and logprobs else None
        sent[0] += len(text)
        return {**chunk_base, "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

    return await with_abort_on_disconnect(
        request, stream, stream_sse(request, stream, make_chunk, chunk_base, include_usage)
    )


async def list_models(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    models = [m for m in request.app[ROUTER].models.values() if tenant.allows_model(m.name)]
    data = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "galley",
             "max_model_len": m.max_model_len} for m in models]
    return json_response({"object": "list", "data": data})


ROUTES = [
    Route("GET", "/v1/models", list_models, "List the served models", response=ModelList),
    Route("POST", "/v1/chat/completions", chat_completions, "Create a chat completion",
          request=ChatCompletionRequest, response=ChatCompletion, stream_response=ChatCompletionChunk),
    Route("POST", "/v1/completions", completions, "Create a text completion",
          request=CompletionRequest, response=Completion, stream_response=Completion),
]
