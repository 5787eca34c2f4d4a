"""What chat and text completions share: rendering the service's `Outcome`, written once.

The service (`Inference.chat`, `Inference.complete`) decides how a planned generation is answered (n > 1 choices,
a cache hit, a collected answer, a live stream); this module shows it as JSON or SSE. Only the
choice's shape differs between chat and text completions (`Shape`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from api.errors import json_response
from api.openai.cached import replay
from api.openai.chunks import error_chunk, event_chunks, opening_chunks
from api.openai.schemas import SamplingFields
from api.response_cache import cache_flag
from api.sse import Frame, serve_sse
from api.streams import serve_live
from services.answers import Answer, AnswerReader, ChunkFormat, StreamEvent, failure, generation_failed, usage, usage_n
from services.inference import Choices, Outcome


@dataclass(frozen=True)
class Shape:
    """How one kind of completion shows its answer."""

    object: str  # the JSON answer's `object`
    choice: Callable[[ChunkFormat, Any, int, Answer], dict]  # (format, tokenizer, index, answer) -> a choice
    resumable: bool  # the JSON answer names its stream (X-Stream-Id): chat does, text completions never did


def how(request: web.Request, body: SamplingFields) -> dict[str, Any]:
    """How the service answers this request: streamed or not, and what it asked of the response cache."""
    return {"stream": body.streamed, "cache_asked": cache_flag(request, body.galley)}


async def respond(request: web.Request, outcome: Outcome, shape: Shape) -> web.StreamResponse:
    """The service's answer as JSON, or as SSE (merged choices, a cached replay, a live stream)."""
    fmt, tokenizer, headers = outcome.fmt, outcome.model.tokenizer, {"X-Request-Id": request["request_id"]}
    if outcome.choices is not None:
        frames = choice_frames(fmt, tokenizer, outcome.choices)
        return await serve_sse(request, frames, headers)
    if outcome.cached is not None:
        return await replay(request, fmt, outcome.cached)
    if outcome.live is not None:
        response = await serve_live(request, outcome.live)
        outcome.served()
        return response
    answers = outcome.answers
    usage_ = answers[0].usage if len(answers) == 1 else usage_n([a.usage for a in answers], outcome.n)
    return render(request, shape, fmt, [shape.choice(fmt, tokenizer, i, a) for i, a in enumerate(answers)], usage_,
                  outcome.resumable)


def render(request: web.Request, shape: Shape, fmt: ChunkFormat, choices: list[dict], usage_: dict,
           resumable: bool = True) -> web.Response:
    body = {"id": fmt.id, "object": shape.object, "created": fmt.created, "model": fmt.model,
            "choices": choices, "usage": usage_}
    headers = {"X-Request-Id": request["request_id"]}
    if resumable and shape.resumable:
        headers["X-Stream-Id"] = fmt.id
    return json_response(body, headers=headers)


async def choice_frames(fmt: ChunkFormat, tokenizer: Any, choices: Choices) -> AsyncGenerator[Frame, None]:
    """Several choices as one SSE stream: chunks in the order their tokens come, each with its
    choice's index; with `include_usage`, one usage chunk over all choices at the end. Not
    resumable (no X-Stream-Id). A failure before the first token is a plain HTTP error, after it
    an error chunk. Each choice is read as one stream's would be (`AnswerReader`)."""
    n = len(choices)
    counts, offsets, usages, opened = [0] * n, [0] * n, [None] * n, False
    readers = [AnswerReader.of(fmt, i) for i in range(n)]
    events = choices.events()
    try:
        async for index, event in events:
            failed = isinstance(event, Exception) or event.error is not None
            if failed and not opened:
                raise event if isinstance(event, Exception) else generation_failed(event)
            if not opened:
                opened = True
                yield None
                for i in range(n):
                    for chunk in opening_chunks(fmt, i, choices.num_prompt_tokens(i)):
                        yield chunk, None
            if failed:
                error = failure(event) if isinstance(event, Exception) else generation_failed(event)
                yield error_chunk(StreamEvent(counts[index], "", offsets[index], error=error.message,
                                              error_code=error.code)), None
                return
            finish = event.finish_reason.value if event.finish_reason else None
            step = StreamEvent(counts[index], event.text, offsets[index], event.logprobs, finish,
                               has_token=bool(event.token_ids), num_prompt_tokens=event.num_prompt_tokens,
                               num_output_tokens=event.num_output_tokens)
            for chunk in event_chunks(fmt, tokenizer, readers[index].read(step)):
                chunk["choices"][0]["index"] = index
                yield chunk, None
            counts[index] += 1
            offsets[index] += len(event.text)
            if event.finished:
                usages[index] = usage(event)
        if fmt.include_usage:
            yield {**fmt.base, "choices": [], "usage": usage_n(usages, choices.n)}, None
        yield "[DONE]", None
    finally:
        await events.aclose()
