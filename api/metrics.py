"""`GET /metrics`: who may scrape, and the Prometheus text of the app's registry
(`services.observability.metrics` keeps the metrics themselves)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.auth import is_loopback, presents_admin_key, unauthorized
from api.services import services


@dataclass(frozen=True)
class MetricsAccess:
    """Who may scrape. Metrics name tenants and models: beyond loopback with auth on, they need the
    metrics token or the admin key; on a loopback-only bind (or without auth, which implies one) they stay open."""

    protected: bool
    token: str = ""  # "": no metrics token, the admin key only

    @classmethod
    def for_bind(cls, auth_enabled: bool, bind_host: str, token: str) -> MetricsAccess:
        return cls(auth_enabled and not is_loopback(bind_host), token)

    def allows(self, request: web.Request) -> bool:
        if not self.protected or presents_admin_key(request, services(request).auth):
            return True
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        return bool(self.token) and scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode("utf-8", "surrogatepass"), self.token.encode())  # undecodable bytes: surrogates


METRICS_ACCESS = web.AppKey("metrics_access", MetricsAccess)  # only this module reads it


async def metrics_endpoint(request: web.Request) -> web.Response:
    if not request.app[METRICS_ACCESS].allows(request):
        raise unauthorized("/metrics needs the metrics token (`[observability] metrics_token`) or the admin key "
                           "as `Authorization: Bearer <token>`.", "metrics_token_required")
    body = generate_latest(services(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
