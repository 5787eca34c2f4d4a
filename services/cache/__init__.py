"""The response cache (the API's façade onto it)."""

from services.cache.response_cache import CachedCompletion

__all__ = ["CachedCompletion"]
