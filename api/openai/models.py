"""GET /v1/models: the models the caller's tenant may use."""

from __future__ import annotations

from aiohttp import web

from api.auth import tenant_of
from api.errors import json_response
from api.openai.schemas import ModelList
from api.routes import Route
from api.services import services


async def list_models(request: web.Request) -> web.Response:
    """Every registered model (generate, embed, classify) the caller's tenant may use, loaded or cold."""
    tenant = tenant_of(request)
    data = [card for card in services(request).models.catalog() if tenant.allows_model(card["id"])]
    return json_response({"object": "list", "data": data})


ROUTES = [
    Route("GET", "/v1/models", list_models, "List the served models", response=ModelList),
]
