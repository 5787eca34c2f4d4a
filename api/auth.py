"""Who is calling: the middleware that checks API keys and the admin key against the tenant
directory (`services.tenancy`), and the `Caller` each handler passes to services.

Every request gets `request["tenant"]` (the `default` tenant when auth is off) and the prefix
of the key it came with; `caller_of` builds the request's `Caller`, which reads the tenant
again from the directory on every access, so a long-lived request (a WebSocket) sees limit
edits at once and a revoked key or deleted tenant is refused on its next message. Keys are
never logged and only their sha256 hashes are compared (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from api.services import services
from services.errors import AuthenticationError, PermissionDeniedError
from services.tenancy import (
    Auth,
    Caller,
    Tenant,
    TenantDirectory,
    hash_key,
    key_prefix,
    revoked,
)

TENANT = "tenant"  # request[TENANT]: the caller's Tenant as authenticated (handlers use `tenant_of`)
KEY_PREFIX = "api_key_prefix"  # request[KEY_PREFIX]: the prefix of the key it came with; None: no key
IS_ADMIN = "is_admin"  # request[IS_ADMIN]: the caller presented the admin key
TENANT_PATHS = ("/v1/", "/v2/", "/api/", "/ws/", "/tokenize", "/detokenize", "/rerank", "/score")
PUBLIC_PATHS = ("/v2/health/",)  # the Open Inference Protocol's liveness and readiness, as /health and /ready
WS_PATH = "/ws/"  # browsers cannot set headers on a WebSocket: these also take the key as `?token=`
ADMIN_PATH = "/admin/api/"
DEPLOYMENTS_PATH = "/api/v1/deployments"  # reads: a tenant key (its models, in summary) or the admin key (all);
# writes: the admin key (when auth is on)




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
    auth = services(request).auth
    request[TENANT] = auth.directory.default
    request[KEY_PREFIX] = None
    if request.path.startswith(ADMIN_PATH):
        authenticate_admin(request, auth)
    elif request.path.startswith(DEPLOYMENTS_PATH) and (
            auth.enabled and request.method not in ("GET", "HEAD") or presents_admin_key(request, auth)):
        authenticate_admin(request, auth)  # changing a deployment is an admin act; reading it all, too
    elif auth.enabled and request.path.startswith(TENANT_PATHS) and not request.path.startswith(PUBLIC_PATHS):
        request[TENANT] = authenticate_tenant(request, auth.directory)
    return await handler(request)


# ---- for handlers ----------------------------------------------------------------------


def current_tenant(request: web.Request) -> Tenant | None:
    """The caller's tenant as the directory has it now; None once its key is revoked or it is deleted."""
    return services(request).auth.directory.current(request[TENANT].name, request[KEY_PREFIX])


CALLER = "caller"  # request[CALLER]: the `Caller` services receive


def caller_of(request: web.Request) -> Caller:
    """Who the request is for, as services see it (built once per request)."""
    caller = request.get(CALLER)
    if caller is None:
        auth = services(request).auth
        name, prefix = request[TENANT].name, request[KEY_PREFIX]
        caller = Caller(lambda: auth.directory.current(name, prefix), request["request_id"], is_admin(request),
                        auth.enabled)
        request[CALLER] = caller
    return caller


async def add_notes_headers(request: web.Request, response: web.StreamResponse) -> None:
    """What serving the request decided, as services noted it on the caller: `X-Model-Version`
    (the version routed to) and `X-Cache` (`hit` or `miss`, when the response cache was looked up)."""
    caller = request.get(CALLER)
    if caller is None:
        return
    if caller.notes.model_version is not None:
        response.headers["X-Model-Version"] = caller.notes.model_version
    if caller.notes.cache is not None:
        response.headers["X-Cache"] = caller.notes.cache


def tenant_of(request: web.Request) -> Tenant:
    """The caller's tenant as it is now (limits, models, priority); 401 once its key is revoked."""
    return caller_of(request).tenant


def is_admin(request: web.Request) -> bool:
    """The caller presented the admin key (on /admin/api/ and /api/v1/deployments)."""
    return request.get(IS_ADMIN, False)


def check_priority_access(request: web.Request, priority: str | None) -> None:
    """403 unless the caller's tenant may ask for `priority` (high/normal/low; None: the default)."""
    caller_of(request).check_priority(priority)
