"""The one application key handlers read: the server's `Services` (aiohttp's AppKey pattern)."""

from __future__ import annotations

from aiohttp import web

from services.wiring import Services

SERVICES = web.AppKey("services", Services)


def services(request: web.Request) -> Services:
    return request.app[SERVICES]
