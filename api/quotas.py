"""What a tenant creates (batch jobs, conversations) or replays (a stream resumed over HTTP or a
WebSocket) counts against its limits like a request does.

Creating or replaying runs no generation and holds no slot, so it takes one from the tenant's
`requests_per_minute` only (its concurrency is for running requests); over it, the same 429
with Retry-After as any refused request. It runs before any work the creation would cause
(loading a cold model, storing megabytes of inputs).
"""

from __future__ import annotations

from aiohttp import web

from api.auth import tenant_limits
from api.context import ROUTER
from scheduling.admission import Rejected
from services.errors import rate_limited


def count_creation(request: web.Request) -> None:
    """Count this creation as one of the caller's requests; 429 (changing nothing) over its rate."""
    limits, _ = tenant_limits(request)
    try:
        request.app[ROUTER].admission.count_request(limits)
    except Rejected as exc:
        raise rate_limited(exc) from exc
