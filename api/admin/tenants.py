"""The admin API under /admin/api/: tenants and their API keys (the admin key is checked in api/auth.py).

Writes run on the DB writer thread; the `TenantDirectory` is updated by a callback on the
event loop as soon as a write commits, even when the admin client has already gone away, so
memory and the DB never disagree. Reads go to the read connection through a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import sqlite_utils
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from api.auth import AUTH, DATABASE, TenantDirectory
from api.errors import json_response
from api.routes import Route
from api.validation import parse_body
from services.errors import ConflictError, InvalidRequestError, NotFoundError
from storage import tenants
from storage.tenants import DEFAULT_TENANT, ApiKey, Tenant, hash_key

T = TypeVar("T")

Priority = Literal["high", "normal", "low"]
MAX_LIMIT = 2**53 - 1  # integers JSON carries exactly (SQLite's INTEGER and orjson stop at 2**63)
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT)] | None
Weight = Annotated[float, Field(ge=0.001, le=1000.0, allow_inf_nan=False,
                                description="Fair-share weight, 0.001 to 1000.")]
ModelName = Annotated[str, Field(min_length=1)]


# ---- schemas ---------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantLimits(Strict):
    allowed_models: list[ModelName] | None = Field(None, description="Models it may use; null: every model.")
    max_concurrent: Limit = Field(None, description="Most requests in flight at once; null: no limit.")
    requests_per_minute: Limit = None
    tokens_per_minute: Limit = Field(None, description="Prompt + completion tokens per minute.")
    max_tokens: Limit = Field(None, description="Cap on the completion tokens of one request.")


class TenantCreate(TenantLimits):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                      description="1-64 letters, digits, `.`, `_`, `-`; starts with a letter or digit; "
                                  "names starting with `galley-` are reserved (400).")
    weight: Weight = 1.0
    max_priority: Priority = Field("high", description="The highest priority its requests may use.")


class TenantPatch(TenantLimits):
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


# ---- plumbing --------------------------------------------------------------------------


async def commit(request: web.Request, fn: Callable[[sqlite_utils.Database], T],
                 apply: Callable[[TenantDirectory, T], None]) -> T:
    """Runs `fn` on the writer thread; once it commits, `apply` updates the directory (client gone or not)."""
    directory = request.app[AUTH].directory
    done = asyncio.wrap_future(request.app[DATABASE].write(fn))

    def on_done(future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            apply(directory, future.result())

    done.add_done_callback(on_done)
    return await asyncio.shield(done)


async def read(request: web.Request, fn: Callable[[sqlite_utils.Database], T]) -> T:
    return await asyncio.to_thread(request.app[DATABASE].read, fn)


def tenant_not_found(name: str) -> NotFoundError:
    return NotFoundError(f"The tenant `{name}` does not exist.", param="name", code="tenant_not_found")


# ---- handlers --------------------------------------------------------------------------


async def create_tenant(request: web.Request) -> web.Response:
    body = await parse_body(request, TenantCreate)
    if tenants.is_reserved(body.name):
        raise InvalidRequestError(f"Tenant names starting with `{tenants.RESERVED_PREFIX}` are reserved for the "
                                  "server's own requests.", param="name", code="reserved_tenant_name")
    tenant = Tenant(**body.model_dump(exclude_unset=True))
    try:
        saved = await commit(request, lambda db: tenants.create_tenant(db, tenant),
                             lambda directory, t: directory.put_tenant(t))
    except tenants.TenantExistsError as exc:
        raise ConflictError(f"The tenant `{tenant.name}` already exists.", param="name",
                            code="tenant_exists") from exc
    return json_response(tenant_json(saved), status=201)


async def list_tenants(request: web.Request) -> web.Response:
    listed = await read(request, tenants.list_tenants)
    return json_response({"object": "list", "data": [tenant_json(t) for t in listed]})


async def get_tenant(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    tenant = await read(request, lambda db: tenants.get_tenant(db, name))
    if tenant is None:
        raise tenant_not_found(name)
    return json_response(tenant_json(tenant))


async def update_tenant(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    changes = (await parse_body(request, TenantPatch)).model_dump(exclude_unset=True)
    try:
        updated = await commit(request, lambda db: tenants.update_tenant(db, name, changes),
                               lambda directory, t: directory.put_tenant(t))
    except tenants.TenantNotFoundError as exc:
        raise tenant_not_found(name) from exc
    return json_response(tenant_json(updated))


async def delete_tenant(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == DEFAULT_TENANT:
        raise ConflictError("The default tenant cannot be deleted.", param="name", code="default_tenant")
    try:
        await commit(request, lambda db: tenants.delete_tenant(db, name),
                     lambda directory, _: directory.remove_tenant(name))
    except tenants.TenantNotFoundError as exc:
        raise tenant_not_found(name) from exc
    return json_response({"name": name, "deleted": True})


async def create_key(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        plaintext, key = await commit(request, lambda db: tenants.create_key(db, name),
                                      lambda directory, made: directory.add_key(made[1], hash_key(made[0])))
    except tenants.TenantNotFoundError as exc:
        raise tenant_not_found(name) from exc
    body = {"key": plaintext, "prefix": key.prefix, "tenant": key.tenant, "created_at": key.created_at}
    return json_response(body, status=201, headers={"Cache-Control": "no-store"})


async def list_keys(request: web.Request) -> web.Response:
    name = request.match_info["name"]

    def query(db: sqlite_utils.Database) -> list[ApiKey] | None:
        return None if tenants.get_tenant(db, name) is None else tenants.list_keys(db, name)

    keys = await read(request, query)
    if keys is None:
        raise tenant_not_found(name)
    return json_response({"object": "list", "data": [key_json(k) for k in keys]})


async def revoke_key(request: web.Request) -> web.Response:
    prefix = request.match_info["prefix"]
    try:
        key = await commit(request, lambda db: tenants.revoke_key(db, prefix),
                           lambda directory, _: directory.revoke_key(prefix))
    except tenants.KeyNotFoundError as exc:
        raise NotFoundError(f"No API key has the prefix `{prefix}`.", param="prefix", code="key_not_found") from exc
    return json_response(key_json(key))


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
