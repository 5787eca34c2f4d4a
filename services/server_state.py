"""The server's lifecycle flags: set by `server.py` as it starts and drains, read by the health
endpoints and by services that must stop starting work during a drain (batch jobs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerState:
    ready: bool = False
    draining: bool = False
    started_s: float = 0.0
