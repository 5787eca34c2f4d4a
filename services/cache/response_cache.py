"""The response cache for deterministic requests: one policy for every endpoint that uses it.

Embeddings and classifications are always deterministic; generations are when greedy
(temperature 0) or seeded, with no logprobs and no conversation (a conversation turn writes
history). An answer is stored under a digest of (scope, model, version, normalised input,
params): the scope is the caller's tenant, so a tenant never sees another's entries (unless
`shared_across_tenants`), and a new model version never serves an old answer. A caller opts out
with `"galley": {"cache": false}` (the HTTP layer also maps `Cache-Control: no-cache` to that).
A hit is still one of its tenant's requests: it passes admission (`Admission.cache_hit`) before
it is served. Entries are LRU with a TTL and a size bound. Lives on the event loop; plain
synchronous state.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from engine.types import ImageInputs, SamplingParams
from scheduling.router import Served
from services.admission import Admission
from services.answers.deltas import call_ids_of
from services.observability.metrics import Metrics
from services.streams.hub import LiveStream, StreamStatus, params_to_json
from services.tenancy import Caller

SHARED_SCOPE = "*"  # never a tenant name (they start with a letter or digit)
FINISHED = ("stop", "length")  # only complete generations are stored


@dataclass(frozen=True)
class ResponseCacheConfig:
    enabled: bool = True
    max_entries: int = 4096  # least recently used entries go first beyond this
    ttl_seconds: float = 300.0  # an entry older than this is a miss
    shared_across_tenants: bool = False  # True: one tenant's answer may serve another's identical request


def cache_key(scope: str, model: str, version: str, inputs: Any, params: dict) -> str:
    """A stable digest of the parts; `params` keys are sorted, so field order never matters."""
    raw = orjson.dumps([scope, model, version, inputs, params], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


class CacheEntries:
    """The stored answers. Invariant: at most `max_entries`, ordered from least to most recently used."""

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


@dataclass(frozen=True)
class CachedCompletion:
    """A finished generation as /v1/completions and /v1/chat/completions replay it."""

    text: str  # raw: thoughts and tool calls are read from it as from the first answer's stream
    finish_reason: str
    usage: dict
    call_ids: str = ""  # what the first answer's tool-call ids derived from (`services.answers.deltas`)


class ResponseCache:
    """The one response cache: its policy (`wants`, `scope`, `key`, `generation_key`), lookups that
    count hits and misses and admit a hit, and `remember`. `config` may be swapped whole; the
    entries follow it."""

    def __init__(self, config: ResponseCacheConfig, metrics: Metrics, admission: Admission,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.entries = CacheEntries(config, clock)
        self.metrics = metrics
        self.admission = admission

    @property
    def config(self) -> ResponseCacheConfig:
        return self.entries.config

    @config.setter
    def config(self, config: ResponseCacheConfig) -> None:
        self.entries.config = config

    # ---- policy: whether, and under which key ----------------------------------------------

    def wants(self, asked: bool | None) -> bool:
        """Off when the cache is disabled or the caller asked for no cache (`asked` is False)."""
        return self.config.enabled and asked is not False

    def scope(self, caller: Caller) -> str:
        """Whose entries a caller may see: its tenant's, or everyone's with `shared_across_tenants`
        (the tenant was already checked for access to the model)."""
        return SHARED_SCOPE if self.config.shared_across_tenants else caller.tenant.name

    def key(self, caller: Caller, model: Served, inputs: Any, params: dict) -> str:
        return cache_key(self.scope(caller), model.name, model.version, inputs, params)

    def generation_key(self, caller: Caller, model: Served, prompt_ids: list[int], params: SamplingParams,
                       asked: bool | None, api: str, conversation_id: str | None = None,
                       images: ImageInputs | None = None) -> str | None:
        """The key of a generation whose answer may come from (and go to) the cache, else None.
        `api` keeps apart the entries of endpoints that store different shapes; a prompt's images
        are part of it (their tokens are the same whatever the image)."""
        deterministic = params.temperature == 0 or params.seed is not None
        if not deterministic or params.logprobs is not None or conversation_id:
            return None
        if not self.wants(asked):
            return None
        return self.key(caller, model, prompt_ids, {**params_to_json(params), "api": api,
                                                    **({"images": list(images.digests)} if images else {})})

    # ---- lookup and remember ---------------------------------------------------------------

    def lookup(self, caller: Caller, model_name: str, key: str | None) -> Any | None:
        """The cached answer for `key` (None: not cacheable, or a miss); counts the hit or miss
        and admits a hit (a 429 over the tenant's limits)."""
        if key is None:
            return None
        found = self.entries.get(key)
        if found is not None:
            self._admit_hit(caller, model_name)
        (self.metrics.cache_hits if found is not None else self.metrics.cache_misses).labels(model_name).inc()
        caller.notes.cache = "hit" if found is not None else "miss"
        return found

    def lookup_many(self, caller: Caller, model_name: str, keys: Sequence[str]) -> list[Any | None]:
        """One answer or None per key (an encoder request's inputs), counted per key. Only when
        every key hits is the request admitted as a cache hit: otherwise the model runs, and
        admission charges the request then."""
        found = [self.entries.get(key) for key in keys]
        hits = sum(value is not None for value in found)
        if hits == len(keys):
            self._admit_hit(caller, model_name)
        self.metrics.cache_hits.labels(model_name).inc(hits)
        self.metrics.cache_misses.labels(model_name).inc(len(keys) - hits)
        caller.notes.cache = "hit" if hits == len(keys) else "miss"  # a hit only when the model need not run
        return found

    def _admit_hit(self, caller: Caller, model_name: str) -> None:
        limits, _ = caller.limits()
        self.admission.cache_hit(model_name, limits)

    def remember(self, key: str | None, value: Any) -> None:
        if key is not None:
            self.entries.put(key, value)

    def remember_completion(self, key: str | None, text: str, finish: str | None, usage: dict | None,
                            call_ids: str = "") -> None:
        """Store a generation that finished normally (stop or length) with its usage."""
        if key is not None and finish in FINISHED and usage is not None:
            self.entries.put(key, CachedCompletion(text, finish, usage, call_ids))

    def remember_live(self, key: str | None, live: LiveStream) -> None:
        """Store a streamed answer once its stream has finished normally."""
        if key is None or not live.done or live.status != StreamStatus.FINISHED or not live.events:
            return
        last = live.events[-1]
        self.remember_completion(key, "".join(e.text for e in live.events), last.finish_reason, last.usage,
                                 call_ids_of(live.fmt.id))
