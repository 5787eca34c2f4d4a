"""The HTTP side of the response cache (`services.cache.responses`): `Cache-Control: no-cache`
opts a request out like `"galley": {"cache": false}`, and a request whose answer was looked up
in the cache says so in the `X-Cache` header (`hit` or `miss`). The generation handlers key and
look up through here (the request -> its caller, its headers and body -> what it asked)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from api.auth import caller_of
from api.context import services
from engine.types import SamplingParams
from services.deployments.manager import Served

CACHE_STATUS = "cache_status"  # request[CACHE_STATUS]: "hit" | "miss", sent as the X-Cache header


def cache_flag(request: web.Request, options: Any) -> bool | None:
    """What the caller asked of the cache: False when the body (`options`: its `galley` options,
    with `cache`) or the headers say no cache, else the body's flag (None: it did not say)."""
    directives = {d.strip().lower() for d in request.headers.get("Cache-Control", "").split(",")}
    if directives & {"no-cache", "no-store"}:
        return False
    return options.cache if options is not None else None


def generation_key(request: web.Request, body: Any, model: Served, prompt_ids: list[int], params: SamplingParams,
                   api: str) -> str | None:
    """The cache key of a generation request (`body`: its `galley` options and conversation), or
    None when its answer must not come from or go to the cache."""
    asked = cache_flag(request, body.galley)
    return services(request).cache.generation_key(caller_of(request), model, prompt_ids, params, asked, api,
                                                      getattr(body, "conversation_id", None))


def lookup(request: web.Request, model: Served, key: str | None) -> Any | None:
    """The cached answer for `key` (None: not cacheable, or a miss), marked for the X-Cache header."""
    if key is None:
        return None
    found = services(request).cache.lookup(caller_of(request), model.name, key)
    mark_lookup(request, found is not None)
    return found


def mark_lookup(request: web.Request, hit: bool | None) -> None:
    """Remember for the X-Cache header whether this request's answer came from the cache
    (None: the cache was not looked up; no header)."""
    if hit is not None:
        request[CACHE_STATUS] = "hit" if hit else "miss"


async def add_cache_header(request: web.Request, response: web.StreamResponse) -> None:
    if CACHE_STATUS in request:
        response.headers["X-Cache"] = request[CACHE_STATUS]
