"""The route table: one `Route` per endpoint, used to register handlers and to write the spec."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
VERSION = "0.1.0"  # the server's, in /openapi.json and the Open Inference Protocol's server metadata


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream_response: type[BaseModel] | None = None  # SSE events, when the body asks to stream
    content_type: str = "application/json"
    status: int = 200  # the success status (201 created, 202 accepted)
    query: type[BaseModel] | None = None  # query parameters, parsed with `api.validation.parse_params`
    headers: type[BaseModel] | None = None  # request headers it reads (field aliases are the header names)
    errors: tuple[int, ...] = ()  # statuses beyond those the spec derives (409 conflicts, 404 without path ids)
    error_body: type[BaseModel] | None = None  # the body of its errors when it is not the OpenAI-shaped error
