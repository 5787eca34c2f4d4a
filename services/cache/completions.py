"""The response cache for /v1/completions and /v1/chat/completions.

A deterministic request (greedy or seeded) with no logprobs and no conversation is looked up by
(tenant, model version, prompt token ids after the chat template, sampling parameters); a hit
is answered without the engine, as JSON or as an SSE stream of the live chunk shapes, under a
fresh id. Streamed and non-streamed requests share entries (same generation, same output).
Conversation turns are never cached: they write history. A replayed stream is not resumable
(it has no `X-Stream-Id`): it is written in one go.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from api.context import METRICS
from api.openai.chunks import ChunkFormat, StreamEvent, event_chunks, role_chunk
from api.openai.schemas import SamplingFields
from api.sse import open_sse, send_event
from engine.types import SamplingParams
from scheduling.router import ServedModel
from services.cache.responses import RESPONSE_CACHE, admit_hit, cache_key, cache_scope, mark_lookup, wants_cache
from services.streams.hub import LiveStream, params_to_json

FINISHED = ("stop", "length")  # only complete answers are stored


@dataclass(frozen=True)
class CachedCompletion:
    text: str
    finish_reason: str
    usage: dict


def completion_key(request: web.Request, body: SamplingFields, model: ServedModel, prompt_ids: list[int],
                   params: SamplingParams) -> str | None:
    """The cache key of a request whose answer may come from (and go to) the cache, else None."""
    deterministic = params.temperature == 0 or params.seed is not None
    if not deterministic or params.logprobs is not None or getattr(body, "conversation_id", None):
        return None
    if not wants_cache(request, body.galley.cache if body.galley else None):
        return None
    # "api" keeps these entries apart from native generate's, which hold another shape
    return cache_key(cache_scope(request), model.name, model.version, prompt_ids,
                     {**params_to_json(params), "api": "openai"})


def lookup(request: web.Request, model: ServedModel, key: str | None) -> CachedCompletion | None:
    """The cached answer for `key` (None: not cacheable, or a miss); counts the hit or miss."""
    if key is None:
        return None
    found = request.app[RESPONSE_CACHE].get(key)
    if found is not None:
        admit_hit(request, model.name)
    metrics = request.app[METRICS]
    (metrics.cache_hits if found is not None else metrics.cache_misses).labels(model.name).inc()
    mark_lookup(request, found is not None)
    return found


def remember(request: web.Request, key: str | None, text: str, finish: str | None, usage: dict | None) -> None:
    if key is not None and finish in FINISHED and usage is not None:
        request.app[RESPONSE_CACHE].put(key, CachedCompletion(text, finish, usage))


def remember_live(request: web.Request, key: str | None, live: LiveStream) -> None:
    """Store a streamed answer once its stream has finished normally."""
    if key is None or not live.done or live.status != "finished" or not live.events:
        return
    last = live.events[-1]
    remember(request, key, "".join(e.text for e in live.events), last.finish_reason, last.usage)


async def replay(request: web.Request, fmt: ChunkFormat, answer: CachedCompletion) -> web.StreamResponse:
    """A cached answer as a stream: (chat: the role chunk), one text chunk, the finish chunk,
    the usage chunk when asked for, `[DONE]`."""
    response = await open_sse(request, {"X-Request-Id": request["request_id"]})
    if fmt.kind == "chat":
        await send_event(response, role_chunk(fmt))
    event = StreamEvent(0, answer.text, 0, finish_reason=answer.finish_reason, usage=answer.usage)
    for chunk in event_chunks(fmt, None, event):
        await send_event(response, chunk)
    await send_event(response, "[DONE]")
    return response
