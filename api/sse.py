"""Server-sent events: the one writer of token streams (`serve_sse`), over `open_sse` and `send_event`.

A stream is a long-lived connection: its key is re-checked before every event, so revoking the
key or deleting the tenant ends it at once (as it closes a WebSocket with 1008).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import orjson
from aiohttp import web

from api.auth import TENANT, current_tenant
from api.errors import StreamEnded, error_body

REQUEST = "galley_sse_request"  # response[REQUEST]: the request the stream answers

# (data, event id) or (data, event id, event name); None: open the response, send nothing yet
Frame = tuple[dict | str, int | None] | tuple[dict | str, int | None, str] | None


async def serve_sse(request: web.Request, frames: AsyncGenerator[Frame, None],
                    headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Write `frames` as SSE. The response opens at the first item, so what `frames` raises before
    it (a queue timeout, a generation that failed before its first token) is a plain HTTP error;
    after it, `frames` ends the stream its own way (an error event). However this ends (the client
    leaving cancels it), `frames` is closed, so its cleanup (abort, detach) runs at once."""
    response = None
    try:
        async for frame in frames:
            if response is None:
                response = await open_sse(request, headers)
            if frame is not None:
                await send_event(response, *frame)
        return response if response is not None else await open_sse(request, headers)
    finally:
        await frames.aclose()


async def open_sse(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # keep reverse proxies from buffering tokens
            **(headers or {}),
        }
    )
    response[REQUEST] = request
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, data: dict | str, event_id: int | None = None,
                     event: str | None = None) -> None:
    request = response.get(REQUEST)
    if request is not None and TENANT in request and current_tenant(request) is None:
        # a final error event and the end of the body; the handler unwinds as if the client had
        # left, so the generation follows its disconnect policy
        await response.write(sse_frame(error_body("The API key was revoked.", "authentication_error",
                                                  code="invalid_api_key")))
        await response.write_eof()
        raise StreamEnded(response, "the stream's API key was revoked")
    await response.write(sse_frame(data, event_id, event))


def sse_frame(data: dict | str, event_id: int | None = None, event: str | None = None) -> bytes:
    """An SSE event; `event` names it (the Responses API's `event: response.created` lines, as OpenAI sends)."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    head += f"event: {event}\n".encode() if event is not None else b""
    return head + b"data: " + payload + b"\n\n"
