"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions.

Handlers validate with the pydantic schemas, build a `GenerationRequest`, submit it through
the router and turn token events into OpenAI's exact JSON (streamed as SSE or collected).
A client that goes away aborts its request, so its KV blocks free within one step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from api.auth import check_priority_access, request_priority, tenant_limits, tenant_of
from api.context import ADMISSION, METRICS, ROUTER
from api.errors import json_response
from api.openai import cached as completion_cache
from api.openai.chunks import ChunkFormat, StreamEvent, chat_logprobs, completion_logprobs, event_chunks, role_chunk
from api.openai.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
    SamplingFields,
)
from api.routes import Route
from api.sse import open_sse, send_event
from api.streams import collect_live, error_chunk, serve_live
from api.validation import parse_body
from engine.types import SamplingParams, TokenEvent, TokenLogprob
from scheduling.deployments import parse_model_ref
from scheduling.router import RequestStream, ServedModel
from services.deployments.manager import DRAINING_RETRY_AFTER_S, MODELS, model_label, resolve_model
from services.deployments.shadow import mirror_request
from services.errors import (
    SHUTTING_DOWN,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ServiceError,
    ServiceUnavailableError,
)
from services.inference.prompts import check_token_ids, encode_chat, encode_prompt
from services.streams.hub import HUB, LiveStream
from storage import conversations

log = structlog.get_logger(__name__)


def sampling_params(request: web.Request, body: SamplingFields, max_tokens: int | None, prompt_len: int,
                    model: ServedModel, logprobs: int | None, default_max_tokens: int | None = None) -> SamplingParams:
    """`max_tokens` as asked (over the API key's cap: 400); when not asked, `default_max_tokens`
    within the cap, else the rest of the context within the cap."""
    cap = tenant_of(request).max_tokens
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, over this API key's cap of {cap}", param="max_tokens")
    if max_tokens is None and default_max_tokens is not None:
        max_tokens = default_max_tokens if cap is None else min(default_max_tokens, cap)
    room = model.max_model_len - prompt_len
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        asked = f"{prompt_len} in the prompt" + (f" and {max_tokens} for the completion" if max_tokens else "")
        raise InvalidRequestError(
            f"This model's maximum context length is {model.max_model_len} tokens, "
            f"but you requested {prompt_len + (max_tokens or 0)} tokens ({asked}).",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if cap is not None:
        room = min(room, cap)
    check_token_ids(model, body.stop_token_ids or [], "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens or room,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def submit(request: web.Request, model: ServedModel, prompt_ids: list[int], params: SamplingParams,
           priority: str | None) -> RequestStream:
    priority = request_priority(request, priority)
    limits, weight = tenant_limits(request)
    stream = request.app[ADMISSION].generation(model, prompt_ids, params, limits, weight, priority)
    mirror_request(request, stream)
    return stream


async def scheduled_events(request: web.Request, stream: RequestStream) -> AsyncIterator[TokenEvent]:
    """The stream's events; if the first does not come within the queue timeout, abort with 503."""
    timeout_s = request.app[ROUTER].queue_timeout_s
    events = request.app[METRICS].observe(stream, timeout_s)
    try:
        first = await anext(events)
    except TimeoutError:
        request.app[ROUTER].abort(stream)
        raise ServiceUnavailableError(
            f"the request waited {timeout_s:g}s without being scheduled (queue_timeout_seconds); "
            "the server is overloaded, retry later",
            code="queue_timeout", retry_after_s=5,
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


def finish_reason(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else None


async def collect(request: web.Request, stream: RequestStream) -> tuple[str, list[TokenLogprob], TokenEvent]:
    """A non-streamed, unrecorded generation to its end; the client leaving aborts it."""
    text, logprobs, last = "", [], None
    try:
        async for event in scheduled_events(request, stream):
            text, last = text + event.text, event
            logprobs.extend(event.logprobs or [])
    finally:
        if not stream.finished:  # client went away: the handler was cancelled
            request.app[ROUTER].abort(stream)
    if last.error:
        raise generation_failed(last)
    return text, logprobs, last


def generation_failed(event: TokenEvent) -> ServiceError:
    """A generation that ended with an error: the engine's fixed text, or the end of a drain
    (503 to retry, not a server error)."""
    if event.error_code == SHUTTING_DOWN:
        return ServiceUnavailableError(event.error, code=SHUTTING_DOWN,
                                       retry_after_s=DRAINING_RETRY_AFTER_S)
    return ServiceError(event.error, code="generation_failed")


def failure(exc: Exception) -> ServiceError:
    """An exception as what a client may see: our own errors as they are, anything else logged
    and reduced to a fixed message (exception text can hold paths and other requests' data)."""
    if isinstance(exc, ServiceError):
        return exc
    log.error("request failed", exc_info=exc)
    return ServiceError("internal server error", code="internal_error")


def check_n(body: SamplingFields) -> None:
    if body.n > 1 and getattr(body, "conversation_id", None):
        raise InvalidRequestError("n > 1 cannot continue a conversation: it would not know which choice to keep",
                                  param="n")


def submit_n(request: web.Request, model: ServedModel, prompt_ids: list[int], params: SamplingParams,
             priority: str | None, n: int) -> list[RequestStream]:
    """`n` generations of one prompt, side by side (seeded: seed, seed + 1, ..., so the choices
    differ yet repeat); all or nothing: if one is refused, the others are aborted."""
    streams: list[RequestStream] = []
    priority = request_priority(request, priority)  # once, not per choice
    try:
        for i in range(n):
            seed = None if params.seed is None else (params.seed + i) % 2**63
            streams.append(submit(request, model, prompt_ids, dataclasses.replace(params, seed=seed), priority))
    except Exception:
        for stream in streams:
            request.app[ROUTER].abort(stream)
        raise
    return streams


async def collect_n(request: web.Request, streams: list[RequestStream]) -> list[tuple[str, list[TokenLogprob],
                                                                                       TokenEvent]]:
    tasks = [asyncio.ensure_future(collect(request, stream)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)  # the first failure is raised as it is (a 503 stays a 503)
    finally:
        for task in tasks:  # and cancels the rest: `collect` aborts their generations
            task.cancel()


async def stream_n(request: web.Request, fmt: ChunkFormat, tokenizer: Any,
                   streams: list[RequestStream]) -> web.StreamResponse:
    """The choices as one SSE stream: chunks in the order their tokens come, each with its
    choice's index; with `include_usage`, one usage chunk over all choices at the end. Not
    resumable (no X-Stream-Id). A failure before the first token is a plain HTTP error, after it
    an error chunk; a client that leaves aborts every choice."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for event in scheduled_events(request, stream):
                merged.put_nowait((index, event))
        except Exception as exc:
            merged.put_nowait((index, exc))

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    response, counts, offsets, ends = None, [0] * len(streams), [0] * len(streams), []
    try:
        while len(ends) < len(streams):
            index, event = await merged.get()
            failed = isinstance(event, Exception) or event.error is not None
            if failed and response is None:
                if isinstance(event, Exception):
                    raise event
                raise generation_failed(event)
            if response is None:
                response = await open_sse(request, {"X-Request-Id": request["request_id"]})
                for i in range(len(streams) if fmt.kind == "chat" else 0):
                    chunk = role_chunk(fmt)
                    chunk["choices"][0]["index"] = i
                    await send_event(response, chunk)
            if failed:
                error = failure(event) if isinstance(event, Exception) else generation_failed(event)
                await send_event(response, error_chunk(StreamEvent(counts[index], "", offsets[index],
                                                                   error=error.message, error_code=error.code)))
                return response
            finish = event.finish_reason.value if event.finish_reason else None
            for chunk in event_chunks(fmt, tokenizer, StreamEvent(counts[index], event.text, offsets[index],
                                                                  event.logprobs, finish)):
                chunk["choices"][0]["index"] = index
                await send_event(response, chunk)
            counts[index] += 1
            offsets[index] += len(event.text)
            if event.finished:
                ends.append(event)
        if fmt.include_usage:
            await send_event(response, {**fmt.base, "choices": [], "usage": usage_n(ends)})
        await send_event(response, "[DONE]")
        return response
    finally:
        for task in pumps:
            task.cancel()
        for stream in streams:
            if not stream.finished:
                request.app[ROUTER].abort(stream)


def usage_n(lasts: list[TokenEvent]) -> dict:
    """From each choice's last event: one prompt, counted once; every choice's completion tokens."""
    prompt = lasts[0].num_prompt_tokens
    completion = sum(last.num_output_tokens for last in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def on_disconnect(request: web.Request, body: SamplingFields, conversation: bool) -> str:
    if body.galley and body.galley.on_disconnect:
        return body.galley.on_disconnect
    cfg = request.app[HUB].config
    return cfg.on_disconnect_conversation if conversation else cfg.on_disconnect_plain


# ---- chat ------------------------------------------------------------------------------


async def load_history(request: web.Request, conversation_id: str, model_ref: str) -> tuple[list[dict], str]:
    """The stored messages of the caller's conversation (404 if it is not theirs) and its pinned version."""
    tenant = tenant_of(request).name
    db = request.app[HUB].db

    def read(conn):
        found = conversations.get_conversation(conn, conversation_id, tenant)
        return found, conversations.list_messages(conn, conversation_id) if found else []

    found, messages = await asyncio.to_thread(db.read, read)
    if found is None:
        raise NotFoundError(f"no conversation {conversation_id!r}", param="conversation_id",
                            code="conversation_not_found")
    name, version = parse_model_ref(model_ref)
    if found.model != name or version not in (None, found.model_version):
        raise ConflictError(f"conversation {conversation_id!r} is pinned to {found.model}@{found.model_version}",
                            param="model")
    return [{"role": m.role, "content": m.content} for m in messages], found.model_version


@dataclass
class ChatPlan:
    """A chat request validated and rendered, not yet submitted."""

    model: ServedModel
    prompt_ids: list[int]
    params: SamplingParams
    new_messages: list[dict]


@dataclass
class ChatStart:
    """A chat request validated, rendered and submitted: what its caller streams or collects."""

    model: ServedModel
    stream: RequestStream
    fmt: ChunkFormat
    conversation_id: str | None


async def plan_chat(request: web.Request, body: ChatCompletionRequest) -> ChatPlan:
    """Validate, route and apply the chat template (with the conversation's history)."""
    check_priority_access(request, body.priority)
    new = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    history, pinned = [], None
    if body.conversation_id:
        history, pinned = await load_history(request, body.conversation_id, body.model)
    model = await resolve_model(request, body.model, user=body.user, conversation_id=body.conversation_id,
                                pinned_version=pinned)
    prompt_ids = await encode_chat(model, history + new)
    want_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(request, body, body.max_completion_tokens or body.max_tokens, len(prompt_ids), model,
                             want_logprobs)
    return ChatPlan(model, prompt_ids, params, new)


def chat_format(request: web.Request, body: ChatCompletionRequest, model: ServedModel, chunk_id: str) -> ChunkFormat:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return ChunkFormat("chat", chunk_id, int(time.time()), model_label(request, model), include_usage, body.logprobs)


async def submit_chat(request: web.Request, body: ChatCompletionRequest, plan: ChatPlan) -> ChatStart:
    """Submit a planned chat; store the new messages of a conversation. Nothing owns the stream until
    this returns, so if the write fails (or the client leaves during it) the generation is aborted:
    left running it would hold a slot to the end of the context for no one."""
    stream = submit(request, plan.model, plan.prompt_ids, plan.params, body.priority)
    fmt = chat_format(request, body, plan.model, f"chatcmpl-{stream.request_id}")
    if body.conversation_id:
        conversation_id = body.conversation_id
        try:
            await asyncio.wrap_future(request.app[HUB].db.write(lambda db: [
                conversations.add_message(db, conversation_id, m["role"], m["content"]) for m in plan.new_messages]))
        except BaseException as exc:
            request.app[ROUTER].abort(stream)
            if isinstance(exc, conversations.ConversationNotFoundError):  # deleted meanwhile
                raise NotFoundError(f"no conversation {conversation_id!r}", param="conversation_id",
                                    code="conversation_not_found") from exc
            raise
    return ChatStart(plan.model, stream, fmt, body.conversation_id)


async def start_chat(request: web.Request, body: ChatCompletionRequest) -> ChatStart:
    """Plan and submit a chat (one choice, as the WebSocket streams it)."""
    if body.n > 1:
        raise InvalidRequestError("a chat over the WebSocket streams one choice: n must be 1", param="n")
    return await submit_chat(request, body, await plan_chat(request, body))


def start_live_chat(request: web.Request, body: ChatCompletionRequest, chat: ChatStart) -> LiveStream:
    return request.app[HUB].start(chat.stream, chat.fmt, kind="chat", conversation_id=chat.conversation_id,
                                  on_disconnect=on_disconnect(request, body, bool(chat.conversation_id)))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionRequest)
    check_n(body)
    plan = await plan_chat(request, body)
    if body.n > 1:
        streams = submit_n(request, plan.model, plan.prompt_ids, plan.params, body.priority, body.n)
        fmt = chat_format(request, body, plan.model, f"chatcmpl-{uuid.uuid4().hex}")
        if body.stream:
            return await stream_n(request, fmt, plan.model.tokenizer, streams)
        results = await collect_n(request, streams)
        choices = [chat_choice(fmt, plan.model.tokenizer, i, text, logprobs, finish_reason(last.finish_reason))
                   for i, (text, logprobs, last) in enumerate(results)]
        return chat_body(request, fmt, choices, usage_n([last for _, _, last in results]), resumable=False)
    key = completion_cache.completion_key(request, body, plan.model, plan.prompt_ids, plan.params)
    cached = completion_cache.lookup(request, plan.model, key)
    if cached is not None:
        fmt = chat_format(request, body, plan.model, f"chatcmpl-{uuid.uuid4().hex}")
        if body.stream:
            return await completion_cache.replay(request, fmt, cached)
        return chat_response(request, fmt, None, cached.text, [], cached.finish_reason, cached.usage)
    chat = await submit_chat(request, body, plan)
    if not body.stream and not body.conversation_id:
        text, logprobs, last = await collect(request, chat.stream)
        finish = finish_reason(last.finish_reason)
        completion_cache.remember(request, key, text, finish, usage(last))
        return chat_response(request, chat.fmt, chat.model.tokenizer, text, logprobs, finish, usage(last))
    live = start_live_chat(request, body, chat)
    if body.stream:
        response = await serve_live(request, live)
        completion_cache.remember_live(request, key, live)
        return response
    text, logprobs, last = await collect_live(request, live)
    return chat_response(request, chat.fmt, chat.model.tokenizer, text, logprobs, finish_reason(last.finish_reason),
                         last.usage)


def chat_response(request: web.Request, fmt: ChunkFormat, tokenizer: Any, text: str, logprobs: list[TokenLogprob],
                  finish: str | None, usage_: dict) -> web.Response:
    return chat_body(request, fmt, [chat_choice(fmt, tokenizer, 0, text, logprobs, finish)], usage_)


def chat_choice(fmt: ChunkFormat, tokenizer: Any, index: int, text: str, logprobs: list[TokenLogprob],
                finish: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(tokenizer, logprobs) if fmt.logprobs else None,
            "finish_reason": finish}


def chat_body(request: web.Request, fmt: ChunkFormat, choices: list[dict], usage_: dict,
              resumable: bool = True) -> web.Response:
    body = {"id": fmt.id, "object": "chat.completion", "created": fmt.created, "model": fmt.model,
            "choices": choices, "usage": usage_}
    headers = {"X-Request-Id": request["request_id"]} | ({"X-Stream-Id": fmt.id} if resumable else {})
    return json_response(body, headers=headers)


# ---- completions -----------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionRequest)
    check_n(body)
    model = await resolve_model(request, body.model, user=body.user)
    check_priority_access(request, body.priority)
    prompt_ids = await encode_prompt(model, body.prompt)
    params = sampling_params(request, body, body.max_tokens, len(prompt_ids), model, body.logprobs,
                             default_max_tokens=16)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.n > 1:
        streams = submit_n(request, model, prompt_ids, params, body.priority, body.n)
        fmt = ChunkFormat("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_label(request, model),
                          include_usage, body.logprobs is not None)
        if body.stream:
            return await stream_n(request, fmt, model.tokenizer, streams)
        results = await collect_n(request, streams)
        choices = [completion_choice(i, text, completion_logprobs(model.tokenizer, logprobs, 0) if fmt.logprobs
                                     else None, finish_reason(last.finish_reason))
                   for i, (text, logprobs, last) in enumerate(results)]
        return completion_body(request, fmt, choices, usage_n([last for _, _, last in results]))
    key = completion_cache.completion_key(request, body, model, prompt_ids, params)
    cached = completion_cache.lookup(request, model, key)
    if cached is not None:
        fmt = ChunkFormat("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_label(request, model),
                          include_usage)
        if body.stream:
            return await completion_cache.replay(request, fmt, cached)
        return completion_response(request, fmt, cached.text, None, cached.finish_reason, cached.usage)
    stream = submit(request, model, prompt_ids, params, body.priority)
    fmt = ChunkFormat("completion", f"cmpl-{stream.request_id}", int(time.time()), model_label(request, model),
                      include_usage, body.logprobs is not None)

    if body.stream:
        live = request.app[HUB].start(stream, fmt, kind="completion", conversation_id=None,
                                      on_disconnect=on_disconnect(request, body, False))
        response = await serve_live(request, live)
        completion_cache.remember_live(request, key, live)
        return response
    text, logprobs, last = await collect(request, stream)
    lp = completion_logprobs(model.tokenizer, logprobs, 0) if fmt.logprobs else None
    finish = finish_reason(last.finish_reason)
    completion_cache.remember(request, key, text, finish, usage(last))
    return completion_response(request, fmt, text, lp, finish, usage(last))


def completion_response(request: web.Request, fmt: ChunkFormat, text: str, logprobs: dict | None,
                        finish: str | None, usage_: dict) -> web.Response:
    return completion_body(request, fmt, [completion_choice(0, text, logprobs, finish)], usage_)


def completion_choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_body(request: web.Request, fmt: ChunkFormat, choices: list[dict], usage_: dict) -> web.Response:
    result = {"id": fmt.id, "object": "text_completion", "created": fmt.created, "model": fmt.model,
              "choices": choices, "usage": usage_}
    return json_response(result, headers={"X-Request-Id": request["request_id"]})


async def list_models(request: web.Request) -> web.Response:
    """Every registered model (generate, embed, classify) the caller's tenant may use, loaded or cold."""
    tenant = tenant_of(request)
    data = [card for card in request.app[MODELS].catalog() if tenant.allows_model(card["id"])]
    return json_response({"object": "list", "data": data})


ROUTES = [
    Route("GET", "/v1/models", list_models, "List the served models", response=ModelList),
    Route("POST", "/v1/chat/completions", chat_completions, "Create a chat completion",
          request=ChatCompletionRequest, response=ChatCompletion, stream_response=ChatCompletionChunk,
          errors=(409,)),
    Route("POST", "/v1/completions", completions, "Create a text completion",
          request=CompletionRequest, response=Completion, stream_response=Completion),
]
