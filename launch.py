"""Wires models, engines, schedulers and device workers together.

The one module that imports both `engine/` (torch) and `scheduling/`: the engine receives
its scheduler and the worker its emit callback from here, so neither imports the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from engine.batcher import DynamicBatcher
from engine.encoders import start_encoder
from engine.engine import LLMEngine
from engine.faults import FaultyRunner
from engine.kv_cache import KVCacheManager
from engine.loader import LoadedModel, ModelLoadError, load_model
from engine.model_runner import GIB, CacheConfig, ModelRunner, num_kv_blocks
from engine.worker import DeviceWorker, Emit
from scheduling.encoders import EncoderRegistry, ServedEncoder
from scheduling.fair_queue import FairQueue, FairShareConfig
from scheduling.queue import FifoQueue
from scheduling.router import Replica, Router, ServedModel
from scheduling.scheduler import Scheduler, SchedulerConfig
from storage.registry import ModelVersion

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    devices: tuple[str, ...] = ("cpu",)
    dtype: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    policy: str = "fair"  # fair (priority classes + per-tenant fair share) | fifo
    fair_share: FairShareConfig = FairShareConfig()
    cache: CacheConfig = CacheConfig()

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)


def build_engine(loaded: LoadedModel, cfg: EngineConfig, num_blocks: int | None = None) -> LLMEngine:
    """An engine for one loaded replica, its KV pool sized from the budget unless given."""
    if num_blocks is None:
        num_blocks = num_kv_blocks(loaded.model, cfg.cache, loaded.device, loaded.dtype)
    block_size = cfg.cache.block_size
    runner = ModelRunner(loaded.model, loaded.device, loaded.dtype, block_size, num_blocks)
    max_model_len = min(cfg.max_model_len or loaded.max_model_len, loaded.max_model_len)
    if max_model_len > num_blocks * block_size:
        log.warning("KV cache smaller than the context; capping max_model_len",
                    max_model_len=max_model_len, kv_tokens=num_blocks * block_size)
        max_model_len = num_blocks * block_size
    queue = FairQueue(cfg.fair_share) if cfg.policy == "fair" else FifoQueue()
    scheduler = Scheduler(cfg.scheduler, KVCacheManager(num_blocks, block_size), queue)
    return LLMEngine(runner, scheduler, loaded.tokenizer, loaded.eos_token_ids, max_model_len, cfg.seed)




def engine_bytes(engine: LLMEngine) -> int:
    """Weights plus KV cache of one replica."""
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv = sum(t.numel() * t.element_size() for pair in engine.runner.kv_caches for t in pair)
    return weights + kv


@dataclass
class EngineLoader:
    """Loads registry versions onto running device workers and unloads them (blocking: call from a thread).

    Each version is one engine per device worker, named `name@version` on that worker.
    """

    cfg: EngineConfig
    max_waiting: int
    workers: list[DeviceWorker]
    measured_bytes: dict[str, int] = field(default_factory=dict)  # name@version -> bytes per replica

    def devices_for(self, spec: ModelVersion) -> list[str]:
        wanted = spec.options.get("device")
        labels = [w.device for w in self.workers]
        if wanted is None:
            return labels
        chosen = [label for label, device in zip(labels, self.cfg.devices) if device == wanted]
        if not chosen:
            raise ModelLoadError(f"device {wanted!r} is not configured; [engine] devices = {list(self.cfg.devices)}")
        return chosen

    def estimate_bytes(self, spec: ModelVersion) -> int:
        """Per replica: what it took last time, else checkpoint size plus the CPU KV budget."""
        if spec.ref in self.measured_bytes:
            return self.measured_bytes[spec.ref]
        folder = Path(spec.source).expanduser()
        files = (list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))) if folder.is_dir() else []
        return sum(f.stat().st_size for f in files) + int(self.cfg.cache.kv_cache_gib * GIB)

    def load(self, spec: ModelVersion) -> ServedModel:
        if spec.kind != "generate":
            raise ModelLoadError(f"kind {spec.kind!r} cannot be loaded as a generative model")
        labels = set(self.devices_for(spec))
        dtype = spec.options.get("dtype", self.cfg.dtype)
        replicas, attached = [], []
        try:
            for worker, device in zip(self.workers, self.cfg.devices):
                if worker.device not in labels:
                    continue
                loaded = load_model(spec.source, device=device, dtype=dtype)
                engine = build_engine(loaded, self.cfg)
                if spec.options.get("fault") == "raise":
                    engine.runner = FaultyRunner(engine.runner)
                self.measured_bytes[spec.ref] = engine_bytes(engine)
                worker.attach(spec.ref, engine).result()
                attached.append(worker)
                replicas.append(Replica(worker, spec.ref, worker.device))
        except BaseException:
            for worker in attached:
                worker.detach(spec.ref).result()
            raise
        return ServedModel(
            name=spec.name, tokenizer=loaded.tokenizer, max_model_len=engine.max_model_len,
            max_in_flight_per_replica=self.cfg.max_num_seqs + self.max_waiting, replicas=replicas,
            vocab_size=max(loaded.model.shape.vocab_size, len(loaded.tokenizer)),
            version=spec.version, created=int(time.time()),
        )

    def unload(self, served: ServedModel) -> None:
        """Detach every replica; the workers drop the engines and free their memory."""
        for replica in served.replicas:
            replica.worker.detach(replica.engine_id).result()


def start_workers(cfg: EngineConfig, emit: Emit) -> list[DeviceWorker]:
    workers = [DeviceWorker(f"{device}#{i}", emit) for i, device in enumerate(cfg.devices)]
    for worker in workers:
        worker.start()
    return workers


def start_models(
    models: list[tuple[str, str]], cfg: EngineConfig, max_waiting: int, router: Router, emit: Emit
) -> list[DeviceWorker]:
    """Start one worker per device, load every (name, source) as version "1" on each, register them.

    Blocking (loads weights): run it off the event loop.
    """
    workers = start_workers(cfg, emit)
    loader = EngineLoader(cfg, max_waiting, workers)
    for name, source in models:
        started = time.monotonic()
        served = loader.load(ModelVersion(name, "1", source))
        router.add_model(served)
        log.info("model loaded", model=name, source=source, devices=list(cfg.devices),
                 load_s=round(time.monotonic() - started, 2), max_model_len=served.max_model_len)
    return workers


@dataclass(frozen=True)
class EncoderLaunch:
    """An embed or classify model to serve: where it is and how its batcher groups inputs."""

    name: str
    source: str
    kind: str  # embed | classify
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_waiting: int = 1024
    version: str = "1"


def load_encoder(spec: EncoderLaunch, device: str, dtype: str) -> ServedEncoder:
    """Load one encoder and start its dynamic batcher thread (blocking: run it off the event loop)."""
    started = time.monotonic()
    encoder, batcher = start_encoder(spec.name, spec.source, spec.kind, device, dtype, spec.max_batch,
                                     spec.max_wait_ms)
    log.info("model loaded", model=spec.name, kind=spec.kind, source=spec.source, device=device,
             load_s=round(time.monotonic() - started, 2), max_batch=spec.max_batch)
    return ServedEncoder(
        name=spec.name, kind=spec.kind, handle=batcher, dimensions=encoder.dimensions,
        max_seq_len=encoder.max_seq_len, vocab_size=encoder.config.vocab_size, labels=encoder.labels,
        multi_label=encoder.multi_label, max_waiting=spec.max_waiting, version=spec.version,
        created=int(time.time()),
    )


def start_encoders(specs: list[EncoderLaunch], cfg: EngineConfig, registry: EncoderRegistry) -> list[DynamicBatcher]:
    """Load every encoder on the first configured device and register it; returns the batchers to stop."""
    batchers = []
    for spec in specs:
        served = load_encoder(spec, cfg.devices[0], cfg.dtype)
        registry.add(served)
        batchers.append(served.handle)
    return batchers
