"""The response cache (the API's façade onto it)."""

from services.cache.responses import CachedCompletion

__all__ = ["CachedCompletion"]
