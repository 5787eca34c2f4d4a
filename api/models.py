"""Which model version serves a request, for handlers: `resolve_model` (the caller's checks and
routing, in `ModelManager.route`) and `model_label`; the `X-Model-Version` response header; and
the model lifecycle's and shadow traffic's app hooks."""

from __future__ import annotations

import asyncio

from aiohttp import web

from api.auth import caller_of
from api.context import MODELS, SHADOWS
from services.deployments.manager import ModelManager, Served
from services.deployments.shadow import ShadowMirror

MODEL_VERSION = "model_version"  # request[MODEL_VERSION]: name@version that served it (X-Model-Version)


async def resolve_model(request: web.Request, ref: str, *, user: str | None = None,
                        conversation_id: str | None = None, pinned_version: str | None = None,
                        kinds: tuple[str, ...] = ("generate",)) -> Served:
    """The served version for `ref` (see `ModelManager.route`); recorded for the `X-Model-Version` header."""
    served = await request.app[MODELS].route(caller_of(request), ref, user=user, conversation_id=conversation_id,
                                             pinned_version=pinned_version, kinds=kinds)
    request[MODEL_VERSION] = served.ref
    return served


def model_label(request: web.Request, served: Served) -> str:
    """The `model` field of responses: `name`, or `name@version` while the model has several versions."""
    return request.app[MODELS].label(served)


async def add_version_header(request: web.Request, response: web.StreamResponse) -> None:
    if MODEL_VERSION in request:
        response.headers["X-Model-Version"] = request[MODEL_VERSION]


async def run_lifecycle(app: web.Application):
    """cleanup_ctx: shadows from SQLite and the keep_alive / canary loop while the app runs; at
    cleanup, pending shadow comparisons, loads and unloads stop."""
    manager, shadows = app[MODELS], app[SHADOWS]
    await shadows.restore()
    checker = asyncio.get_running_loop().create_task(manager.run())
    yield
    await shadows.close()
    checker.cancel()
    await manager.close()


def setup(app: web.Application, manager: ModelManager, shadows: ShadowMirror) -> None:
    app[MODELS], app[SHADOWS] = manager, shadows
    app.on_response_prepare.append(add_version_header)
    app.cleanup_ctx.append(run_lifecycle)
