"""Which model version serves a request, for handlers: `resolve_model` (the caller's checks and
routing, in `ModelManager.route`) and `model_label`; the `X-Model-Version` response header."""

from __future__ import annotations

from aiohttp import web

from api.auth import caller_of
from api.context import services
from services.deployments.manager import Served

MODEL_VERSION = "model_version"  # request[MODEL_VERSION]: name@version that served it (X-Model-Version)


async def resolve_model(request: web.Request, ref: str, *, user: str | None = None,
                        conversation_id: str | None = None, pinned_version: str | None = None,
                        kinds: tuple[str, ...] = ("generate",)) -> Served:
    """The served version for `ref` (see `ModelManager.route`); recorded for the `X-Model-Version` header."""
    served = await services(request).models.route(caller_of(request), ref, user=user, conversation_id=conversation_id,
                                             pinned_version=pinned_version, kinds=kinds)
    request[MODEL_VERSION] = served.ref
    return served


def model_label(request: web.Request, served: Served) -> str:
    """The `model` field of responses: `name`, or `name@version` while the model has several versions."""
    return services(request).models.label(served)


async def add_version_header(request: web.Request, response: web.StreamResponse) -> None:
    if MODEL_VERSION in request:
        response.headers["X-Model-Version"] = request[MODEL_VERSION]
