"""Resumable streams over HTTP: serve a live stream as SSE from any chunk, and
`GET /api/v1/streams/{stream_id}` to reconnect (Last-Event-ID or ?after=N).

The stream a POST to /v1 answers with is plain OpenAI SSE (`data:` lines only, as vLLM's and
SGLang's benchmark clients parse it); its id is in `X-Stream-Id`, and the count of `data:`
chunks received is where to resume. The resume endpoint numbers its events (`id: N`, unique
and increasing) for EventSource's Last-Event-ID."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from aiohttp import web
from pydantic import BaseModel, Field

from api.auth import tenant_of
from api.openai.chunks import error_chunk, event_chunks, num_chunks, opening_chunks
from api.quotas import count_creation
from api.routes import Route
from api.services import services
from api.sse import Frame, serve_sse
from api.validation import parse_params
from services.answers import AnswerReader, prepend, stream_failed
from services.errors import NotFoundError
from services.streams import LiveStream, StreamHub, StreamStatus


async def serve_live(request: web.Request, live: LiveStream, after: int = 0, *, ids: bool = False
                     ) -> web.StreamResponse:
    """Stream `live` as SSE from chunk `after + 1` (chunks are numbered from 1: `api.openai.chunks`);
    `ids`: each event says its number in an `id:` line (the resume endpoint, for EventSource).

    The response starts with the first event, so a request that fails before its first
    token (queue timeout, engine error) still gets a plain HTTP error.
    """
    headers = {"X-Stream-Id": live.id, "X-Request-Id": request["request_id"]}
    return await serve_sse(request, live_frames(services(request).streams, live, after, ids), headers)


async def live_frames(hub: StreamHub, live: LiveStream, after: int, ids: bool) -> AsyncGenerator[Frame, None]:
    """The stream's chunks numbered from 1, those after `after` sent; each event's chunks are
    counted without rendering them, so skipping a long prefix costs no tokenizer work."""
    hub.attach(live)
    try:
        events = live.follow()
        first = await anext(events, None)
        if first is not None and first.error and first.index == 0 and after == 0:
            raise stream_failed(first)
        yield None
        fmt, tokenizer, number = live.fmt, hub.tokenizer(live), 0
        reader = AnswerReader.of(fmt)  # every event is read, skipped or not: a view depends on all the text

        def numbered(chunks: list[dict]) -> list[Frame]:
            nonlocal number
            start, number = number, number + len(chunks)
            return [(chunk, start + i + 1 if ids else None) for i, chunk in enumerate(chunks) if start + i >= after]

        for frame in numbered(opening_chunks(fmt, 0, len(live.record.prompt_token_ids))):
            yield frame
        if first is not None:
            async for event in prepend(first, events):
                if event.error:
                    for frame in numbered([error_chunk(event)]):
                        yield frame
                    return
                delta = reader.read(event)
                if number + num_chunks(fmt, delta) <= after:
                    number += num_chunks(fmt, delta)
                    continue
                for frame in numbered(event_chunks(fmt, tokenizer, delta)):
                    yield frame
        if live.status != StreamStatus.CANCELLED:
            yield "[DONE]", None
    finally:
        hub.detach(live)


class ResumeQuery(BaseModel):
    after: int = Field(0, ge=-1, description="Send the chunks after this many: the count of `data:` chunks the "
                       "client already has (0 or -1: from the start).")


class ResumeHeaders(BaseModel):
    last_event_id: int = Field(None, ge=-1, alias="Last-Event-ID",
                               description="As `after` (what EventSource sends on reconnecting); it wins over `after`.")


def resume_point(request: web.Request) -> int:
    header = parse_params(request.headers, ResumeHeaders).last_event_id
    return max(0, header if header is not None else parse_params(request.query, ResumeQuery).after)


async def resume_stream(request: web.Request) -> web.StreamResponse:
    """Replay a stream's events after N (from memory while live, else SQLite), then follow it live."""
    after = resume_point(request)
    count_creation(request)  # a replay is work: it counts as a request
    stream_id = request.match_info["stream_id"]
    live = await services(request).streams.find(stream_id, tenant_of(request).name)
    if live is None:
        raise NotFoundError(f"no stream {stream_id!r} (unknown, expired, or not yours)", param="stream_id")
    return await serve_live(request, live, after, ids=True)


ROUTES = [
    Route("GET", "/api/v1/streams/{stream_id}", resume_stream,
          "Resume a stream: events after Last-Event-ID (or ?after=N), then live until done",
          content_type="text/event-stream", query=ResumeQuery, headers=ResumeHeaders,
          errors=(429, 503)),
]
