"""What the registry holds, as readers see it: a model name's kind, its OpenAI model card
(`GET /v1/models`), each version's state, one registered version by name, and the same as
Prometheus metrics (`LifecycleMetrics`: the versions loaded per device and their states,
gathered at scrape time, and the load, unload and rollback counters the lifecycle bumps).

Reads only: the manager's `versions` (its registry view, shared) and the router's deployments.
A version attached to the router without the registry (tests) counts too, as `ready`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from scheduling.encoders import ServedEncoder
from scheduling.rollout import parse_model_ref
from scheduling.router import Router, ServedModel
from services.deployments.loading import VersionState
from services.errors import ModelNotFoundError
from services.sampling import model_defaults


def kind_of(router: Router, versions: dict[str, VersionState], name: str) -> str | None:
    """A model name's kind: from the registry, else from a loaded version (attached without the registry)."""
    registered = next((vs.spec.kind for vs in versions.values() if vs.spec.name == name), None)
    deployment = router.deployments.get(name)
    served = next(iter(deployment.versions.values()), None) if deployment is not None else None
    if registered is not None or served is None:
        return registered
    return served.kind if isinstance(served, ServedEncoder) else "generate"


def model_cards(router: Router, versions: dict[str, VersionState]) -> list[dict[str, Any]]:
    """Every model name, registered or attached, as an OpenAI model card: loaded or not (`ready`)."""
    cards = []
    for name, deployment in sorted(router.deployments.items()):
        served = deployment.default
        limit = None if served is None else (
            served.max_seq_len if isinstance(served, ServedEncoder) else served.max_model_len)
        created = served.created if served is not None else registered_at(versions, name)
        generative = isinstance(served, ServedModel)
        defaults = model_defaults(served) if generative else None
        kind = kind_of(router, versions, name)
        cards.append({"id": name, "object": "model", "created": created, "owned_by": "galley",
                      "kind": kind, "max_model_len": limit, "sampling_defaults": defaults,
                      "architecture": served.architecture if generative else None,
                      "family": served.family if generative else None,
                      "backend": served.backend if generative else None,
                      "modalities": ["text", "image"] if generative and served.processor is not None else ["text"],
                      "parent": parent_of(versions, name),
                      "adapters": adapters_of(versions, name) if kind == "generate" else [],
                      "ready": served is not None})
    return cards


def parent_of(versions: dict[str, VersionState], name: str) -> str | None:
    """A LoRA adapter's base model name (as vLLM's model cards say `parent`); None for a model with weights."""
    base = next((vs.base for vs in versions.values() if vs.spec.name == name and vs.base), None)
    return parse_model_ref(base)[0] if base else None


def adapters_of(versions: dict[str, VersionState], name: str) -> list[str]:
    """The names of the LoRA adapters registered over a model."""
    return sorted({vs.spec.name for vs in versions.values() if vs.base and parse_model_ref(vs.base)[0] == name})


def registered_at(versions: dict[str, VersionState], name: str) -> int:
    """When a model name's first version was registered (Unix seconds); 0 for none."""
    stamps = [vs.spec.created_at for vs in versions.values() if vs.spec.name == name]
    return int(datetime.fromisoformat(min(stamps)).timestamp()) if stamps else 0


def version_states(router: Router, versions: dict[str, VersionState]) -> list[tuple[str, str, str]]:
    """(name, version, state) per version: the registry's, and `ready` for versions attached
    to the router without it (tests)."""
    states = {(vs.spec.name, vs.spec.version): vs.state for vs in versions.values()}
    for served in [*router.served_models(), *router.served_encoders()]:
        states.setdefault((served.name, served.version), "ready")
    return sorted((name, version, state) for (name, version), state in states.items())


def registered_version(versions: dict[str, VersionState], name: str, version: str) -> VersionState:
    """The registered version `name@version`; a 404 naming it when there is none."""
    vs = versions.get(f"{name}@{version}")
    if vs is None:
        raise ModelNotFoundError(f"The model version `{name}@{version}` does not exist.", param="version")
    return vs


class LifecycleMetrics:
    def __init__(self, registry_: CollectorRegistry, router: Router, versions: dict[str, VersionState]) -> None:
        self.load_seconds = Histogram("galley_model_load_seconds", "Time to load and warm up a model version",
                                      ["model"], buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                      registry=registry_)
        self.rollbacks = Counter("galley_rollbacks", "Deployments rolled back", ["model", "trigger"],
                                 registry=registry_)
        self.unloads = Counter("galley_model_unloads", "Model versions unloaded", ["model", "reason"],
                               registry=registry_)
        self.router = router
        self.versions = versions
        registry_.register(self)

    def collect(self):
        """`galley_models_loaded{device}`, `galley_model_state{model,version,state} 1` per version, and
        `galley_adapters_loaded{model,version}`: LoRA adapters loaded over each base version."""
        yield self.loaded()
        adapters = GaugeMetricFamily("galley_adapters_loaded", "LoRA adapter versions loaded over each base version",
                                     labels=["model", "version"])
        counts: dict[str, int] = {}
        for vs in self.versions.values():
            if vs.served is not None and getattr(vs.served, "base", ""):
                counts[vs.served.base] = counts.get(vs.served.base, 0) + 1
        for ref, count in sorted(counts.items()):
            adapters.add_metric(list(parse_model_ref(ref)), count)
        yield adapters
        family = GaugeMetricFamily("galley_model_state", "1 for each model version's state "
                                   "(unloaded, loading, ready, failed)", labels=["model", "version", "state"])
        for name, version, state in version_states(self.router, self.versions):
            family.add_metric([name, version, state], 1)
        yield family

    def loaded(self) -> GaugeMetricFamily:
        loaded = GaugeMetricFamily("galley_models_loaded", "Model versions loaded, per device", labels=["device"])
        counts: dict[str, int] = {}
        for vs in self.versions.values():
            for device in vs.devices if vs.served is not None else []:
                counts[device] = counts.get(device, 0) + 1
        for device, count in sorted(counts.items()):
            loaded.add_metric([device], count)
        return loaded
