"""What chat and text completions share: how a planned generation is answered, written once.

Four ways, tried in order: n > 1 choices (one parent request, streamed merged or collected); a
response-cache hit; a plain collected answer; a live, resumable stream (streamed, or followed to
its end for a conversation turn, whose answer the stream stores). Only the choice's shape
differs between chat and text completions (`Shape`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from api.auth import caller_of
from api.context import INFERENCE
from api.errors import json_response
from api.openai import cached as completion_cache
from api.openai.chunks import error_chunk, event_chunks, role_chunk
from api.openai.schemas import SamplingFields
from api.sse import Frame, serve_sse
from api.streams import serve_live
from services.inference.choices import Choices
from services.inference.events import Answer, failure, generation_failed, usage, usage_n
from services.inference.generation import Plan
from services.streams.events import ChunkFormat, StreamEvent


@dataclass(frozen=True)
class Shape:
    """How one kind of completion shows its answer."""

    object: str  # the JSON answer's `object`
    choice: Callable[[ChunkFormat, Any, int, Answer], dict]  # (format, tokenizer, index, answer) -> a choice
    resumable: bool  # the JSON answer names its stream (X-Stream-Id): chat does, text completions never did


async def answer(request: web.Request, body: SamplingFields, plan: Plan, shape: Shape) -> web.StreamResponse:
    inference, caller = request.app[INFERENCE], caller_of(request)
    tokenizer = plan.model.tokenizer
    if plan.ask.n > 1:
        choices = inference.submit_n(caller, plan)
        fmt = inference.format(plan, uuid.uuid4().hex)
        if body.stream:
            return await serve_sse(request, choice_frames(fmt, tokenizer, choices),
                                   {"X-Request-Id": request["request_id"]})
        answers = await choices.collect()
        return render(request, shape, fmt, [shape.choice(fmt, tokenizer, i, a) for i, a in enumerate(answers)],
                      usage_n([a.usage for a in answers]), resumable=False)
    key = completion_cache.completion_key(request, body, plan.model, plan.prompt_ids, plan.params)
    cached = completion_cache.lookup(request, plan.model, key)
    if cached is not None:
        fmt = inference.format(plan, uuid.uuid4().hex)
        if body.stream:
            return await completion_cache.replay(request, fmt, cached)
        hit = Answer(cached.text, [], cached.finish_reason, cached.usage)
        return render(request, shape, fmt, [shape.choice(fmt, None, 0, hit)], hit.usage)
    started = await inference.start(caller, plan)
    if not body.stream and not plan.conversation_id:
        result = await inference.collect(started.stream)
        completion_cache.remember(request, key, result.text, result.finish_reason, result.usage)
        return render(request, shape, started.fmt, [shape.choice(started.fmt, tokenizer, 0, result)], result.usage)
    live = inference.go_live(plan, started)
    if body.stream:
        response = await serve_live(request, live)
        completion_cache.remember_live(request, key, live)
        return response
    result = await inference.collect_live(live)
    return render(request, shape, started.fmt, [shape.choice(started.fmt, tokenizer, 0, result)], result.usage)


def render(request: web.Request, shape: Shape, fmt: ChunkFormat, choices: list[dict], usage_: dict,
           resumable: bool = True) -> web.Response:
    body = {"id": fmt.id, "object": shape.object, "created": fmt.created, "model": fmt.model,
            "choices": choices, "usage": usage_}
    headers = {"X-Request-Id": request["request_id"]}
    if resumable and shape.resumable:
        headers["X-Stream-Id"] = fmt.id
    return json_response(body, headers=headers)


async def choice_frames(fmt: ChunkFormat, tokenizer: Any, choices: Choices) -> AsyncGenerator[Frame, None]:
    """n choices as one SSE stream: chunks in the order their tokens come, each with its choice's
    index; with `include_usage`, one usage chunk over all choices at the end. Not resumable (no
    X-Stream-Id). A failure before the first token is a plain HTTP error, after it an error chunk."""
    n = len(choices)
    counts, offsets, usages, opened = [0] * n, [0] * n, [], False
    events = choices.events()
    try:
        async for index, event in events:
            failed = isinstance(event, Exception) or event.error is not None
            if failed and not opened:
                raise event if isinstance(event, Exception) else generation_failed(event)
            if not opened:
                opened = True
                yield None
                for i in range(n if fmt.kind == "chat" else 0):
                    chunk = role_chunk(fmt)
                    chunk["choices"][0]["index"] = i
                    yield chunk, None
            if failed:
                error = failure(event) if isinstance(event, Exception) else generation_failed(event)
                yield error_chunk(StreamEvent(counts[index], "", offsets[index], error=error.message,
                                              error_code=error.code)), None
                return
            finish = event.finish_reason.value if event.finish_reason else None
            for chunk in event_chunks(fmt, tokenizer, StreamEvent(counts[index], event.text, offsets[index],
                                                                  event.logprobs, finish)):
                chunk["choices"][0]["index"] = index
                yield chunk, None
            counts[index] += 1
            offsets[index] += len(event.text)
            if event.finished:
                usages.append(usage(event))
        if fmt.include_usage:
            yield {**fmt.base, "choices": [], "usage": usage_n(usages)}, None
        yield "[DONE]", None
    finally:
        await events.aclose()
