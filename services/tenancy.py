"""Who a request is for: the `Caller` services receive instead of an HTTP request.

`api/auth.py` authenticates and builds one per request; a service reads the tenant through it
as it is *now* (`caller.tenant`), so an edit or revocation made while the request waits takes
effect at its next check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduling.admission import TenantLimits
from services.errors import AuthenticationError, PermissionDeniedError
from storage.tenants import Tenant


def revoked() -> AuthenticationError:
    return AuthenticationError("Invalid API key: unknown or revoked.", code="invalid_api_key")


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its tenant (re-read on each access), the request id and whether it
    presented the admin key."""

    lookup: Callable[[], Tenant | None]  # the tenant as the directory has it now; None once revoked
    request_id: str
    is_admin: bool = False
    auth_enabled: bool = True

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
