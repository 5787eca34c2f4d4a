"""The registry and deployment endpoints: `/admin/api/models*` (admin key) and `/api/v1/deployments*`
(writes need the admin key when auth is on; see api/auth.py).

Sources, options, load errors, health and history are the admin key's: a tenant's listing
names only the models it may use, each with its split and the states of the versions in it.

Thin: validate with pydantic, call the `ModelManager`, answer with its state. Loads and
unloads answer 202 at once and run in the background; poll `GET /admin/api/models`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StrictStr,
    WithJsonSchema,
    create_model,
)

from api.auth import is_admin, tenant_of
from api.errors import json_response
from api.openai.fields import Strict, bounded
from api.routes import Route
from api.services import services
from api.validation import parse_body
from services.deployments import (
    OPTIONS,
    QUANTITY,
    SPECULATIVE_KEYS,
    Option,
    Resources,
    VersionState,
    parse_quantity,
    read_resources,
)
from services.sampling import DEFAULTABLE

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$",
                            description="Letters, digits and `._:/-`; no `@` (it separates the version).")]


SamplingDefaults = create_model(
    "SamplingDefaults", __base__=Strict, __doc__="A model's defaults for the sampling fields a request leaves out.",
    **{name: (bounded(bounds) | None, Field(None, description=bounds.help or None))
       for name, bounds in DEFAULTABLE.items()})


def option_type(option: Option) -> Any:
    """The schema of one option of the registry's table (`services.deployments.options`)."""
    if option.choices:
        return Literal[option.choices]
    if option.name == "sampling_defaults":
        return SamplingDefaults
    if option.name == "speculative":
        return dict[Literal[SPECULATIVE_KEYS], Any]
    if option.type is list and option.item is int:
        return Annotated[list[Annotated[int, Field(strict=True, ge=option.ge, le=option.le)]], Field(min_length=1)]
    if option.type is list:
        return list[Annotated[str, Field(min_length=1)]]
    return Annotated[option.type, Field(strict=option.type is bool, ge=option.ge, le=option.le)]


VersionOptions = create_model(
    "VersionOptions", __base__=Strict, __doc__="A model version's options: the same as a [[models]] entry's.",
    **{option.name: (option_type(option) | None,
                     Field(None, description=f"{option.help} ({' and '.join(option.kinds)} models)."))
       for option in OPTIONS.values()})


class ModelCreate(Strict):
    name: Name
    version: Name = "1"
    source: str = Field(min_length=1, description="A local model folder or a Hugging Face hub id; with `base`, a "
                        "PEFT LoRA adapter folder.")
    kind: Literal["generate", "embed", "classify", "onnx", "tabular", "image-classify", "torch"] = "generate"
    base: str | None = Field(None, min_length=1, description="Makes this version a LoRA adapter over this generate "
                             "model's weights (`name` or `name@version`): the same as `options.base`.")
    options: VersionOptions = VersionOptions()


class VersionOut(BaseModel):
    name: str
    version: str
    source: str
    kind: str
    options: dict[str, Any]
    state: Literal["unloaded", "loading", "ready", "failed"]
    error: str | None
    load_phase: str | None = Field(description="What its last load was doing (starting, reading metadata, reading "
                                   "weights, quantizing, building kernels, loading tokenizer, loaded, warming up, "
                                   "ready); null unless it loaded since it was last unloaded.")
    load_progress: float | None = Field(ge=0, le=1, description="That load's fraction done (0 to 1).")
    draining: bool
    devices: list[str] = Field(description="Devices it is loaded on.")
    mem_bytes: int = Field(description="Weights + KV cache per device while loaded.")
    num_in_flight: int
    idle_seconds: float
    created_at: str


class VersionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VersionOut]


class Accepted(BaseModel):
    name: str
    version: str
    state: str
    action: Literal["load", "unload"]


Quantity = Annotated[StrictStr | float, AfterValidator(parse_quantity), WithJsonSchema({
    "anyOf": [{"type": "string", "pattern": QUANTITY.pattern}, {"type": "number", "minimum": 0}],
    "description": "A number, or a Kubernetes quantity: `\"500m\"`, `\"2\"`, `\"4Gi\"`, `\"512M\"`."})]


class ResourceAmounts(Strict):
    cpu: Quantity | None = Field(None, description="Cores: at most what this process may use.")
    memory: Quantity | None = Field(None, description="Bytes per replica: at least the version's estimated size "
                                    "(weights and KV cache), at most the per-device memory budget.")
    gpu: int | None = Field(None, strict=True, ge=0, le=64, validation_alias=AliasChoices("gpu", "nvidia.com/gpu"),
                            description="GPUs per replica (also `nvidia.com/gpu`): 1 needs the version on CUDA "
                            "devices, 0 on CPU ones; one GPU per replica.")


class ResourcesIn(ResourceAmounts):
    """What the version runs on: checked against this server, refused naming what it cannot give."""

    replicas: int | None = Field(None, strict=True, ge=1, le=1024, description="Device workers it loads on (data "
                                 "parallel), at most as many as [engine] devices lists; kept as its `replicas` "
                                 "option. A loaded version must be unloaded to change it.")
    requests: ResourceAmounts | None = Field(None, description="Kubernetes' form; the larger of a request and a "
                                             "limit is checked.")
    limits: ResourceAmounts | None = None

    def read(self) -> Resources:
        return read_resources(self.replicas, [group.model_dump(exclude={"replicas", "requests", "limits"})
                                              for group in (self, self.requests, self.limits) if group is not None])


class DeploymentCreate(Strict):
    model_name: Name
    version: Name
    traffic_percent: int = Field(ge=1, le=100, description="The version's share; the stable version keeps the rest.")
    resources: ResourcesIn | None = None


class TrafficSplit(RootModel[Annotated[dict[Name, Annotated[int, Field(strict=True, ge=0, le=100)]],
                                       Field(min_length=1)]]):
    """`{"version": percent, ...}`: registered versions, integers summing to 100."""

    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})  # keys match the pattern


class ShadowSet(Strict):
    model_config = ConfigDict(json_schema_extra={  # a version is needed unless percent is 0 (see ShadowManager.set)
        "if": {"properties": {"percent": {"minimum": 1}}}, "then": {"required": ["version"],
                                                                     "properties": {"version": {"type": "string"}}}})

    version: Name | None = Field(None, description="A registered generate version of the model, not its stable one.")
    percent: int = Field(strict=True, ge=0, le=100, description="Share of the stable version's requests mirrored; "
                         "0 stops mirroring.")


class ShadowOut(BaseModel):
    version: str
    percent: int


class VersionHealth(BaseModel):
    requests: int
    error_rate: float
    p99_latency_s: float | None


class EventOut(BaseModel):
    kind: str
    traffic_before: dict[str, int] | None
    traffic_after: dict[str, int]
    reason: str | None
    created_at: str


class DeploymentOut(BaseModel):
    model_name: str
    traffic: dict[str, int]
    stable_version: str
    previous_stable_version: str | None
    shadow: ShadowOut | None = Field(description="The version mirrored to (outputs logged, never returned).")
    versions: dict[str, VersionOut]
    health: dict[str, VersionHealth] = Field(description="Per version, over the canary window.")
    events: list[EventOut] = Field(description="Most recent changes first.")


class VersionSummary(BaseModel):
    version: str
    kind: str
    state: Literal["unloaded", "loading", "ready", "failed"]


class DeploymentSummary(BaseModel):
    """What a tenant key sees of a deployment."""

    model_name: str
    traffic: dict[str, int]
    stable_version: str
    versions: dict[str, VersionSummary] = Field(description="The versions the split sends traffic to.")


class DeploymentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeploymentOut | DeploymentSummary] = Field(
        description="The admin key: every deployment in full; a tenant key: the models it may use, in summary.")


# ---- rendering -------------------------------------------------------------------------


def version_json(vs: VersionState) -> dict[str, Any]:
    served = vs.served
    return VersionOut(
        name=vs.spec.name, version=vs.spec.version, source=vs.spec.source, kind=vs.spec.kind,
        options=vs.spec.options, state=vs.state, error=vs.error, load_phase=vs.load_phase,
        load_progress=None if vs.load_progress is None else round(vs.load_progress, 3),
        draining=bool(served and served.draining),
        devices=vs.devices if served else [], mem_bytes=vs.mem_bytes,
        num_in_flight=served.num_in_flight if served else 0,
        idle_seconds=round(time.monotonic() - vs.last_used_s, 3), created_at=vs.spec.created_at,
    ).model_dump()


async def deployment_json(request: web.Request, name: str) -> dict[str, Any]:
    manager, shadows = services(request).models, services(request).shadows
    deployment, previous = manager.deployment(name)
    versions = {vs.spec.version: version_json(vs) for vs in manager.versions.values() if vs.spec.name == name}
    health = {}
    for version in versions:
        window = manager.health.get(f"{name}@{version}")
        if window is not None:
            health[version] = {"requests": window.num_requests, "error_rate": round(window.error_rate, 4),
                               "p99_latency_s": window.p99_latency_s}
    events = [{"kind": e.kind, "traffic_before": e.traffic_before, "traffic_after": e.traffic_after,
               "reason": e.reason, "created_at": e.created_at} for e in await manager.events(name, 10)]
    shadow = shadows.shadows.get(name)
    return DeploymentOut(model_name=name, traffic=deployment.traffic, stable_version=deployment.stable,
                         previous_stable_version=previous,
                         shadow={"version": shadow.version, "percent": shadow.percent} if shadow else None,
                         versions=versions, health=health, events=events).model_dump()


# ---- registry handlers (admin key) ------------------------------------------------------


async def create_model(request: web.Request) -> web.Response:
    body = await parse_body(request, ModelCreate)
    options = body.options.model_dump(exclude_none=True) | ({"base": body.base} if body.base else {})
    vs = await services(request).models.register(body.name, body.version, body.source, body.kind, options)
    return json_response(version_json(vs), status=201)


async def list_models(request: web.Request) -> web.Response:
    manager = services(request).models
    return json_response({"object": "list", "data": [version_json(vs) for vs in manager.versions.values()]})


async def load_version(request: web.Request) -> web.Response:
    manager = services(request).models
    vs = manager.get(request.match_info["name"], request.match_info["version"])
    manager.load_in_background(vs)
    return accepted(vs, "load")


async def unload_version(request: web.Request) -> web.Response:
    manager = services(request).models
    vs = manager.get(request.match_info["name"], request.match_info["version"])
    manager.unload_in_background(vs)
    return accepted(vs, "unload")


def accepted(vs: VersionState, action: str) -> web.Response:
    return json_response({"name": vs.spec.name, "version": vs.spec.version, "state": vs.state, "action": action},
                         status=202)


# ---- deployment handlers ---------------------------------------------------------------


async def create_deployment(request: web.Request) -> web.Response:
    body = await parse_body(request, DeploymentCreate)
    manager = services(request).models
    await manager.deploy(body.model_name, body.version, body.traffic_percent,
                         body.resources.read() if body.resources else None)
    return json_response(await deployment_json(request, body.model_name), status=201)


async def update_traffic(request: web.Request) -> web.Response:
    name = request.match_info["model_name"]
    traffic = (await parse_body(request, TrafficSplit)).root
    await services(request).models.update_traffic(name, traffic)
    return json_response(await deployment_json(request, name))


async def set_shadow(request: web.Request) -> web.Response:
    name = request.match_info["model_name"]
    body = await parse_body(request, ShadowSet)
    await services(request).shadows.set(name, body.version, body.percent)
    return json_response(await deployment_json(request, name))


async def rollback(request: web.Request) -> web.Response:
    name = request.match_info["model_name"]
    await services(request).models.rollback(name, "requested")
    return json_response(await deployment_json(request, name))


def deployment_summary(request: web.Request, name: str) -> dict[str, Any]:
    deployment, _ = services(request).models.deployment(name)
    versions = {}
    for version in deployment.traffic:
        vs = services(request).models.versions.get(f"{name}@{version}")
        if vs is not None:
            versions[version] = VersionSummary(version=version, kind=vs.spec.kind, state=vs.state)
    return DeploymentSummary(model_name=name, traffic=deployment.traffic, stable_version=deployment.stable,
                             versions=versions).model_dump()


async def list_deployments(request: web.Request) -> web.Response:
    names = services(request).models.names()
    if is_admin(request):
        data = [await deployment_json(request, name) for name in names]
    else:
        tenant = tenant_of(request)
        data = [deployment_summary(request, name) for name in names if tenant.allows_model(name)]
    return json_response({"object": "list", "data": data})


VERSION_PATH = "/admin/api/models/{name}/versions/{version}"
DEPLOYMENTS_PATH = "/api/v1/deployments"

ROUTES = [
    Route("POST", "/admin/api/models", create_model, "Register a model version (admin key)",
          request=ModelCreate, response=VersionOut, status=201, errors=(409,)),
    Route("GET", "/admin/api/models", list_models, "List model versions and their state (admin key)",
          response=VersionList),
    Route("POST", VERSION_PATH + "/load", load_version, "Load a version in the background (admin key)",
          response=Accepted, status=202),
    Route("POST", VERSION_PATH + "/unload", unload_version, "Drain and unload a version (admin key)",
          response=Accepted, status=202),
    Route("POST", DEPLOYMENTS_PATH, create_deployment, "Deploy a version with a share of the traffic",
          request=DeploymentCreate, response=DeploymentOut, status=201, errors=(404,)),
    Route("GET", DEPLOYMENTS_PATH, list_deployments, "List deployments: with the admin key every one with its "
          "versions, health and history; with a tenant key the models it may use, in summary",
          response=DeploymentList),
    Route("PUT", DEPLOYMENTS_PATH + "/{model_name}/traffic", update_traffic,
          "Set a traffic split {version: percent} summing to 100", request=TrafficSplit, response=DeploymentOut),
    Route("PUT", DEPLOYMENTS_PATH + "/{model_name}/shadow", set_shadow,
          "Mirror a share of the stable version's requests to another version (outputs logged, never returned)",
          request=ShadowSet, response=DeploymentOut, errors=(409,)),
    Route("POST", DEPLOYMENTS_PATH + "/{model_name}/rollback", rollback,
          "All traffic back to the stable (or previous stable) version at once", response=DeploymentOut,
          errors=(409,)),
]
