"""The response cache's policy, without a server: which requests it may answer, whose entries a
caller sees, and that a hit is counted and admitted exactly once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter

from engine.types import SamplingParams
from services.cache.response_cache import CachedCompletion, ResponseCache, ResponseCacheConfig
from services.errors import RateLimitError
from services.tenancy import Caller
from storage.tenants import Tenant

MODEL = SimpleNamespace(name="m", version="1")


class Admitted:
    """A stand-in for `Admission`: records cache hits, or refuses them."""

    def __init__(self, refuse: bool = False) -> None:
        self.hits: list[tuple[str, str]] = []
        self.refuse = refuse

    def cache_hit(self, model_name: str, limits) -> None:
        if self.refuse:
            raise RateLimitError("over the limit", retry_after_s=1)
        self.hits.append((model_name, limits.name))


def params(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=8, **fields)


def make_cache(config: ResponseCacheConfig | None = None, refuse: bool = False):
    config = config or ResponseCacheConfig()
    registry = CollectorRegistry()
    metrics = SimpleNamespace(cache_hits=Counter("hits", "", ["model"], registry=registry),
                              cache_misses=Counter("misses", "", ["model"], registry=registry))
    admission = Admitted(refuse)
    return ResponseCache(config, metrics, admission), admission, registry


def caller(name: str) -> Caller:
    tenant = Tenant(name)
    return Caller(lambda: tenant, "req-1")


def counts(registry: CollectorRegistry) -> tuple[float, float]:
    hits = registry.get_sample_value("hits_total", {"model": "m"}) or 0
    misses = registry.get_sample_value("misses_total", {"model": "m"}) or 0
    return hits, misses


def test_only_deterministic_generations_without_logprobs_or_conversation_are_keyed():
    cache, _, _ = make_cache()
    alice = caller("alice")
    key = cache.generation_key(alice, MODEL, [1, 2], params(temperature=0), None, "openai")
    assert key is not None
    assert cache.generation_key(alice, MODEL, [1, 2], params(temperature=0.7, seed=3), None, "openai")
    assert cache.generation_key(alice, MODEL, [1, 2], params(temperature=0.7), None, "openai") is None
    assert cache.generation_key(alice, MODEL, [1, 2], params(temperature=0, logprobs=0), None,
                                "openai") is None
    assert cache.generation_key(alice, MODEL, [1, 2], params(temperature=0), None, "openai", "conv") is None
    assert cache.generation_key(alice, MODEL, [1, 2], params(temperature=0), False, "openai") is None
    # endpoints that store different shapes never share an entry
    assert cache.generation_key(alice, MODEL, [1, 2], params(temperature=0), None, "native") != key


def test_a_disabled_cache_is_never_wanted():
    cache, _, _ = make_cache(ResponseCacheConfig(enabled=False))
    assert not cache.wants(None) and not cache.wants(True)
    assert cache.generation_key(caller("a"), MODEL, [1], params(temperature=0), True, "openai") is None


def test_tenants_see_only_their_entries_unless_shared():
    cache, _, _ = make_cache()
    assert cache.key(caller("alice"), MODEL, "x", {}) != cache.key(caller("bob"), MODEL, "x", {})
    cache.config = ResponseCacheConfig(shared_across_tenants=True)
    assert cache.key(caller("alice"), MODEL, "x", {}) == cache.key(caller("bob"), MODEL, "x", {})


def test_a_hit_is_admitted_and_counted_a_miss_only_counted():
    cache, admission, registry = make_cache()
    alice = caller("alice")
    key = cache.key(alice, MODEL, "x", {})
    assert cache.lookup(alice, "m", key) is None
    assert admission.hits == [] and counts(registry) == (0, 1)
    cache.remember_completion(key, "text", "stop", {"total_tokens": 3})
    assert cache.lookup(alice, "m", key) == CachedCompletion("text", "stop", {"total_tokens": 3})
    assert admission.hits == [("m", "alice")] and counts(registry) == (1, 1)
    assert cache.lookup(alice, "m", None) is None and counts(registry) == (1, 1)  # not cacheable: not counted


def test_an_unfinished_generation_is_not_remembered():
    cache, _, _ = make_cache()
    cache.remember_completion("k", "partial", None, {"total_tokens": 3})
    cache.remember_completion("k2", "text", "stop", None)
    assert len(cache.entries) == 0


def test_inputs_are_counted_each_and_admitted_only_when_all_hit():
    cache, admission, registry = make_cache()
    alice = caller("alice")
    keys = [cache.key(alice, MODEL, item, {}) for item in ("a", "b")]
    cache.remember(keys[0], "A")
    assert cache.lookup_many(alice, "m", keys) == ["A", None]
    assert admission.hits == [] and counts(registry) == (1, 1)
    cache.remember(keys[1], "B")
    assert cache.lookup_many(alice, "m", keys) == ["A", "B"]
    assert admission.hits == [("m", "alice")] and counts(registry) == (3, 1)


def test_a_refused_hit_is_not_counted():
    cache, _, registry = make_cache(refuse=True)
    alice = caller("alice")
    key = cache.key(alice, MODEL, "x", {})
    cache.remember(key, "X")
    with pytest.raises(RateLimitError):
        cache.lookup(alice, "m", key)
    assert counts(registry) == (0, 0)
