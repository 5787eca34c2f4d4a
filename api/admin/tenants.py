"""The admin API under /admin/api/: tenants and their API keys (the admin key is checked in api/auth.py).

Each handler makes one call to `services.tenancy.TenantAdmin`, which keeps the tenant directory
in step with the DB.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, Field

from api.errors import json_response
from api.openai.fields import Strict
from api.routes import Route
from api.services import services
from api.validation import parse_body
from services.tenancy import ApiKey, Tenant

Priority = Literal["high", "normal", "low"]
MAX_LIMIT = 2**53 - 1  # integers JSON carries exactly (SQLite's INTEGER and orjson stop at 2**63)
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT)] | None
Weight = Annotated[float, Field(ge=0.001, le=1000.0, allow_inf_nan=False,
                                description="Fair-share weight, 0.001 to 1000.")]
ModelName = Annotated[str, Field(min_length=1)]


# ---- schemas ---------------------------------------------------------------------------


class LimitFields(Strict):
    allowed_models: list[ModelName] | None = Field(None, description="Models it may use; null: every model.")
    max_concurrent: Limit = Field(None, description="Most requests in flight at once; null: no limit.")
    requests_per_minute: Limit = None
    tokens_per_minute: Limit = Field(None, description="Prompt + completion tokens per minute.")
    max_tokens: Limit = Field(None, description="Cap on the completion tokens of one request.")


class TenantCreate(LimitFields):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                      description="1-64 letters, digits, `.`, `_`, `-`; starts with a letter or digit; "
                                  "names starting with `galley-` are reserved (400).")
    weight: Weight = 1.0
    max_priority: Priority = Field("high", description="The highest priority its requests may use.")


class TenantPatch(LimitFields):
    """The fields to change: absent fields stay as they are; a limit set to null is removed.
    `weight` and `max_priority` may be left out but never be null (the `None` default means absent)."""

    weight: Weight = None
    max_priority: Priority = None


class TenantOut(BaseModel):
    name: str
    weight: float
    max_priority: Priority
    allowed_models: list[str] | None
    max_concurrent: int | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_tokens: int | None
    created_at: str


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantOut]


class Deleted(BaseModel):
    name: str
    deleted: bool


class KeyOut(BaseModel):
    prefix: str
    tenant: str
    created_at: str
    revoked_at: str | None


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]


class CreatedKey(BaseModel):
    key: str = Field(description="The API key. Shown only in this response; only its hash is stored.")
    prefix: str
    tenant: str
    created_at: str


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    models = None if tenant.allowed_models is None else list(tenant.allowed_models)
    return TenantOut(**{**dataclasses.asdict(tenant), "allowed_models": models}).model_dump()


def key_json(key: ApiKey) -> dict[str, Any]:
    return KeyOut(**dataclasses.asdict(key)).model_dump()


# ---- handlers --------------------------------------------------------------------------


async def create_tenant(request: web.Request) -> web.Response:
    body = await parse_body(request, TenantCreate)
    saved = await services(request).tenants.create(body.model_dump(exclude_unset=True))
    return json_response(tenant_json(saved), status=201)


async def list_tenants(request: web.Request) -> web.Response:
    listed = await services(request).tenants.tenants()
    return json_response({"object": "list", "data": [tenant_json(t) for t in listed]})


async def get_tenant(request: web.Request) -> web.Response:
    return json_response(tenant_json(await services(request).tenants.get(request.match_info["name"])))


async def update_tenant(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    changes = (await parse_body(request, TenantPatch)).model_dump(exclude_unset=True)
    return json_response(tenant_json(await services(request).tenants.update(name, changes)))


async def delete_tenant(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    await services(request).tenants.delete(name)
    return json_response({"name": name, "deleted": True})


async def create_key(request: web.Request) -> web.Response:
    plaintext, key = await services(request).tenants.create_key(request.match_info["name"])
    body = {"key": plaintext, "prefix": key.prefix, "tenant": key.tenant, "created_at": key.created_at}
    return json_response(body, status=201, headers={"Cache-Control": "no-store"})


async def list_keys(request: web.Request) -> web.Response:
    keys = await services(request).tenants.keys_of(request.match_info["name"])
    return json_response({"object": "list", "data": [key_json(k) for k in keys]})


async def revoke_key(request: web.Request) -> web.Response:
    return json_response(key_json(await services(request).tenants.revoke_key(request.match_info["prefix"])))


TENANT_PATH = "/admin/api/tenants/{name}"

ROUTES = [
    Route("POST", "/admin/api/tenants", create_tenant, "Create a tenant (admin key)",
          request=TenantCreate, response=TenantOut, status=201, errors=(409,)),
    Route("GET", "/admin/api/tenants", list_tenants, "List tenants (admin key)", response=TenantList),
    Route("GET", TENANT_PATH, get_tenant, "Get a tenant (admin key)", response=TenantOut),
    Route("PATCH", TENANT_PATH, update_tenant, "Change a tenant's weight, priority, models or limits (admin key)",
          request=TenantPatch, response=TenantOut),
    Route("DELETE", TENANT_PATH, delete_tenant, "Delete a tenant and its keys (admin key)", response=Deleted,
          errors=(409,)),
    Route("POST", TENANT_PATH + "/keys", create_key, "Create an API key; the key is shown only once (admin key)",
          response=CreatedKey, status=201),
    Route("GET", TENANT_PATH + "/keys", list_keys, "List a tenant's keys by prefix (admin key)", response=KeyList),
    Route("DELETE", "/admin/api/keys/{prefix}", revoke_key, "Revoke an API key at once (admin key)",
          response=KeyOut),
]
