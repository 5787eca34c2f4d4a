"""The native generation API: POST /api/v1/generate and /api/v1/models/{name}/generate.

Generation reuses the OpenAI handlers' engine path (`sampling_params`, `submit`, `collect`,
`scheduled_events`); only the wire format differs: `{"text", ...}` or SSE events
`{"token": "..."}` then `{"type": "done", "usage": {...}}`. Deterministic requests (greedy or
seeded) that do not stream are answered from the response cache when they can be.
"""

from __future__ import annotations

import time

from aiohttp import web

from api.auth import check_priority_access
from api.context import RESPONSE_CACHE, ROUTER
from api.errors import error_body, json_response
from api.native.schemas import GenerateEvent, GenerateRequest, GenerateResponse, NamedGenerateRequest
from api.response_cache import generation_key, lookup
from api.openai.chat import collect, finish_reason, generation_failed, sampling_params, scheduled_events, submit, usage
from api.routes import Route
from api.sse import open_sse, send_event
from api.validation import parse_body
from scheduling.router import RequestStream, ServedModel
from services.deployments.manager import model_label, resolve_model
from services.inference.prompts import encode_prompt
from services.streams.hub import prepend

DEFAULT_MAX_TOKENS = 128


def named_model(request: web.Request) -> str | None:
    """The model the path names (`/api/v1/models/{name}/...`): its body then has no `model`."""
    return request.match_info.get("name")


async def generate(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    name = named_model(request)
    body = await parse_body(request, GenerateRequest if name is None else NamedGenerateRequest)
    model = await resolve_model(request, name or body.model, user=body.user)
    check_priority_access(request, body.priority)
    prompt_ids = await encode_prompt(model, body.prompt)
    default = max(1, min(DEFAULT_MAX_TOKENS, model.max_model_len - len(prompt_ids)))
    params = sampling_params(request, body, body.max_tokens, len(prompt_ids), model, None, default_max_tokens=default)
    headers = {"X-Request-Id": request["request_id"]}  # X-Model-Version: set by the lifecycle's routing
    if body.stream:
        return await stream_generation(request, model, submit(request, model, prompt_ids, params, body.priority),
                                       headers)
    key = generation_key(request, body, model, prompt_ids, params, "native")
    result = lookup(request, model, key)
    if result is None:
        text, _, last = await collect(request, submit(request, model, prompt_ids, params, body.priority))
        result = {"model": model_label(request, model), "text": text,
                  "finish_reason": finish_reason(last.finish_reason), "usage": usage(last),
                  "model_version": model.version}
        request.app[RESPONSE_CACHE].remember(key, result)
    return json_response({**result, "latency_ms": round((time.monotonic() - started) * 1000, 3)}, headers=headers)


async def stream_generation(request: web.Request, model: ServedModel, stream: RequestStream,
                            headers: dict[str, str]) -> web.StreamResponse:
    """SSE `{"token"}` events then one `{"type": "done"}`; an error before the first token is a plain
    HTTP error, after it an `{"type": "error"}` event. A client that leaves aborts the generation."""
    try:
        events = scheduled_events(request, stream)
        first = await anext(events)
        if first.error:
            raise generation_failed(first)
        response = await open_sse(request, headers)
        async for event in prepend(first, events):
            if event.error:
                failed = generation_failed(event)
                body = error_body(failed.message, failed.type, code=failed.code)
                await send_event(response, {"type": "error", **body})
                break
            if event.text:
                await send_event(response, {"token": event.text})
            if event.finished:
                await send_event(response, {"type": "done", "usage": usage(event),
                                            "finish_reason": event.finish_reason.value,
                                            "model_version": model.version})
        return response
    finally:
        if not stream.finished:  # the client went away: the handler was cancelled
            request.app[ROUTER].abort(stream)


async def generate_named(request: web.Request) -> web.StreamResponse:
    return await generate(request)


ROUTES = [
    Route("POST", "/api/v1/generate", generate, "Generate text (native; SSE with `stream`)",
          request=GenerateRequest, response=GenerateResponse, stream_response=GenerateEvent),
    Route("POST", "/api/v1/models/{name}/generate", generate_named,
          "Generate text with the model in the path (native; SSE with `stream`)",
          request=NamedGenerateRequest, response=GenerateResponse, stream_response=GenerateEvent),
]
