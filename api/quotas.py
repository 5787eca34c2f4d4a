"""What a tenant replays (a stream resumed over HTTP or a WebSocket) counts against its
`requests_per_minute` like a request does (the rule is `Admission.count_request`'s, which batch
jobs and conversations also go through); over it, the same 429 with Retry-After as any refused
request.
"""

from __future__ import annotations

from aiohttp import web

from api.auth import caller_of
from api.services import services


def count_creation(request: web.Request) -> None:
    """Count this creation as one of the caller's requests; 429 (changing nothing) over its rate."""
    services(request).admission.count_request(caller_of(request).limits()[0])
