"""Entry point: `python server.py` serves the demo model on 127.0.0.1:8000.

Parses flags, loads the config, starts the HTTP server (so /health answers while models
load), loads models on their device workers, then serves until SIGTERM/SIGINT, when it
drains: /ready turns 503, new work gets 503, idle WebSockets close, in-flight requests finish
(up to drain_seconds; what is left then is interrupted and checkpointed for a restart), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

import orjson
import structlog
from aiohttp import web

from api.app import begin_drain, create_app, interrupt
from api.auth import is_loopback
from api.oip_grpc.service import start_grpc
from api.services import SERVICES
from config import ConfigError, GalleyConfig, load_config, with_overrides
from engine.host_memory import keep_freed_memory
from engine.loader import ModelLoadError
from launch import EngineLoader, check_source, start_workers
from scheduling.router import Router
from services.server_state import ServerState
from services.tenancy import resolve_admin_key
from services.wiring import Settings
from storage.db import Database
from storage.registry import ModelVersion
from storage.tenants import TenantStore

log = structlog.get_logger("galley")

SHUTDOWN_GRACE_S = 5.0  # after the drain, how long handlers get to send their last bytes before aiohttp cancels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="galley: a self-hosted model inference server")
    p.add_argument("--config", help="path to a config.toml (default: embedded defaults)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--grpc-port", type=int, help="gRPC port of the Open Inference Protocol (default 8001; 0: off; "
                   "env GALLEY_GRPC_PORT)")
    p.add_argument("--auth", action="store_true", default=None,
                   help="require API keys on /v1 and /api (needed to bind beyond loopback)")
    p.add_argument("--model", action="append", default=[], metavar="PATH_OR_HF_ID|NAME=PATH",
                   help="add a generative model (repeatable)")
    p.add_argument("--model-option", action="append", default=[], metavar="NAME.OPTION=VALUE",
                   help="set a model's option, VALUE as JSON or a plain string (repeatable); e.g. "
                   "smollm2.quantization=int4, smollm2.sampling_defaults='{\"temperature\": 0.7}'")
    p.add_argument("--device", help="cpu, cuda, cuda:N, or a comma list such as cuda:0,cuda:1")
    p.add_argument("--data-dir", help="where the server keeps its state (default ./data)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, help="most sequences running at once per replica")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    p.add_argument("--kv-cache-gib", type=float, help="KV cache budget on CPU, GiB")
    p.add_argument("--log-format", choices=["json", "console"])
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> GalleyConfig:
    cfg = load_config(args.config)
    devices = tuple(d.strip() for d in args.device.split(",")) if args.device else None
    return with_overrides(
        cfg,
        server={"host": args.host, "port": args.port, "data_dir": args.data_dir, "log_format": args.log_format,
                "grpc_port": args.grpc_port if args.grpc_port is not None else env_int("GALLEY_GRPC_PORT")},
        engine={"devices": devices, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens},
        cache={"kv_cache_gib": args.kv_cache_gib},
        extra_models=args.model,
        model_options=args.model_option,
        auth={"enabled": args.auth},
    )


def env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a port number") from None


def model_source_problem(cfg: GalleyConfig) -> str | None:
    """The first configured model whose source cannot be found, said before anything starts."""
    for model in cfg.models:
        try:
            check_source(model.path, model.kind, model.options)
        except ModelLoadError as exc:
            return f"model `{model.name}` ([[models]] or --model): {exc}"
    return None


def without_missing_optional_models(cfg: GalleyConfig) -> GalleyConfig:
    """Drop configured models that carry an install hint and whose source is missing, saying how
    to get them (the embedded `smollm2` lives in a package that `make serve` installs)."""
    kept = []
    for model in cfg.models:
        if model.install_hint:
            try:
                check_source(model.path, model.kind, model.options)
            except ModelLoadError as exc:
                log.warning("model not served: its source is missing", model=model.name, reason=str(exc),
                            install=model.install_hint)
                continue
        kept.append(model)
    return dataclasses.replace(cfg, models=tuple(kept))


def open_database(cfg: GalleyConfig) -> tuple[Database, str]:
    """The data dir's database and the admin key's hash; a newly generated admin key is shown once."""
    db = Database(Path(cfg.server.data_dir) / "galley.db")
    try:
        configured = os.environ.get("GALLEY_ADMIN_KEY") or cfg.auth.admin_key
        admin_key_hash, new_key = resolve_admin_key(TenantStore(db), configured)
    except BaseException:
        db.close()
        raise
    if new_key is not None:  # on stderr, never through the logger
        print(f"admin key (shown once): {new_key}", file=sys.stderr, flush=True)
    return db, admin_key_hash


def configure_logging(fmt: str) -> None:
    """JSON lines (orjson, straight to stderr's bytes) or a console format; loggers are cached on
    first use. The access log writes a line per request, so its cost is on every request's path."""
    if fmt == "console":
        renderer, factory = structlog.dev.ConsoleRenderer(), structlog.PrintLoggerFactory(sys.stderr)
    else:
        renderer, factory = structlog.processors.JSONRenderer(serializer=orjson.dumps), structlog.BytesLoggerFactory(
            sys.stderr.buffer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


async def serve(cfg: GalleyConfig, db: Database, admin_key_hash: str) -> int:
    loop = asyncio.get_running_loop()
    if not keep_freed_memory():
        log.info("malloc thresholds left as they are (not glibc, or set in the environment)")
    router = Router(queue_timeout_s=cfg.scheduling.queue_timeout_seconds)
    state = ServerState(started_s=time.monotonic())

    def emit(events) -> None:
        loop.call_soon_threadsafe(router.dispatch, events)

    workers = start_workers(cfg.engine, emit)  # idle until the model manager attaches engines
    loader = EngineLoader(cfg.engine, cfg.scheduling.max_waiting, workers)
    observability = dataclasses.replace(cfg.observability, metrics_token=os.environ.get(
        "GALLEY_METRICS_TOKEN") or cfg.observability.metrics_token)
    settings = Settings(auth_enabled=cfg.auth.enabled, admin_key_hash=admin_key_hash, bind_host=cfg.server.host,
                        streams=cfg.streams, batch=cfg.batch, response_cache=cfg.response_cache,
                        lifecycle=cfg.lifecycle, deployments=cfg.deployments, observability=observability,
                        tracing=cfg.tracing, alerts=cfg.alerts)
    app = create_app(router, state, db=db, settings=settings, loader=loader)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, cfg.server.host, cfg.server.port)
    await site.start()
    log.info("listening", url=f"http://{cfg.server.host}:{cfg.server.port}", models=[m.name for m in cfg.models])
    try:
        grpc_server = await start_grpc(app[SERVICES], cfg.server.host, cfg.server.grpc_port) \
            if cfg.server.grpc_port else None
    except OSError as exc:
        log.error("cannot start the gRPC server (--grpc-port 0 turns it off)", error=str(exc))
        await runner.cleanup()
        stop_workers(workers)
        return 2
    if grpc_server is not None:
        log.info("listening (gRPC, Open Inference Protocol)", address=f"{cfg.server.host}:{cfg.server.grpc_port}")

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    seed = [ModelVersion(m.name, m.version, m.path, m.kind, m.options) for m in cfg.models]
    loading = asyncio.ensure_future(app[SERVICES].models.start(seed))  # the registry: config models, deployments, loads
    done, _ = await asyncio.wait([loading, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if loading not in done:
        loading.cancel()
        await stop_grpc(grpc_server)
        await runner.cleanup()
        stop_workers(workers)
        return 0
    try:
        loading.result()
    except Exception as exc:
        log.error("model loading failed", error=str(exc))
        await stop_grpc(grpc_server)
        await runner.cleanup()
        stop_workers(workers)
        return 1
    await app[SERVICES].streams.recover()  # streams a crash left running continue from their checkpoint
    await app[SERVICES].batch.recover()  # so do batch jobs, from their unfinished items
    state.ready = True
    freeze_startup_heap()
    log.info("ready")

    await stop.wait()
    await drain(app, router, cfg.server.drain_seconds)
    await stop_grpc(grpc_server)
    await runner.cleanup()
    stop_workers(workers)
    log.info("stopped")
    return 0


async def stop_grpc(server) -> None:
    if server is not None:
        await server.stop(grace=1.0)  # its calls were drained with the HTTP ones


async def drain(app: web.Application, router: Router, drain_seconds: float) -> None:
    """Refuse new work, let in-flight requests finish for up to `drain_seconds`, then interrupt
    the rest (a final error to each client; streams and batch items checkpointed for a restart)."""
    begin_drain(app)
    deadline = time.monotonic() + drain_seconds
    log.info("draining", in_flight=router.num_in_flight, drain_seconds=drain_seconds)
    while router.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if router.num_in_flight:
        log.warning("drain time is up: interrupting what is left", in_flight=router.num_in_flight)
        await interrupt(app)


def freeze_startup_heap() -> None:
    """Take what start-up built (~500K objects: torch, transformers, the app, the models) out of
    the garbage collector's sight, as vLLM does. Every full collection scanned all of it: 40 ms
    on a quiet machine, 350 ms under load, in whichever thread triggered it and holding the GIL,
    so the engine's worker (which needs the GIL between ops) stalled with it. Later objects
    are still collected."""
    gc.collect()
    gc.freeze()


def stop_workers(workers) -> None:
    for worker in workers:
        worker.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if not cfg.auth.enabled and not is_loopback(cfg.server.host):
        print(f"refusing to listen on {cfg.server.host} without auth: pass --auth (API keys required) "
              "or bind to a loopback address such as 127.0.0.1", file=sys.stderr)
        return 2
    configure_logging(cfg.server.log_format)
    cfg = without_missing_optional_models(cfg)
    problem = model_source_problem(cfg)
    if problem is not None:
        print(f"config error: {problem}", file=sys.stderr)
        return 2
    try:
        db, admin_key_hash = open_database(cfg)
    except (OSError, sqlite3.Error) as exc:
        print(f"cannot open the database in {cfg.server.data_dir}: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            import uvloop

            return uvloop.run(serve(cfg, db, admin_key_hash))
        except ImportError:
            return asyncio.run(serve(cfg, db, admin_key_hash))
    finally:
        db.close()


if __name__ == "__main__":
    sys.exit(main())
