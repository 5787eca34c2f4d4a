"""The admin page (`GET /admin`, files in static/) and the `/admin/api/*` JSON it reads:
stats for the live charts, loaded models' inputs and outputs, recent requests, alerts,
conversations across tenants (profiling: api/admin/profiling.py).

Also wires the observability parts into the app (`setup`): the request-record sinks (log
line, recent-requests ring, spans), the alert loop and the profiler. The page itself only
calls JSON endpoints; each is useful on its own (see docs/operations.md). The admin key is checked by
api/auth.py for every `/admin/api/` path; `/admin` and its static files are public (they hold
no data; the page asks for the key).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, Field

from api.errors import json_response
from api.oip import TensorMetadata, signature
from api.routes import Route
from api.services import services
from api.validation import parse_params
from services.conversations import Conversation

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"


def setup(app: web.Application) -> None:
    app.router.add_static("/admin/static/", STATIC_DIR, append_version=False)


# ---- the page --------------------------------------------------------------------------


async def admin_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "admin.html", headers={"Cache-Control": "no-cache"})


# ---- stats for the charts --------------------------------------------------------------


async def admin_stats(request: web.Request) -> web.Response:
    return json_response(services(request).status.stats())


# ---- loaded models' inputs and outputs -------------------------------------------------


class ModelSignature(BaseModel):
    name: str
    version: str
    kind: str
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class SignatureList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelSignature]


def signature_json(model: Any) -> dict[str, Any]:
    platform, inputs, outputs = signature(model)
    return {"name": model.name, "version": model.version, "kind": model.kind, "platform": platform,
            "inputs": inputs, "outputs": outputs}


async def admin_signatures(request: web.Request) -> web.Response:
    """What /v2/models/{name} says of each loaded version but generate ones, read with the admin key
    (/v2 takes a tenant key) and without loading a cold version, as /v2 would."""
    loaded = sorted(services(request).models.router.served_encoders(), key=lambda m: (m.name, m.version))
    return json_response({"object": "list", "data": [signature_json(m) for m in loaded]})


# ---- recent requests, alerts -----------------------------------------------------------


class RequestsQuery(BaseModel):
    limit: int = Field(100, ge=1, le=10_000)
    tenant: str = Field(None, description="Only this tenant's requests.")
    status: str = Field(None, description="Only requests that ended so (ok, error, rejected, cancelled, ...).")


async def admin_requests(request: web.Request) -> web.Response:
    query = parse_params(request.query, RequestsQuery)
    data = services(request).recent.latest(query.limit, query.tenant, query.status)
    return json_response({"object": "list", "data": data})


async def admin_alerts(request: web.Request) -> web.Response:
    return json_response(services(request).alerts.to_dict())


# ---- conversations across tenants ------------------------------------------------------


def conversation_json(c: Conversation, num_messages: int | None = None) -> dict[str, Any]:
    out = {"id": c.id, "tenant": c.tenant, "model": c.model, "model_version": c.model_version, "title": c.title,
           "created_at": c.created_at, "updated_at": c.updated_at}
    return out if num_messages is None else {**out, "num_messages": num_messages}


class ConversationsQuery(BaseModel):
    limit: int = Field(100, ge=1, le=1000)
    tenant: str = Field(None, description="Only this tenant's conversations.")


async def admin_list_conversations(request: web.Request) -> web.Response:
    params = parse_params(request.query, ConversationsQuery)
    rows = await services(request).conversations.across_tenants(params.limit, params.tenant or None)
    return json_response({"object": "list", "data": [conversation_json(c, n) for c, n in rows]})


async def admin_get_conversation(request: web.Request) -> web.Response:
    found, messages = await services(request).conversations.find(request.match_info["conversation_id"])
    body = conversation_json(found, len(messages))
    body["messages"] = [{"role": m.role, "content": m.content, "prompt_tokens": m.prompt_tokens,
                         "completion_tokens": m.completion_tokens, "stream_id": m.stream_id,
                         "created_at": m.created_at} for m in messages]
    return json_response(body)


ROUTES = [
    Route("GET", "/admin", admin_page, "The admin page (HTML; it asks for the admin key)", content_type="text/html"),
    Route("GET", "/admin/api/stats", admin_stats,
          "Live summary for the charts: tokens, TTFT p50/p99, queues, KV, models (admin key)"),
    Route("GET", "/admin/api/signatures", admin_signatures, "Each loaded version's inputs and outputs (every kind "
          "but generate), as its Open Inference Protocol metadata gives them (admin key)", response=SignatureList),
    Route("GET", "/admin/api/requests", admin_requests, "Recent generation requests, newest first (admin key)",
          query=RequestsQuery),
    Route("GET", "/admin/api/alerts", admin_alerts, "Alert rules, their state, firing alerts and recent transitions "
          "(admin key)"),
    Route("GET", "/admin/api/conversations", admin_list_conversations,
          "Conversations across tenants, most recent first (admin key)", query=ConversationsQuery),
    Route("GET", "/admin/api/conversations/{conversation_id}", admin_get_conversation,
          "A conversation of any tenant with its messages (admin key)"),
]
