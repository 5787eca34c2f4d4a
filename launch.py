"""Wires models, engines, schedulers and device workers together.

The one module that imports both `engine/` (torch) and `scheduling/`: the engine receives
its scheduler and the worker its emit callback from here, so neither imports the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from engine.engine import LLMEngine
from engine.kv_cache import KVCacheManager
from engine.loader import LoadedModel, load_model
from engine.model_runner import CacheConfig, ModelRunner, num_kv_blocks
from engine.worker import DeviceWorker, Emit
from scheduling.fair_queue import FairQueue, FairShareConfig
from scheduling.queue import FifoQueue
from scheduling.router import Replica, Router, ServedModel
from scheduling.scheduler import Scheduler, SchedulerConfig

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




def start_models(
    models: list[tuple[str, str]], cfg: EngineConfig, max_waiting: int, router: Router, emit: Emit
) -> list[DeviceWorker]:
    """Load every (name, source) on every device, register it with the router, start workers.

    Blocking (loads weights): run it off the event loop. Workers start only after all
    engines are attached, so no engine is added under a running worker.
    """
    workers = [DeviceWorker(f"{device}#{i}", emit) for i, device in enumerate(cfg.devices)]
    for name, source in models:
        started = time.monotonic()
        replicas, tokenizer, max_model_len = [], None, 0
        for worker, device in zip(workers, cfg.devices):
            loaded = load_model(source, device=device, dtype=cfg.dtype)
            engine = build_engine(loaded, cfg)
            worker.attach(name, engine)
            replicas.append(Replica(worker, name, worker.device))
            tokenizer, max_model_len = loaded.tokenizer, engine.max_model_len
        router.add_model(ServedModel(
            name=name, tokenizer=tokenizer, max_model_len=max_model_len,
            max_in_flight_per_replica=cfg.max_num_seqs + max_waiting, replicas=replicas,
            vocab_size=max(loaded.model.shape.vocab_size, len(tokenizer)),
            created=int(time.time()),
        ))
        log.info("model loaded", model=name, source=source, devices=list(cfg.devices),
                 load_s=round(time.monotonic() - started, 2), max_model_len=max_model_len)
    for worker in workers:
        worker.start()
    return workers
