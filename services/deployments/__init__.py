"""The registry view, loading, canaries and shadows; a model version's options and a deployment's
resources (the API's façade)."""

from services.deployments.loading import VersionState
from services.deployments.manager import Served
from services.deployments.options import KINDS, OPTIONS, SPECULATIVE_KEYS, Option
from services.deployments.resources import QUANTITY, Resources, parse_quantity, read_resources

__all__ = ["KINDS", "OPTIONS", "Option", "QUANTITY", "Resources", "SPECULATIVE_KEYS", "Served", "VersionState",
           "parse_quantity", "read_resources"]
