"""`POST /admin/api/profile`: a torch profiler trace of one device worker's engine steps, as a download."""

from __future__ import annotations

import time

from aiohttp import web
from pydantic import BaseModel, Field

from api.routes import Route
from api.services import services
from api.validation import parse_params


class ProfileQuery(BaseModel):
    seconds: float = Field(5.0, gt=0, allow_inf_nan=False,
                           description="How long to record; at most [observability] max_profile_seconds (longer "
                           "asks record that long).")
    device: str = Field(None, description="A device worker (`cpu#0`, `cuda:0#0`); default: the first.")


async def admin_profile(request: web.Request) -> web.Response:
    """Record a torch profiler trace of one device worker's engine steps for N seconds."""
    query = parse_params(request.query, ProfileQuery)
    device, trace = await services(request).profiler.record(query.seconds, query.device)
    filename = f"galley-profile-{device.replace(':', '_').replace('#', '-')}-{int(time.time())}.json"
    return web.Response(body=trace, content_type="application/json",
                        headers={"Content-Disposition": f'attachment; filename="{filename}"',
                                 "Cache-Control": "no-store"})


ROUTES = [
    Route("POST", "/admin/api/profile", admin_profile, "Record a torch profiler trace of the engine for ?seconds=N; "
          "returns Chrome-trace JSON (admin key)", query=ProfileQuery, errors=(404, 409)),
]
