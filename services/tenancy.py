"""Tenants: who a request is for, the in-memory directory of tenants and keys, and their administration.

`api/auth.py` authenticates and builds one `Caller` per request; a service reads the tenant
through it as it is *now* (`caller.tenant`), so an edit or revocation made while the request
waits takes effect at its next check. The `TenantDirectory` (the DB's tenants and unrevoked
keys) is loaded once at startup and updated by `TenantAdmin` the moment each write commits, so a
request never waits on SQLite and a revoked key is refused at once. Keys are never logged and
only their sha256 hashes are compared (`hmac.compare_digest`).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from scheduling.limiter import TenantLimits
from services.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from storage.tenants import (
    DEFAULT_TENANT,
    KEY_SCHEME,
    RESERVED_PREFIX,
    ApiKey,
    KeyNotFoundError,
    Tenant,
    TenantExistsError,
    TenantNotFoundError,
    TenantStore,
    hash_key,
    is_reserved,
    key_prefix,
)

T = TypeVar("T")
ADMIN_KEY_SETTING = "admin_key_hash"


def revoked() -> AuthenticationError:
    return AuthenticationError("Invalid API key: unknown or revoked.", code="invalid_api_key")


@dataclass
class Notes:
    """What serving a request decided that its response reports (headers `X-Model-Version`, `X-Cache`)."""

    model_version: str | None = None  # name@version that serves it, once routed
    cache: str | None = None  # "hit" | "miss" once the response cache was looked up


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its tenant (re-read on each access), the request id, whether it
    presented the admin key, and the notes services leave for the response."""

    lookup: Callable[[], Tenant | None]  # the tenant as the directory has it now; None once revoked
    request_id: str
    is_admin: bool = False
    auth_enabled: bool = True
    notes: Notes = field(default_factory=Notes)

    @property
    def tenant(self) -> Tenant:
        tenant = self.lookup()
        if tenant is None:
            raise revoked()
        return tenant

    def limits(self) -> tuple[TenantLimits, float]:
        """The tenant's admission limits as they are now, and its fair-share weight."""
        return limits_of(self.tenant), self.tenant.weight

    def priority(self, asked: str | None) -> str:
        """The class a request runs at: what it asked for (checked by `check_priority`), else
        `normal`, or the tenant's ceiling when that is lower (a tenant capped at `low` need not say so)."""
        if asked is not None:
            return asked
        tenant = self.tenant
        return "normal" if tenant.allows_priority("normal") else tenant.max_priority

    def check_model(self, model_name: str) -> None:
        tenant = self.tenant
        if not tenant.allows_model(model_name):
            raise PermissionDeniedError(f"Tenant `{tenant.name}` may not use the model `{model_name}`.",
                                        param="model", code="model_not_allowed")

    def check_priority(self, priority: str | None) -> None:
        tenant = self.tenant
        if priority is not None and not tenant.allows_priority(priority):
            raise PermissionDeniedError(
                f"Tenant `{tenant.name}` may use priority `{tenant.max_priority}` at most, not `{priority}`.",
                param="priority", code="priority_not_allowed")


def limits_of(tenant: Tenant) -> TenantLimits:
    return TenantLimits(tenant.name, tenant.max_concurrent, tenant.requests_per_minute, tenant.tokens_per_minute)


# ---- the directory ---------------------------------------------------------------------


@dataclass
class TenantDirectory:
    """Tenants and unrevoked keys, as committed. Invariant: `default` is present; each key's tenant is."""

    tenants: dict[str, Tenant]
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # prefix -> (key sha256 hex, tenant)
    listeners: list[Callable[[], None]] = field(default_factory=list)  # called after a change that may revoke

    @classmethod
    def load(cls, store: TenantStore) -> TenantDirectory:
        listed = store.tenants()
        active = store.active_keys()
        return cls({t.name: t for t in listed}, {key.prefix: (digest, key.tenant) for key, digest in active})

    @property
    def default(self) -> Tenant:
        return self.tenants[DEFAULT_TENANT]

    def tenant_for_key(self, key: str) -> Tenant | None:
        """The tenant of an unrevoked key; None for anything else."""
        entry = self.keys.get(key_prefix(key) or "")
        if entry is None or not hmac.compare_digest(entry[0], hash_key(key)):
            return None
        return self.tenants.get(entry[1])

    def current(self, tenant: str, prefix: str | None) -> Tenant | None:
        """`tenant` as it is now, if the key it authenticated with (by prefix; None: no key, auth
        off) is still its and unrevoked; else None. Dictionary lookups only: cheap per message."""
        if prefix is not None:
            entry = self.keys.get(prefix)
            if entry is None or entry[1] != tenant:
                return None
        return self.tenants.get(tenant)

    def put_tenant(self, tenant: Tenant) -> None:
        self.tenants[tenant.name] = tenant  # revokes nothing: open sockets need no re-check

    def remove_tenant(self, name: str) -> None:
        self.tenants.pop(name, None)
        self.keys = {prefix: entry for prefix, entry in self.keys.items() if entry[1] != name}
        self._changed()

    def add_key(self, key: ApiKey, key_hash: str) -> None:
        self.keys[key.prefix] = (key_hash, key.tenant)

    def revoke_key(self, prefix: str) -> None:
        self.keys.pop(prefix, None)
        self._changed()

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()


@dataclass
class Auth:
    """What authentication needs: whether tenant keys are required, the directory, the admin key's hash."""

    enabled: bool
    directory: TenantDirectory
    admin_key_hash: str | None  # None: no admin key, the admin API refuses everyone


def resolve_admin_key(store: TenantStore, configured: str) -> tuple[str, str | None]:
    """(hash of the admin key, plaintext to show once or None).

    A configured key (env or config) wins; else the hash stored by an earlier start; else a new
    key is generated, its hash stored, and its plaintext returned for the caller to show once.
    """
    if configured:
        return hash_key(configured), None
    stored = store.setting(ADMIN_KEY_SETTING)
    if stored is not None:
        return stored, None
    key = f"{KEY_SCHEME}_admin_{secrets.token_urlsafe(32)}"
    digest = hash_key(key)
    stored = store.set_setting(ADMIN_KEY_SETTING, digest, overwrite=False).result()
    return stored, key if stored == digest else None


# ---- administration --------------------------------------------------------------------


def tenant_not_found(name: str) -> NotFoundError:
    return NotFoundError(f"The tenant `{name}` does not exist.", param="name", code="tenant_not_found")


class TenantAdmin:
    """Tenants and their keys, changed by the admin: each write commits on the writer thread, and the
    directory follows in a callback on the event loop as soon as it does, even when the admin client
    has already gone away, so memory and the DB never disagree. Reads go through a worker thread."""

    def __init__(self, store: TenantStore, directory: TenantDirectory) -> None:
        self.store = store
        self.directory = directory

    async def _commit(self, write: Future[T], apply: Callable[[T], None]) -> T:
        done = asyncio.wrap_future(write)

        def on_done(future: asyncio.Future) -> None:
            if not future.cancelled() and future.exception() is None:
                apply(future.result())

        done.add_done_callback(on_done)
        return await asyncio.shield(done)

    async def create(self, fields: Mapping[str, Any]) -> Tenant:
        """A new tenant from validated `fields` (name, weight, limits, ...)."""
        name = fields["name"]
        if is_reserved(name):
            raise InvalidRequestError(f"Tenant names starting with `{RESERVED_PREFIX}` are reserved for the "
                                      "server's own requests.", param="name", code="reserved_tenant_name")
        tenant = Tenant(**fields)
        try:
            return await self._commit(self.store.create(tenant), self.directory.put_tenant)
        except TenantExistsError as exc:
            raise ConflictError(f"The tenant `{tenant.name}` already exists.", param="name",
                                code="tenant_exists") from exc

    async def tenants(self) -> list[Tenant]:
        return await asyncio.to_thread(self.store.tenants)

    async def get(self, name: str) -> Tenant:
        tenant = await asyncio.to_thread(self.store.get, name)
        if tenant is None:
            raise tenant_not_found(name)
        return tenant

    async def update(self, name: str, changes: Mapping[str, Any]) -> Tenant:
        """Applies `changes` (field -> new value; None clears a limit)."""
        try:
            return await self._commit(self.store.update(name, changes), self.directory.put_tenant)
        except TenantNotFoundError as exc:
            raise tenant_not_found(name) from exc

    async def delete(self, name: str) -> None:
        """Deletes the tenant and its keys; the default tenant stays."""
        if name == DEFAULT_TENANT:
            raise ConflictError("The default tenant cannot be deleted.", param="name", code="default_tenant")
        try:
            await self._commit(self.store.delete(name), lambda _: self.directory.remove_tenant(name))
        except TenantNotFoundError as exc:
            raise tenant_not_found(name) from exc

    async def create_key(self, tenant: str) -> tuple[str, ApiKey]:
        """(plaintext, record) of a new key: the plaintext exists only here."""
        try:
            return await self._commit(self.store.create_key(tenant),
                                      lambda made: self.directory.add_key(made[1], hash_key(made[0])))
        except TenantNotFoundError as exc:
            raise tenant_not_found(tenant) from exc

    async def keys_of(self, tenant: str) -> list[ApiKey]:
        keys = await asyncio.to_thread(self.store.keys_of, tenant)
        if keys is None:
            raise tenant_not_found(tenant)
        return keys

    async def revoke_key(self, prefix: str) -> ApiKey:
        """Revokes the key at once (in the directory as soon as the write commits)."""
        try:
            return await self._commit(self.store.revoke_key(prefix), lambda _: self.directory.revoke_key(prefix))
        except KeyNotFoundError as exc:
            raise NotFoundError(f"No API key has the prefix `{prefix}`.", param="prefix",
                                code="key_not_found") from exc
