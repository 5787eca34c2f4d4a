"""Which model version serves a request, for handlers: `resolve_model` (the caller's checks and
routing, in `ModelManager.route`) and `model_label`."""

from __future__ import annotations

from aiohttp import web

from api.auth import caller_of
from api.services import services
from services.deployments import Served


async def resolve_model(request: web.Request, ref: str, *, user: str | None = None,
                        conversation_id: str | None = None, pinned_version: str | None = None,
                        kinds: tuple[str, ...] = ("generate",)) -> Served:
    """The served version for `ref` (see `ModelManager.route`); the caller notes it for the `X-Model-Version` header."""
    return await services(request).models.route(caller_of(request), ref, user=user, conversation_id=conversation_id,
                                                 pinned_version=pinned_version, kinds=kinds)


def model_label(request: web.Request, served: Served) -> str:
    """The `model` field of responses: `name`, or `name@version` while the model has several versions."""
    return services(request).models.label(served)
