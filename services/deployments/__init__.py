"""The registry view, loading, canaries and shadows; a model version's options (the API's façade)."""

from services.deployments.loading import VersionState
from services.deployments.manager import Served
from services.deployments.options import KINDS, OPTIONS, SPECULATIVE_KEYS, Option

__all__ = ["KINDS", "OPTIONS", "Option", "SPECULATIVE_KEYS", "Served", "VersionState"]
