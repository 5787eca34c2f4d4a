"""The HTTP side of the response cache (`services.cache.response_cache`): `Cache-Control: no-cache`
opts a request out like `"galley": {"cache": false}`. (Whether the answer came from the cache is
the `X-Cache` header, from the caller's notes: `api.auth.add_notes_headers`.)"""

from __future__ import annotations

from typing import Any

from aiohttp import web


def cache_flag(request: web.Request, options: Any) -> bool | None:
    """What the caller asked of the cache: False when the body (`options`: its `galley` options,
    with `cache`) or the headers say no cache, else the body's flag (None: it did not say)."""
    directives = {d.strip().lower() for d in request.headers.get("Cache-Control", "").split(",")}
    if directives & {"no-cache", "no-store"}:
        return False
    return options.cache if options is not None else None
