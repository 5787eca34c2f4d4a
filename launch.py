"""Wires models, engines, schedulers and device workers together.

The one module that imports both `engine/` (torch) and `scheduling/`: the engine receives
its scheduler and the worker its emit callback from here, so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import structlog

from engine.batcher import Batching
from engine.draft_model import DraftModelProposer, load_draft, num_target_blocks
from engine.encoders import resolve_encoder_path, start_encoder
from engine.engine import LLMEngine
from engine.gguf import find_gguf, loaded_bytes
from engine.image_classifier import start_image_classifier
from engine.kv_cache import KVCacheManager
from engine.load_progress import ProgressCallback
from engine.loader import (
    LoadedModel,
    ModelLoadError,
    check_model_source,
    load_model,
    max_token_chars,
    package_path,
)
from engine.lora import AdapterError, check_adapter_folder, read_adapter
from engine.model_runner import GIB, CacheConfig, ModelRunner, num_kv_blocks
from engine.predictors import predictor_path, start_predictor
from engine.speculative import SpeculativeConfig
from engine.worker import DeviceWorker, Emit
from scheduling.encoders import ServedEncoder
from scheduling.fair_queue import FairQueue, FairShareConfig
from scheduling.queue import FifoQueue
from scheduling.router import Replica, Served, ServedModel
from scheduling.scheduler import Scheduler, SchedulerConfig
from services.sampling import sampling_defaults
from storage.registry import ModelVersion

log = structlog.get_logger(__name__)

TENSOR_KINDS = ("onnx", "tabular", "torch")  # models of tensors in and out (engine/predictors.py)


@dataclass(frozen=True)
class EngineConfig:
    devices: tuple[str, ...] = ("cpu",)
    dtype: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    worker_stall_seconds: float = 60.0  # a device worker busy this long on one round of steps: /ready says 503
    cpu_kernels: bool = True  # CPU float32: C++ decode attention, norms, rotary (built in the background, cached)
    cuda_graphs: bool = True  # CUDA: decode steps replayed from graphs captured at load (engine/cuda_graphs.py)
    adapt_threads: bool = True  # CPU: one thread while another busy process holds a core (engine/cpu_share.py)
    policy: str = "fair"  # fair (priority classes + per-tenant fair share) | fifo
    fair_share: FairShareConfig = FairShareConfig()
    cache: CacheConfig = CacheConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()  # [speculative]: drafts verified by the model (off by default)

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)


def build_engine(loaded: LoadedModel, cfg: EngineConfig, num_blocks: int | None = None,
                 source: str = "") -> LLMEngine:
    """An engine for one loaded replica, its KV pool sized from the budget unless given. `source`:
    the replica's model source, which a self-drafting draft model loads again."""
    block_size = cfg.cache.block_size
    draft = load_draft(cfg.speculative, source, loaded) if cfg.speculative.method == "draft_model" else None
    if num_blocks is None:
        num_blocks = num_kv_blocks(loaded.model, cfg.cache, loaded.device, loaded.dtype)
        if draft is not None:
            num_blocks = num_target_blocks(num_blocks, loaded, draft, block_size)
    runner = ModelRunner(loaded.model, loaded.device, loaded.dtype, block_size, num_blocks, cfg.cpu_kernels)
    max_model_len = min(cfg.max_model_len or loaded.max_model_len, loaded.max_model_len)
    if max_model_len > num_blocks * block_size:
        log.warning("KV cache smaller than the context; capping max_model_len",
                    max_model_len=max_model_len, kv_tokens=num_blocks * block_size)
        max_model_len = num_blocks * block_size
    if cfg.cuda_graphs and loaded.device.type == "cuda":
        started = time.perf_counter()
        why_not = runner.capture_graphs(cfg.max_num_seqs, max_model_len)
        if why_not is None:
            log.info("cuda graphs captured", batch_sizes=runner.graphs.sizes,
                     seconds=round(time.perf_counter() - started, 1))
        else:
            log.warning("decode steps run without cuda graphs", reason=why_not)
    queue = FairQueue(cfg.fair_share) if cfg.policy == "fair" else FifoQueue()
    kv = KVCacheManager(num_blocks, block_size, cfg.cache.enable_prefix_caching, cfg.cache.prefix_cache_idle_seconds)
    scheduler = Scheduler(cfg.scheduler, kv, queue)
    proposer = None if draft is None else DraftModelProposer(cfg.speculative, draft, num_blocks, block_size,
                                                             max_model_len, cfg.max_num_seqs, cfg.cpu_kernels)
    return LLMEngine(runner, scheduler, loaded.tokenizer, loaded.eos_token_ids, max_model_len, cfg.seed,
                     cfg.speculative, proposer)


def engine_bytes(engine: LLMEngine) -> int:
    """Weights plus KV cache of one replica (its draft model's too)."""
    return engine.memory.weights_bytes + engine.memory.kv_cache_bytes


def weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_bytes(folder: Path, keep_blocks: bool = True) -> int:
    """The size of a model folder's weight files (0 for a hub id: not known before it downloads); for
    a GGUF source, what its weights take once loaded: kept as blocks, or (`keep_blocks` False: the
    `quantization` option set) de-quantized to float32."""
    gguf_file = find_gguf(folder)
    if gguf_file is not None:
        return loaded_bytes(gguf_file, keep_blocks)
    files = (list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))) if folder.is_dir() else []
    return sum(f.stat().st_size for f in files)


def check_source(source: str, kind: str, options: dict | None = None) -> None:
    """ModelLoadError unless the source of a `kind` model can be found (see `check_model_source`); a LoRA
    adapter's (options with a `base`) must be an adapter folder galley can serve."""
    if "base" in (options or {}):
        try:
            check_adapter_folder(source)
        except AdapterError as exc:
            raise ModelLoadError(str(exc)) from exc
    elif kind in TENSOR_KINDS:
        predictor_path(source, (options or {}).get("allow_pickle", False))
    elif kind != "generate" and source.startswith("pkg:"):
        resolve_encoder_path(source)
    else:
        check_model_source(source)


@dataclass
class EngineLoader:
    """Loads registry versions onto running device workers and unloads them (blocking: call from a thread).

    Each generative version is one engine per device worker, named `name@version` on that
    worker; an encoder version (embed, classify) is one encoder on the first chosen device.
    """

    cfg: EngineConfig
    max_waiting: int  # per replica; an encoder may have 4x as many inputs waiting
    workers: list[DeviceWorker]
    measured_bytes: dict[str, int] = field(default_factory=dict)  # name@version -> bytes per replica

    def devices_for(self, spec: ModelVersion) -> list[str]:
        wanted = spec.options.get("device")
        labels = [w.device for w in self.workers]
        if wanted is not None:
            labels = [label for label, device in zip(labels, self.cfg.devices) if device == wanted]
        if not labels:
            raise ModelLoadError(f"device {wanted!r} is not configured; [engine] devices = {list(self.cfg.devices)}")
        count = spec.options.get("replicas", len(labels)) if spec.kind == "generate" else 1
        if count > len(labels):
            raise ModelLoadError(f"asks for {count} replicas; [engine] devices = {list(self.cfg.devices)} has "
                                 f"{len(labels)} {'of ' + repr(wanted) if wanted else 'in all'} (list a device more "
                                 "than once to run more replicas on it)")
        return labels[:count]

    def device_names(self, spec: ModelVersion) -> list[str]:
        """The configured devices (`cpu`, `cuda:0`, ...) `spec` loads on, one per replica."""
        names = {worker.device: device for worker, device in zip(self.workers, self.cfg.devices)}
        return [names[label] for label in self.devices_for(spec)]

    def registration_problem(self, spec: ModelVersion) -> str | None:
        """Why `spec` could not load here (its source or device), found without loading it; None: it could."""
        try:
            if "base" in spec.options:  # an adapter runs on its base's devices
                check_source(spec.source, spec.kind, spec.options)
                return None
            self.devices_for(spec)
            check_source(spec.source, spec.kind, spec.options)
            if spec.kind == "generate" and (draft := model_engine_config(self.cfg, spec).speculative.model):
                check_model_source(draft)
        except ModelLoadError as exc:
            return str(exc)
        return None

    def estimate_bytes(self, spec: ModelVersion) -> int:
        """Per replica: what it took last time, else checkpoint size (plus the CPU KV budget if generative)."""
        if spec.ref in self.measured_bytes:
            return self.measured_bytes[spec.ref]
        if "base" in spec.options:  # its weights at most twice over (a bfloat16 file loaded as float32)
            file = Path(spec.source).expanduser() / "adapter_model.safetensors"
            return 2 * file.stat().st_size if file.is_file() else 0
        if spec.kind in TENSOR_KINDS:
            try:
                path = predictor_path(spec.source, spec.options.get("allow_pickle", False))
            except ModelLoadError:
                return 0  # loading will fail and say why
            return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir())
        if spec.kind != "generate":
            try:
                return checkpoint_bytes(resolve_encoder_path(spec.source))
            except ModelLoadError:
                return 0  # loading will fail and say why
        try:
            path = package_path(spec.source) if spec.source.startswith("pkg:") else Path(spec.source).expanduser()
        except ModelLoadError:
            return 0  # loading will fail and say why
        devices = [spec.options["device"]] if "device" in spec.options else self.cfg.devices
        keep_blocks = (spec.options.get("quantization") is None and all(d == "cpu" for d in devices)
                       and spec.options.get("dtype", self.cfg.dtype) in ("auto", "float32"))  # as load_model decides
        return checkpoint_bytes(path, keep_blocks) + int(self.cfg.cache.kv_cache_gib * GIB)

    def load(self, spec: ModelVersion, on_progress: ProgressCallback | None = None) -> Served:
        """`on_progress(phase, fraction)`: the whole load's, over its replicas (see `load_model`)."""
        if spec.kind != "generate":
            served = self._load_encoder(spec)
            if on_progress is not None:
                on_progress("loaded", 1.0)
            return served
        labels = set(self.devices_for(spec))
        dtype = spec.options.get("dtype", self.cfg.dtype)
        replicas, attached = [], []
        pairs = [(w, d) for w, d in zip(self.workers, self.cfg.devices) if w.device in labels]
        try:
            for i, (worker, device) in enumerate(pairs):
                report = None if on_progress is None else partial(replica_progress, on_progress, i, len(pairs))
                loaded = load_model(spec.source, device=device, dtype=dtype,
                                    quantization=spec.options.get("quantization"), on_progress=report,
                                    backend=spec.options.get("backend", "auto"))
                engine = self.new_engine(spec, loaded)
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
            vocab_size=loaded.model.shape.vocab_size, max_token_chars=max_token_chars(loaded.tokenizer),
            version=spec.version, created=int(time.time()), block_size=self.cfg.cache.block_size,
            shared_prefix_cache=bool(spec.options.get("shared_prefix_cache", False)),
            tool_parser=spec.options.get("tool_parser"),
            reasoning_parser=spec.options.get("reasoning_parser"),
            sampling_defaults=sampling_defaults(loaded.generation_config, spec.options.get("sampling_defaults")),
            architecture=loaded.architecture, family=loaded.family, backend=loaded.backend,
            processor=loaded.processor, images_refused=loaded.images_refused,
        )

    def load_adapter(self, spec: ModelVersion, base: ServedModel) -> ServedModel:
        """A LoRA adapter loaded onto every replica of its loaded `base`, served as a model of its own
        (its own name, versions, limits and metrics) over the base's engines and tokenizer."""
        adapter = read_adapter(spec.source)
        attached = []
        try:
            for replica in base.replicas:
                replica.worker.attach_adapter(replica.engine_id, spec.ref, adapter).result()
                attached.append(replica)
        except BaseException:
            for replica in attached:
                replica.worker.detach_adapter(replica.engine_id, spec.ref).result()
            raise
        self.measured_bytes[spec.ref] = adapter.num_bytes
        return dataclasses.replace(
            base, name=spec.name, version=spec.version, created=int(time.time()), draining=False,
            replicas=[Replica(r.worker, r.engine_id, r.device) for r in base.replicas], adapter=spec.ref, base=base.ref,
            shared_prefix_cache=bool(spec.options.get("shared_prefix_cache", False)),
            tool_parser=spec.options.get("tool_parser", base.tool_parser),
            reasoning_parser=spec.options.get("reasoning_parser", base.reasoning_parser),
            sampling_defaults={**base.sampling_defaults, **spec.options.get("sampling_defaults", {})})

    def new_engine(self, spec: ModelVersion, loaded: LoadedModel) -> LLMEngine:
        """One replica's engine for `spec` (tests override it to inject faults: tests/faults.py)."""
        return build_engine(loaded, model_engine_config(self.cfg, spec), source=spec.source)

    def _load_encoder(self, spec: ModelVersion) -> ServedEncoder:
        label = self.devices_for(spec)[0]
        worker, device = next((w, d) for w, d in zip(self.workers, self.cfg.devices) if w.device == label)
        served = load_encoder(spec, device, spec.options.get("dtype", self.cfg.dtype), worker, 4 * self.max_waiting)
        self.measured_bytes[spec.ref] = served.mem_bytes
        return served

    def unload(self, served: Served) -> None:
        """Detach every replica (the workers drop the engines and free their memory), or stop an encoder."""
        if isinstance(served, ServedEncoder):
            unload_encoder(served)
            return
        if served.adapter:
            for replica in served.replicas:
                replica.worker.detach_adapter(replica.engine_id, served.adapter).result()
            return
        for replica in served.replicas:
            replica.worker.detach(replica.engine_id).result()


def model_engine_config(cfg: EngineConfig, spec: ModelVersion) -> EngineConfig:
    """The engine config for one model: its own `max_model_len` and `speculative` table, if it has
    them, replace the server-wide ones (a draft model must share its target's tokenizer)."""
    if "max_model_len" in spec.options:
        cfg = dataclasses.replace(cfg, max_model_len=spec.options["max_model_len"])
    table = spec.options.get("speculative")
    if table is None:
        return cfg
    try:
        return dataclasses.replace(cfg, speculative=SpeculativeConfig(**table))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"model {spec.ref}: speculative {table}: {exc}") from exc


def replica_progress(on_progress: ProgressCallback, index: int, num_replicas: int, phase: str, fraction: float) -> None:
    on_progress(phase, (index + fraction) / num_replicas)


def start_workers(cfg: EngineConfig, emit: Emit) -> list[DeviceWorker]:
    workers = [DeviceWorker(f"{device}#{i}", emit, cfg.worker_stall_seconds, cfg.adapt_threads)
               for i, device in enumerate(cfg.devices)]
    for worker in workers:
        worker.start()
    return workers


def batching_of(options: dict) -> Batching:
    """A batched model's options as its batcher's: `max_batch` (32), the wait as `max_wait_ms` (5) or
    Triton's `max_queue_delay_microseconds`, and `preferred_batch_size` (none)."""
    if "max_queue_delay_microseconds" in options:
        wait_ms = options["max_queue_delay_microseconds"] / 1000
    else:
        wait_ms = options.get("max_wait_ms", 5.0)
    return Batching(options.get("max_batch", 32), wait_ms, tuple(options.get("preferred_batch_size", ())))


def load_encoder(spec: ModelVersion, device: str, dtype: str, worker: DeviceWorker,
                 max_waiting: int = 1024) -> ServedEncoder:
    """Load one encoder version onto the device's worker (blocking: run it off the event loop).

    Batching from the options (`batching_of`)."""
    started = time.monotonic()
    batching = batching_of(spec.options)
    max_batch = batching.max_batch
    if spec.kind in TENSOR_KINDS:
        predictor, client = start_predictor(spec.ref, spec.source, spec.kind, worker, device, batching,
                                            tuple(spec.options.get("trusted_types", ())),
                                            spec.options.get("allow_pickle", False))
        log.info("model loaded", model=spec.ref, kind=spec.kind, source=spec.source, device=device,
                 load_s=round(time.monotonic() - started, 2), max_batch=max_batch, platform=predictor.platform)
        return ServedEncoder(
            name=spec.name, kind=spec.kind, handle=client, dimensions=0, max_seq_len=0, vocab_size=0,
            labels=predictor.labels, max_waiting=max_waiting, version=spec.version, created=int(time.time()),
            mem_bytes=predictor_path(spec.source, spec.options.get("allow_pickle", False)).stat().st_size,
            inputs=[t.as_json() for t in predictor.inputs],
            outputs=[t.as_json() for t in predictor.outputs], platform=predictor.platform, warmup=predictor.example())
    if spec.kind == "image-classify":
        classifier, client = start_image_classifier(spec.ref, resolve_encoder_path(spec.source), worker, device, dtype,
                                                    batching)
        log.info("model loaded", model=spec.ref, kind=spec.kind, source=spec.source, device=device,
                 load_s=round(time.monotonic() - started, 2), max_batch=max_batch)
        return ServedEncoder(
            name=spec.name, kind=spec.kind, handle=client, dimensions=0, max_seq_len=0, vocab_size=0,
            labels=classifier.labels, max_waiting=max_waiting, version=spec.version, created=int(time.time()),
            mem_bytes=weights_bytes(classifier.model), warmup=classifier.example())
    encoder, client = start_encoder(spec.ref, spec.source, spec.kind, worker, device, dtype, batching)
    log.info("model loaded", model=spec.ref, kind=spec.kind, source=spec.source, device=device,
             load_s=round(time.monotonic() - started, 2), max_batch=max_batch)
    return ServedEncoder(
        name=spec.name, kind=spec.kind, handle=client, dimensions=encoder.dimensions,
        max_seq_len=encoder.max_seq_len, vocab_size=encoder.config.vocab_size, labels=encoder.labels,
        multi_label=encoder.multi_label, score_activation=encoder.score_activation, max_waiting=max_waiting,
        version=spec.version,
        created=int(time.time()), mem_bytes=weights_bytes(encoder.model),
    )


def unload_encoder(served: ServedEncoder) -> None:
    """Stop an encoder version once it has drained (blocking: run it off the event loop)."""
    served.handle.stop()
