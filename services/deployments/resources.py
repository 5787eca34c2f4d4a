"""A deployment's `resources` (`POST /api/v1/deployments`), written as Kubernetes and KServe write them
(`cpu: "500m"`, `memory: "4Gi"`, `gpu` or `nvidia.com/gpu`, flat or under `requests`/`limits`), plus
`replicas`.

galley is one process: it does not fence cores or bytes per model. So each amount is checked
against what this server can give the version, and one that cannot be met is refused naming it,
never accepted and ignored: `gpu` against the devices the version runs on, `cpu` against the
cores this process may use, `memory` against the version's estimated size and the per-device
memory budget. `replicas` is honoured: the version loads on that many device workers (the
`replicas` option, kept with the version), where `[engine] devices` has that many.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from services.errors import InvalidRequestError

GIB = 1 << 30
SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?\s*$")


@dataclass(frozen=True)
class Resources:
    replicas: int | None = None
    gpu: int | None = None  # per replica
    cpu: float | None = None  # cores
    memory: int | None = None  # bytes per replica


def parse_quantity(value: str | float) -> float:
    """A Kubernetes quantity ("2", "500m", "1.5", "4Gi", "512M") or a number, as a number; ValueError if not one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and (match := QUANTITY.match(value)):
        number = float(match[1]) * SUFFIXES.get(match[2] or "", 1)
    else:
        raise ValueError(f"{value!r} is not a quantity (for example 2, \"500m\", \"4Gi\")")
    if number < 0:
        raise ValueError("must not be negative")
    return number


def read_resources(replicas: int | None, amounts: list[dict]) -> Resources:
    """`amounts`: {cpu, memory, gpu} (parsed quantities) of the flat fields, `requests` and `limits`; the
    largest of each counts (a limit above a request is what the version may use)."""
    def largest(key: str) -> float | None:
        values = [group[key] for group in amounts if group.get(key) is not None]
        return max(values) if values else None

    memory, gpu = largest("memory"), largest("gpu")
    return Resources(replicas, None if gpu is None else int(gpu), largest("cpu"),
                     None if memory is None else int(memory))


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_amounts(resources: Resources, ref: str, devices: list[str], need_bytes: int, budget_gib: float) -> None:
    """400 naming the first amount this server cannot give `ref`, which runs on `devices` (their names,
    one per replica) and needs about `need_bytes` per replica."""
    on_gpu = [d for d in devices if d.startswith("cuda")]
    if resources.gpu:
        if len(on_gpu) < len(devices):
            raise InvalidRequestError(
                f"resources.gpu: `{ref}` runs on {', '.join(devices)}, not a GPU; this server's [engine] devices "
                "must list cuda devices, and the version's `device` option pick them", param="resources.gpu",
                code="resources_unavailable")
        if resources.gpu > 1:
            raise InvalidRequestError("resources.gpu: a replica runs on one GPU (no tensor parallelism); ask for "
                                      "more replicas instead", param="resources.gpu", code="resources_unavailable")
    elif resources.gpu == 0 and on_gpu:
        raise InvalidRequestError(f"resources.gpu: `{ref}` runs on {', '.join(on_gpu)}; set its `device` option to "
                                  "a CPU device to run it without a GPU", param="resources.gpu",
                                  code="resources_unavailable")
    if resources.cpu is not None and resources.cpu > usable_cpus():
        raise InvalidRequestError(f"resources.cpu: asks for {resources.cpu:g} cores; this process may use "
                                  f"{usable_cpus()}", param="resources.cpu", code="resources_unavailable")
    if resources.memory is not None:
        if need_bytes > resources.memory:
            raise InvalidRequestError(
                f"resources.memory: `{ref}` needs about {need_bytes / GIB:.2f} GiB per replica (weights and KV "
                f"cache), more than the {resources.memory / GIB:.2f} GiB asked", param="resources.memory",
                code="resources_unavailable")
        if budget_gib and resources.memory > budget_gib * GIB:
            raise InvalidRequestError(
                f"resources.memory: asks for {resources.memory / GIB:.2f} GiB; the memory budget is "
                f"{budget_gib:g} GiB per device", param="resources.memory", code="resources_unavailable")
