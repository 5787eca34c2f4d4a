"""The native generation API: POST /api/v1/generate and /api/v1/models/{name}/generate.

Generation takes the same service path as the OpenAI routes (`services.inference`: plan,
admission, the first-event timeout); only the wire format differs: `{"text", ...}` or SSE events
`{"token": "..."}` then `{"type": "done", "usage": {...}}`. Deterministic requests (greedy or
seeded) that do not stream are answered from the response cache when they can be.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from aiohttp import web

from api.auth import caller_of
from api.errors import error_body, json_response
from api.native.schemas import GenerateEvent, GenerateRequest, GenerateResponse, NamedGenerateRequest
from api.response_cache import cache_flag
from api.routes import Route
from api.services import services
from api.sse import Frame, serve_sse
from api.validation import parse_body
from services.answers import generation_failed, prepend, usage
from services.inference import Generated, Inference, PromptInput

DEFAULT_MAX_TOKENS = 128


def named_model(request: web.Request) -> str | None:
    """The model the path names (`/api/v1/models/{name}/...`): its body then has no `model`."""
    return request.match_info.get("name")


def prompt_input(body: GenerateRequest, name: str | None) -> PromptInput:
    """The body as the inference service takes it; max_tokens defaults to 128 within the context."""
    return PromptInput(**{**body.generation_fields(), "model": name or body.model}, max_tokens=body.max_tokens,
                       prompt=body.prompt, default_max_tokens=DEFAULT_MAX_TOKENS, default_within_context=True)


async def generate(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    name = named_model(request)
    body = await parse_body(request, GenerateRequest if name is None else NamedGenerateRequest)
    inference = services(request).inference
    generated = await inference.generate(
        caller_of(request), prompt_input(body, name), stream=body.streamed,
        cache_asked=cache_flag(request, body.galley))
    headers = {"X-Request-Id": request["request_id"]}  # X-Model-Version: set by the lifecycle's routing
    if generated.stream is not None:
        return await serve_sse(request, generation_frames(inference, generated), headers)
    return json_response({**generated.result, "latency_ms": round((time.monotonic() - started) * 1000, 3)},
                         headers=headers)


async def generation_frames(inference: Inference, generated: Generated) -> AsyncGenerator[Frame, None]:
    """SSE `{"token"}` events then one `{"type": "done"}`; an error before the first token is a plain
    HTTP error, after it an `{"type": "error"}` event. A client that leaves aborts the generation."""
    stream = generated.stream
    try:
        events = inference.events(stream)
        first = await anext(events)
        if first.error:
            raise generation_failed(first)
        yield None
        async for event in prepend(first, events):
            if event.error:
                failed = generation_failed(event)
                yield {"type": "error", **error_body(failed.message, failed.type, code=failed.code)}, None
                break
            if event.text:
                yield {"token": event.text}, None
            if event.finished:
                yield {"type": "done", "usage": usage(event), "finish_reason": event.finish_reason.value,
                       "model_version": generated.model.version}, None
    finally:
        inference.abort(stream)  # unless it finished: the client went away


async def generate_named(request: web.Request) -> web.StreamResponse:
    return await generate(request)


ROUTES = [
    Route("POST", "/api/v1/generate", generate, "Generate text (native; SSE with `stream`)",
          request=GenerateRequest, response=GenerateResponse, stream_response=GenerateEvent),
    Route("POST", "/api/v1/models/{name}/generate", generate_named,
          "Generate text with the model in the path (native; SSE with `stream`)",
          request=NamedGenerateRequest, response=GenerateResponse, stream_response=GenerateEvent),
]
