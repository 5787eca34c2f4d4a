"""Server-sent events: open a stream response and write `data:` events (with `id:` to resume)."""

from __future__ import annotations

import orjson
from aiohttp import web


async def open_sse(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # keep reverse proxies from buffering tokens
            **(headers or {}),
        }
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, data: dict | str, event_id: int | None = None) -> None:
    await response.write(sse_frame(data, event_id))


def sse_frame(data: dict | str, event_id: int | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    return head + b"data: " + payload + b"\n\n"
