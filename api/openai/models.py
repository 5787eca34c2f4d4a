"""GET /v1/models and /v1/models/{model_id}: the models the caller's tenant may use."""

from __future__ import annotations

from aiohttp import web

from api.auth import tenant_of
from api.errors import json_response
from api.openai.objects import ModelCard, ModelList
from api.routes import Route
from api.services import services
from services.errors import ModelNotFoundError


def visible_cards(request: web.Request) -> list[dict]:
    """Every registered model (generate, embed, classify) the caller's tenant may use, loaded or cold."""
    tenant = tenant_of(request)
    return [card for card in services(request).models.catalog() if tenant.allows_model(card["id"])]


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": visible_cards(request)})


async def retrieve_model(request: web.Request) -> web.Response:
    """One model's card (`client.models.retrieve`); a model the tenant may not use is as unknown (404)."""
    model_id = request.match_info["model_id"]
    card = next((card for card in visible_cards(request) if card["id"] == model_id), None)
    if card is None:
        raise ModelNotFoundError(f"The model `{model_id}` does not exist.", param="model")
    return json_response(card)


ROUTES = [
    Route("GET", "/v1/models", list_models, "List the served models", response=ModelList),
    Route("GET", "/v1/models/{model_id:.+}", retrieve_model, "Retrieve a model", response=ModelCard),
]
