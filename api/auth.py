"""Who is calling: API keys -> tenants, the admin key, and the middleware that checks them.

Owns the in-memory `TenantDirectory` (the DB's tenants and unrevoked keys), loaded once at
startup and updated by the admin handlers the moment each write commits, so a request never
waits on SQLite and a revoked key is refused at once. Every request gets `request["tenant"]`
(the `default` tenant when auth is off) and the prefix of the key it came with; `tenant_of`
reads the tenant again from the directory on every call, so a long-lived request (a
WebSocket) sees limit edits at once and a revoked key or deleted tenant is refused on its
next message. Keys are never logged and only their sha256 hashes are compared
(`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from scheduling.admission import TenantLimits
from services.errors import AuthenticationError, PermissionDeniedError
from services.tenancy import Caller, revoked
from storage import tenants
from storage.db import Database
from storage.tenants import DEFAULT_TENANT, ApiKey, Tenant, hash_key, key_prefix

TENANT = "tenant"  # request[TENANT]: the caller's Tenant as authenticated (handlers use `tenant_of`)
KEY_PREFIX = "api_key_prefix"  # request[KEY_PREFIX]: the prefix of the key it came with; None: no key
IS_ADMIN = "is_admin"  # request[IS_ADMIN]: the caller presented the admin key
ADMIN_KEY_SETTING = "admin_key_hash"
TENANT_PATHS = ("/v1/", "/api/", "/ws/")
WS_PATH = "/ws/"  # browsers cannot set headers on a WebSocket: these also take the key as `?token=`
ADMIN_PATH = "/admin/api/"
DEPLOYMENTS_PATH = "/api/v1/deployments"  # reads: a tenant key (its models, in summary) or the admin key (all);
# writes: the admin key (when auth is on)


@dataclass
class TenantDirectory:
    """Tenants and unrevoked keys, as committed. Invariant: `default` is present; each key's tenant is."""

    tenants: dict[str, Tenant]
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # prefix -> (key sha256 hex, tenant)
    listeners: list[Callable[[], None]] = field(default_factory=list)  # called after a change that may revoke

    @classmethod
    def load(cls, db: Database) -> TenantDirectory:
        listed = db.read(tenants.list_tenants)
        active = db.read(tenants.active_keys)
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
    """What the middleware needs: whether tenant keys are required, the directory, the admin key's hash."""

    enabled: bool
    directory: TenantDirectory
    admin_key_hash: str | None  # None: no admin key, the admin API refuses everyone


AUTH = web.AppKey("auth", Auth)
DATABASE = web.AppKey("database", Database)


def resolve_admin_key(db: Database, configured: str) -> tuple[str, str | None]:
    """(hash of the admin key, plaintext to show once or None).

    A configured key (env or config) wins; else the hash stored by an earlier start; else a new
    key is generated, its hash stored, and its plaintext returned for the caller to show once.
    """
    if configured:
        return hash_key(configured), None
    stored = db.read(lambda d: tenants.get_setting(d, ADMIN_KEY_SETTING))
    if stored is not None:
        return stored, None
    key = f"{tenants.KEY_SCHEME}_admin_{secrets.token_urlsafe(32)}"
    digest = hash_key(key)
    stored = db.write(lambda d: tenants.set_setting(d, ADMIN_KEY_SETTING, digest, overwrite=False)).result()
    return stored, key if stored == digest else None


def bearer_token(request: web.Request) -> str:
    header = request.headers.get("Authorization")
    if header is None:
        raise unauthorized("Missing API key: send it as `Authorization: Bearer <key>`.", "missing_api_key")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("Malformed Authorization header: expected `Bearer <key>`.", "invalid_authorization")
    return token


def unauthorized(message: str, code: str) -> AuthenticationError:
    return AuthenticationError(message, code=code)


def tenant_key(request: web.Request) -> str:
    """The key in `Authorization: Bearer`, or on /ws/ paths without that header, in `?token=`."""
    if request.path.startswith(WS_PATH) and "Authorization" not in request.headers:
        if "token" not in request.query:
            raise unauthorized("Missing API key: send it as `Authorization: Bearer <key>` or `?token=<key>`.",
                               "missing_api_key")
        return request.query["token"]
    return bearer_token(request)


def authenticate_tenant(request: web.Request, directory: TenantDirectory) -> Tenant:
    key = tenant_key(request)
    tenant = directory.tenant_for_key(key)
    if tenant is None:
        raise revoked()
    request[KEY_PREFIX] = key_prefix(key)
    return tenant


def is_loopback(host: str) -> bool:
    """A bind address only this machine can reach (0.0.0.0 and :: are every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_admin_key(auth: Auth, token: str) -> bool:
    return auth.admin_key_hash is not None and hmac.compare_digest(auth.admin_key_hash, hash_key(token))


def presents_admin_key(request: web.Request, auth: Auth) -> bool:
    """True when `Authorization: Bearer` carries the admin key (no error otherwise)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and is_admin_key(auth, token.strip())


def authenticate_admin(request: web.Request, auth: Auth) -> None:
    token = bearer_token(request)
    if is_admin_key(auth, token):
        request[IS_ADMIN] = True
        return
    if auth.directory.tenant_for_key(token) is not None:
        raise PermissionDeniedError("The admin API needs the admin key; this is a tenant key.",
                                    code="admin_key_required")
    raise unauthorized("Invalid admin key.", "invalid_api_key")


@web.middleware
async def auth_middleware(request: web.Request, handler):
    auth = request.app[AUTH]
    request[TENANT] = auth.directory.default
    request[KEY_PREFIX] = None
    if request.path.startswith(ADMIN_PATH):
        authenticate_admin(request, auth)
    elif request.path.startswith(DEPLOYMENTS_PATH) and (
            auth.enabled and request.method not in ("GET", "HEAD") or presents_admin_key(request, auth)):
        authenticate_admin(request, auth)  # changing a deployment is an admin act; reading it all, too
    elif auth.enabled and request.path.startswith(TENANT_PATHS):
        request[TENANT] = authenticate_tenant(request, auth.directory)
    return await handler(request)


# ---- for handlers ----------------------------------------------------------------------


def current_tenant(request: web.Request) -> Tenant | None:
    """The caller's tenant as the directory has it now; None once its key is revoked or it is deleted."""
    return request.app[AUTH].directory.current(request[TENANT].name, request[KEY_PREFIX])


CALLER = "caller"  # request[CALLER]: the `Caller` services receive


def caller_of(request: web.Request) -> Caller:
    """Who the request is for, as services see it (built once per request)."""
    caller = request.get(CALLER)
    if caller is None:
        auth = request.app[AUTH]
        name, prefix = request[TENANT].name, request[KEY_PREFIX]
        caller = Caller(lambda: auth.directory.current(name, prefix), request["request_id"], is_admin(request),
                        auth.enabled)
        request[CALLER] = caller
    return caller


def request_priority(request: web.Request, asked: str | None) -> str:
    return caller_of(request).priority(asked)


def tenant_of(request: web.Request) -> Tenant:
    """The caller's tenant as it is now (limits, models, priority); 401 once its key is revoked."""
    return caller_of(request).tenant


def is_admin(request: web.Request) -> bool:
    """The caller presented the admin key (on /admin/api/ and /api/v1/deployments)."""
    return request.get(IS_ADMIN, False)


def tenant_limits(request: web.Request) -> tuple[TenantLimits, float]:
    """The caller's tenant's admission limits as they are now, and its fair-share weight."""
    return caller_of(request).limits()


def check_model_access(request: web.Request, model_name: str) -> None:
    """403 unless the caller's tenant may use `model_name`."""
    caller_of(request).check_model(model_name)


def check_priority_access(request: web.Request, priority: str | None) -> None:
    """403 unless the caller's tenant may ask for `priority` (high/normal/low; None: the default)."""
    caller_of(request).check_priority(priority)
