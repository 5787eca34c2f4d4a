"""Resumable streams over HTTP: serve a live stream as SSE from any event, and
`GET /api/v1/streams/{stream_id}` to reconnect (Last-Event-ID or ?after=N)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from aiohttp import web
from pydantic import BaseModel, Field

from api.auth import tenant_of
from api.openai.chunks import error_chunk, event_chunks, role_chunk
from api.quotas import count_creation
from api.routes import Route
from api.services import services
from api.sse import Frame, serve_sse
from api.validation import parse_params
from services.errors import NotFoundError
from services.inference.events import prepend, stream_failed
from services.streams.hub import LiveStream, StreamHub, StreamStatus


async def serve_live(request: web.Request, live: LiveStream, after: int = -1) -> web.StreamResponse:
    """Stream `live` as SSE from event `after + 1`, `id:` lines carrying event indexes.

    The response starts with the first event, so a request that fails before its first
    token (queue timeout, engine error) still gets a plain HTTP error.
    """
    headers = {"X-Stream-Id": live.id, "X-Request-Id": request["request_id"]}
    return await serve_sse(request, live_frames(services(request).streams, live, after), headers)


async def live_frames(hub: StreamHub, live: LiveStream, after: int) -> AsyncGenerator[Frame, None]:
    hub.attach(live)
    try:
        events = live.follow(after)
        first = await anext(events, None)
        if first is not None and first.error and first.index == after + 1 and after == -1:
            raise stream_failed(first)
        yield None
        if after == -1 and live.fmt.kind == "chat":
            yield role_chunk(live.fmt), None
        tokenizer = hub.tokenizer(live)
        if first is not None:
            async for event in prepend(first, events):
                if event.error:
                    yield error_chunk(event), event.index
                    return
                for chunk in event_chunks(live.fmt, tokenizer, event):
                    yield chunk, event.index
        if live.status != StreamStatus.CANCELLED:
            yield "[DONE]", None
    finally:
        hub.detach(live)


class ResumeQuery(BaseModel):
    after: int = Field(-1, ge=-1, description="Replay the events after this index; -1: from the start.")


class ResumeHeaders(BaseModel):
    last_event_id: int = Field(None, ge=-1, alias="Last-Event-ID",
                               description="As `after` (what EventSource sends on reconnecting); it wins over `after`.")


def resume_point(request: web.Request) -> int:
    header = parse_params(request.headers, ResumeHeaders).last_event_id
    return header if header is not None else parse_params(request.query, ResumeQuery).after


async def resume_stream(request: web.Request) -> web.StreamResponse:
    """Replay a stream's events after N (from memory while live, else SQLite), then follow it live."""
    after = resume_point(request)
    count_creation(request)  # a replay is work: it counts as a request
    stream_id = request.match_info["stream_id"]
    live = await services(request).streams.find(stream_id, tenant_of(request).name)
    if live is None:
        raise NotFoundError(f"no stream {stream_id!r} (unknown, expired, or not yours)", param="stream_id")
    return await serve_live(request, live, after)


ROUTES = [
    Route("GET", "/api/v1/streams/{stream_id}", resume_stream,
          "Resume a stream: events after Last-Event-ID (or ?after=N), then live until done",
          content_type="text/event-stream", query=ResumeQuery, headers=ResumeHeaders,
          errors=(429, 503)),
]
