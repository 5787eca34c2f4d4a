"""Typed application keys shared by the handlers (aiohttp's AppKey pattern)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from scheduling.router import Router
from services.inference.admission import Admission


@dataclass
class ServerState:
    """Lifecycle flags the health endpoints report."""

    ready: bool = False
    draining: bool = False
    started_s: float = 0.0


ROUTER = web.AppKey("router", Router)
STATE = web.AppKey("state", ServerState)
ADMISSION = web.AppKey("admission", Admission)
