"""Response cache for deterministic requests: LRU with a TTL and a size bound, per tenant.

Embeddings and classifications are always deterministic; generations are when greedy
(temperature 0) or seeded. The key is (tenant, model, version, normalised input, params),
hashed, so a tenant never sees another's entries (unless `shared_across_tenants`) and a new
model version never serves an old answer. A request opts out with `"galley": {"cache": false}`
or `Cache-Control: no-cache`. A generation looked up here answers with `X-Cache: hit` or `X-Cache: miss`.
Lives on the event loop; plain synchronous state.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from api.auth import tenant_limits, tenant_of
from api.context import ROUTER
from scheduling.admission import Rejected
from services.errors import rate_limited
from services.observability.metrics import METRICS


@dataclass(frozen=True)
class ResponseCacheConfig:
    enabled: bool = True
    max_entries: int = 4096  # least recently used entries go first beyond this
    ttl_seconds: float = 300.0  # an entry older than this is a miss
    shared_across_tenants: bool = False  # True: one tenant's answer may serve another's identical request


def cache_key(tenant: str, model: str, version: str, inputs: Any, params: dict) -> str:
    """A stable digest of the parts; `params` keys are sorted, so field order never matters."""
    raw = orjson.dumps([tenant, model, version, inputs, params], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


class ResponseCache:
    """Invariant: at most `max_entries` entries, ordered from least to most recently used."""

    def __init__(self, config: ResponseCacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored_s, value = entry
        if self.clock() - stored_s > self.config.ttl_seconds:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: Any) -> None:
        if not self.config.enabled or self.config.max_entries <= 0:
            return
        self._entries[key] = (self.clock(), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.config.max_entries:
            self._entries.popitem(last=False)


RESPONSE_CACHE = web.AppKey("response_cache", ResponseCache)
SHARED_SCOPE = "*"  # never a tenant name (they start with a letter or digit)
CACHE_STATUS = "cache_status"  # request[CACHE_STATUS]: "hit" | "miss", sent as the X-Cache header


def cache_scope(request: web.Request) -> str:
    """Whose entries a request may see: its tenant's, or everyone's with `shared_across_tenants`
    (the tenant was already checked for access to the model)."""
    if request.app[RESPONSE_CACHE].config.shared_across_tenants:
        return SHARED_SCOPE
    return tenant_of(request).name


def wants_cache(request: web.Request, body_flag: bool | None) -> bool:
    """Off when the cache is disabled, the body says `galley.cache: false` or the headers say no-cache."""
    if not request.app[RESPONSE_CACHE].config.enabled or body_flag is False:
        return False
    directives = {d.strip().lower() for d in request.headers.get("Cache-Control", "").split(",")}
    return not directives & {"no-cache", "no-store"}


def admit_hit(request: web.Request, model_name: str) -> None:
    """A cache hit is still one of its tenant's requests: it counts against `requests_per_minute`
    and `max_concurrent` like any other, and over them is refused with the same 429 (it computed
    no tokens, so `tokens_per_minute` is not charged)."""
    limits, _ = tenant_limits(request)
    admission = request.app[ROUTER].admission
    try:
        admission.release(admission.admit(limits, 0), 0)
    except Rejected as exc:
        request.app[METRICS].rejected.labels(model_name, exc.reason).inc()
        raise rate_limited(exc) from exc


def mark_lookup(request: web.Request, hit: bool) -> None:
    """Remember for the X-Cache header whether this request's answer came from the cache."""
    request[CACHE_STATUS] = "hit" if hit else "miss"


async def add_cache_header(request: web.Request, response: web.StreamResponse) -> None:
    if CACHE_STATUS in request:
        response.headers["X-Cache"] = request[CACHE_STATUS]
