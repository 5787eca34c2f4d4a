"""What a tenant creates (batch jobs, conversations) or replays (a stream resumed over HTTP or a
WebSocket) counts against its `requests_per_minute` like a request does (the rule is
`services.tenancy.count_creation`'s); over it, the same 429 with Retry-After as any refused request.
"""

from __future__ import annotations

from aiohttp import web

from api.auth import caller_of
from api.services import services
from services import tenancy


def count_creation(request: web.Request) -> None:
    """Count this creation as one of the caller's requests; 429 (changing nothing) over its rate."""
    tenancy.count_creation(caller_of(request), services(request).router.admission)
