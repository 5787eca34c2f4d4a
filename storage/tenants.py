"""Tenants, their API keys and server settings: tables `tenants`, `api_keys`, `settings`.

Sync functions over a `sqlite_utils.Database` (writes belong on the writer thread,
`storage.db.Database.write`), and `TenantStore`, through which the rest of galley reaches
them. A key is stored only as its sha256 hex plus a short public prefix: the plaintext
exists only in `create_key`'s return value. Must not import anything but the standard
library and sqlite_utils.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import sqlite3
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlite_utils

if TYPE_CHECKING:
    from storage.db import Database  # storage.db imports this module for its migrations

PRIORITIES = ("high", "normal", "low")  # highest first
DEFAULT_TENANT = "default"
LIMITS = ("max_concurrent", "requests_per_minute", "tokens_per_minute", "max_tokens")
KEY_SCHEME = "gk"
RESERVED_PREFIX = "galley-"  # the server's own tenants (galley-shadow, galley-warmup): never created by an admin


def is_reserved(name: str) -> bool:
    """Names the server uses for its own requests; a tenant so named would share their admission state."""
    return name.lower().startswith(RESERVED_PREFIX)


class TenantExistsError(Exception):
    pass


class TenantNotFoundError(LookupError):
    pass


class KeyNotFoundError(LookupError):
    pass


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def new_tenant_id() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to. Invariant: weight > 0, max_priority in PRIORITIES, limits None or >= 1."""

    name: str
    weight: float = 1.0
    max_priority: str = "high"  # the highest priority its requests may use
    allowed_models: tuple[str, ...] | None = None  # None: every model
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion
    max_tokens: int | None = None  # cap per request
    created_at: str = field(default_factory=utc_now)
    id: str = field(default_factory=new_tenant_id)  # stable; a tenant re-created under the same name gets a new one

    def __post_init__(self) -> None:
        if self.allowed_models is not None and not isinstance(self.allowed_models, tuple):
            object.__setattr__(self, "allowed_models", tuple(self.allowed_models))
        object.__setattr__(self, "weight", float(self.weight))
        if not self.name:
            raise ValueError("tenant name must not be empty")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        if self.max_priority not in PRIORITIES:
            raise ValueError(f"max_priority must be one of {PRIORITIES}, got {self.max_priority!r}")
        for name in LIMITS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")

    def allows_model(self, name: str) -> bool:
        return self.allowed_models is None or name in self.allowed_models

    def allows_priority(self, priority: str) -> bool:
        """True when `priority` is at or below max_priority; ValueError for an unknown priority."""
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}; one of {PRIORITIES}")
        return PRIORITIES.index(priority) >= PRIORITIES.index(self.max_priority)


@dataclass(frozen=True)
class ApiKey:
    """A key's public record; its secret part is never stored."""

    prefix: str
    tenant: str
    created_at: str
    revoked_at: str | None = None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()  # undecodable header bytes are surrogates


def key_prefix(key: str) -> str | None:
    """The prefix of a `gk_<prefix>_<secret>` key, or None when the key has another shape."""
    scheme, _, rest = key.partition("_")
    prefix, _, secret = rest.partition("_")
    return prefix if scheme == KEY_SCHEME and prefix and secret else None


# ---- schema ----------------------------------------------------------------------------


def create_tenant_tables(db: sqlite_utils.Database) -> None:
    """Migration: tenants, api_keys, settings, and the `default` tenant."""
    limits = ",\n".join(f"{name} INTEGER CHECK ({name} IS NULL OR {name} >= 1)" for name in LIMITS)
    db.execute(f"""
        CREATE TABLE tenants (
            name TEXT PRIMARY KEY,
            weight REAL NOT NULL CHECK (weight > 0),
            max_priority TEXT NOT NULL CHECK (max_priority IN ('high', 'normal', 'low')),
            allowed_models TEXT,  -- JSON list; NULL: every model
            {limits},
            created_at TEXT NOT NULL
        )""")
    db.execute("""
        CREATE TABLE api_keys (
            prefix TEXT PRIMARY KEY,
            key_hash TEXT NOT NULL UNIQUE,
            tenant TEXT NOT NULL REFERENCES tenants(name),
            created_at TEXT NOT NULL,
            revoked_at TEXT
        )""")
    db.execute("CREATE INDEX api_keys_tenant ON api_keys(tenant)")
    db.execute("CREATE TABLE settings (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
    default = to_row(Tenant(DEFAULT_TENANT))
    del default["id"]  # the schema of this migration has no id yet: add_tenant_ids gives it one
    db.table("tenants").insert(default)


def add_tenant_ids(db: sqlite_utils.Database) -> None:
    """Migration: a stable id per tenant, so what a tenant owned (streams) is never taken for a later
    tenant of the same name."""
    db.execute("ALTER TABLE tenants ADD COLUMN id TEXT")
    db.execute("UPDATE tenants SET id = lower(hex(randomblob(8)))")
    db.execute("CREATE UNIQUE INDEX tenants_id ON tenants(id)")


def to_row(tenant: Tenant) -> dict[str, Any]:
    row = dataclasses.asdict(tenant)
    if tenant.allowed_models is not None:
        row["allowed_models"] = json.dumps(list(tenant.allowed_models))
    return row


def from_row(row: Mapping[str, Any]) -> Tenant:
    models = row["allowed_models"]
    return Tenant(**{**row, "allowed_models": None if models is None else tuple(json.loads(models))})


def key_from_row(row: Mapping[str, Any]) -> ApiKey:
    return ApiKey(row["prefix"], row["tenant"], row["created_at"], row["revoked_at"])


# ---- tenants ---------------------------------------------------------------------------


def create_tenant(db: sqlite_utils.Database, tenant: Tenant) -> Tenant:
    try:
        db.table("tenants").insert(to_row(tenant))
    except sqlite3.IntegrityError as exc:
        raise TenantExistsError(tenant.name) from exc
    return tenant


def get_tenant(db: sqlite_utils.Database, name: str) -> Tenant | None:
    rows = list(db.query("SELECT * FROM tenants WHERE name = ?", [name]))
    return from_row(rows[0]) if rows else None


def list_tenants(db: sqlite_utils.Database) -> list[Tenant]:
    return [from_row(row) for row in db.query("SELECT * FROM tenants ORDER BY name")]


def update_tenant(db: sqlite_utils.Database, name: str, changes: Mapping[str, Any]) -> Tenant:
    """Applies `changes` (field -> new value; None clears a limit) and returns the new tenant."""
    frozen = {"name", "created_at", "id"} & set(changes)
    if frozen:
        raise ValueError(f"cannot change {sorted(frozen)}")
    current = get_tenant(db, name)
    if current is None:
        raise TenantNotFoundError(name)
    updated = dataclasses.replace(current, **changes)
    db.table("tenants").update(name, to_row(updated))
    return updated


def delete_tenant(db: sqlite_utils.Database, name: str) -> None:
    """Deletes the tenant and every key it had (revoked or not)."""
    if name == DEFAULT_TENANT:
        raise ValueError("the default tenant cannot be deleted")
    if get_tenant(db, name) is None:
        raise TenantNotFoundError(name)
    db.execute("DELETE FROM api_keys WHERE tenant = ?", [name])
    db.execute("DELETE FROM tenants WHERE name = ?", [name])


# ---- keys ------------------------------------------------------------------------------


def create_key(db: sqlite_utils.Database, tenant: str) -> tuple[str, ApiKey]:
    """A new key for `tenant`: (plaintext, record). Only the plaintext's sha256 is stored."""
    if get_tenant(db, tenant) is None:
        raise TenantNotFoundError(tenant)
    while True:
        prefix = secrets.token_hex(4)
        if not list(db.query("SELECT 1 FROM api_keys WHERE prefix = ?", [prefix])):
            break
    plaintext = f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}"
    key = ApiKey(prefix, tenant, utc_now())
    db.table("api_keys").insert({**dataclasses.asdict(key), "key_hash": hash_key(plaintext)})
    return plaintext, key


def list_keys(db: sqlite_utils.Database, tenant: str) -> list[ApiKey]:
    rows = db.query("SELECT * FROM api_keys WHERE tenant = ? ORDER BY created_at, prefix", [tenant])
    return [key_from_row(row) for row in rows]


def active_keys(db: sqlite_utils.Database) -> list[tuple[ApiKey, str]]:
    """Every unrevoked key with its hash: what the in-memory directory is loaded from."""
    rows = db.query("SELECT * FROM api_keys WHERE revoked_at IS NULL ORDER BY prefix")
    return [(key_from_row(row), row["key_hash"]) for row in rows]


def revoke_key(db: sqlite_utils.Database, prefix: str) -> ApiKey:
    """Marks the key revoked (keeping the first revocation time) and returns it."""
    db.execute("UPDATE api_keys SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL", [utc_now(), prefix])
    rows = list(db.query("SELECT * FROM api_keys WHERE prefix = ?", [prefix]))
    if not rows:
        raise KeyNotFoundError(prefix)
    return key_from_row(rows[0])


def find_tenant_by_key_hash(db: sqlite_utils.Database, key_hash: str) -> Tenant | None:
    """The tenant of an unrevoked key, by the key's sha256 hex."""
    rows = list(db.query(
        "SELECT tenants.* FROM api_keys JOIN tenants ON tenants.name = api_keys.tenant "
        "WHERE api_keys.key_hash = ? AND api_keys.revoked_at IS NULL", [key_hash]))
    return from_row(rows[0]) if rows else None


# ---- settings --------------------------------------------------------------------------


def get_setting(db: sqlite_utils.Database, name: str) -> str | None:
    rows = list(db.query("SELECT value FROM settings WHERE name = ?", [name]))
    return rows[0]["value"] if rows else None


def set_setting(db: sqlite_utils.Database, name: str, value: str, overwrite: bool = True) -> str:
    """Stores `value` (unless one exists and not `overwrite`) and returns the stored value."""
    verb = "INSERT OR REPLACE" if overwrite else "INSERT OR IGNORE"
    db.execute(f"{verb} INTO settings (name, value) VALUES (?, ?)", [name, value])
    stored = get_setting(db, name)
    assert stored is not None
    return stored


# ---- the store -------------------------------------------------------------------------


class TenantStore:
    """Tenants, keys and settings in one database: the only way the rest of galley reaches these tables.

    Reads block (from asyncio, call them through `asyncio.to_thread`); writes run on the
    writer thread and return its `Future`, so a caller can act the moment one commits."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def tenants(self) -> list[Tenant]:
        return self.db.read(list_tenants)

    def get(self, name: str) -> Tenant | None:
        return self.db.read(lambda db: get_tenant(db, name))

    def keys_of(self, tenant: str) -> list[ApiKey] | None:
        """The tenant's keys (revoked ones too); None when there is no such tenant."""
        return self.db.read(lambda db: None if get_tenant(db, tenant) is None else list_keys(db, tenant))

    def active_keys(self) -> list[tuple[ApiKey, str]]:
        return self.db.read(active_keys)

    def setting(self, name: str) -> str | None:
        return self.db.read(lambda db: get_setting(db, name))

    def create(self, tenant: Tenant) -> Future[Tenant]:
        return self.db.write(lambda db: create_tenant(db, tenant))

    def update(self, name: str, changes: Mapping[str, Any]) -> Future[Tenant]:
        return self.db.write(lambda db: update_tenant(db, name, changes))

    def delete(self, name: str) -> Future[None]:
        return self.db.write(lambda db: delete_tenant(db, name))

    def create_key(self, tenant: str) -> Future[tuple[str, ApiKey]]:
        return self.db.write(lambda db: create_key(db, tenant))

    def revoke_key(self, prefix: str) -> Future[ApiKey]:
        return self.db.write(lambda db: revoke_key(db, prefix))

    def set_setting(self, name: str, value: str, overwrite: bool = True) -> Future[str]:
        return self.db.write(lambda db: set_setting(db, name, value, overwrite))
